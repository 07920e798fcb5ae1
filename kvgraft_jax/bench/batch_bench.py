"""The batch benchmark: a queue of grafts (and of fresh attempts) through B rows, side by side for
every B in one run.

    python -m kvgraft_jax.main --model=gemma3_270m --mode=bench --bench=batch \
        --bench_batch_sizes=1,4,8 --report=runs/bench/batch.json        # + batch.png beside it

The same items for every B: `hits` graft one of four artifacts (prefixes of 256 to 1,024 tokens
of a deterministic text, deposited once) and read a 9-token query; `attempts` graft nothing and
read a 64-token problem. Each item decodes `--max_new_tokens` tokens (no stop token, so every B
does the same work). For each B, over the whole queue (manifest reads, verified restores,
inserts, query steps and decode all inside the timer, compiling outside it; each queue timed
`TIMED_RUNS` times, the median run reported):
- items/s and decode tokens/s, and their ratios to B = 1 (target: decode at B = 8 at least 3x);
- exactness: the hits' run replayed as its batch reference (the recorded schedule, every prefix
  recomputed), bit-identical or not;
- against the same items run alone (B = 1): how many items' logits are bit-identical, and the
  argmax agreement. Batching changes the programs (matrix-matrix products, GEMM weights on
  CPU), so this is measured, not assumed.
Rows are split over the mesh's `data` axis where it divides them.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging

from kvgraft_jax.bench import graft_bench
from kvgraft_jax.core import engine as engine_lib
from kvgraft_jax.core import environment, progress, sharding
from kvgraft_jax.exact import batch, deposit
from kvgraft_jax.run import runtime

PREFIX_LENGTHS = (256, 512, 768, 1024)
ATTEMPT_TOKENS = 64
ITEMS_PER_ROW = 2  # the queue holds twice the largest batch: every row is refilled at least once
# Each queue is timed this many times (hits and attempts interleaved) and its median run reported:
# on the 2-core VM that measured it, the same 8-row queue's decode rate varied by a third between
# runs of one process, enough to turn a ratio's verdict. The runs must also be bit-identical.
TIMED_RUNS = 3
TARGET_DECODE_AT_8_OVER_1 = 3.0


@dataclasses.dataclass(frozen=True)
class BatchBench:
    """The JSON report of `--mode=bench --bench=batch`."""

    config: dict[str, Any]
    model: str
    mesh: str
    machine: dict[str, Any]
    versions: dict[str, str]
    items: dict[str, Any]
    batch_sizes: list[dict[str, Any]]
    targets: dict[str, Any]
    plot: str | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _queues(tok, paths: list[str], count: int, new_tokens: int):
    text = graft_bench.prefix_ids(tok, 4096)
    query = tok.encode(graft_bench.QUERY, add_bos=False)
    hits = [
        batch.BatchItem(
            paths[n % len(paths)],
            np.asarray([*query[:-1], text[1000 + n]], np.int32),  # distinct queries, 9 tokens
            new_tokens,
        )
        for n in range(count)
    ]
    attempts = [
        batch.BatchItem(
            None,
            np.asarray(text[2000 + 97 * n : 2000 + 97 * n + ATTEMPT_TOKENS], np.int32),
            new_tokens,
        )
        for n in range(count)
    ]
    return hits, attempts


def _median_run(runs: list[batch.BatchRun]) -> batch.BatchRun:
    """The run whose decode rate is the median of `runs` (an odd number of them)."""
    return sorted(runs, key=lambda r: r.decode_tokens_per_s)[len(runs) // 2]


def _timed(run: batch.BatchRun, runs: list[batch.BatchRun]) -> dict[str, Any]:
    """`run`'s timings (the median of `runs`), each run's decode rate, and whether every run
    produced the same tokens and logits (a repeat is also a determinism check)."""
    firsts = [r.first_token_s for r in run.items]
    return {
        "timed_runs": len(runs),
        "decode_tokens_per_s_runs": [r.decode_tokens_per_s for r in runs],
        "runs_bit_identical": all(batch.compare(r, runs[0]).bit_identical for r in runs[1:]),
        "items": len(run.items),
        "seconds": run.seconds,
        "items_per_s": len(run.items) / run.seconds,
        "decode_tokens": run.decode_tokens,
        "decode_s": run.decode_s,
        "decode_tokens_per_s": run.decode_tokens_per_s,
        "tokens_per_s": sum(len(r.token_ids) for r in run.items) / run.seconds,
        "mean_first_token_s": float(np.mean(firsts)),
        "mean_prefix_s": float(np.mean([r.prefix_s for r in run.items])),
        "steps": len(run.schedule.steps),
    }


def _one_size(loaded, mesh, rows: int, hits, attempts, chunk_size: int, alone_hits):
    slots = batch.cache_length([*hits, *attempts], chunk_size)
    eng = batch.batch_engine(
        loaded.module, loaded.params, mesh, batch_size=rows, cache_length=slots
    )
    # Compile (and warm) every program this size runs, outside the timed runs.
    batch.run(eng, hits[:rows], batch.grafted(eng), chunk_size=chunk_size)
    batch.run(eng, attempts[:rows], batch.grafted(eng), chunk_size=chunk_size)
    hit_runs, attempt_runs = [], []
    for _ in range(TIMED_RUNS):
        hit_runs.append(batch.run(eng, hits, batch.grafted(eng), chunk_size=chunk_size))
        attempt_runs.append(batch.run(eng, attempts, batch.grafted(eng), chunk_size=chunk_size))
    grafted, tried = _median_run(hit_runs), _median_run(attempt_runs)
    single = engine_lib.Engine(
        loaded.module, loaded.params, mesh, batch_size=1, cache_length=eng.kv_shape.cache_length
    )
    reference = batch.run(
        eng, hits, batch.recomputed(single), chunk_size=chunk_size, plan=grafted.schedule
    )
    verdict = batch.compare(grafted, reference)
    row: dict[str, Any] = {
        "batch_size": rows,
        "weight_layout": eng.weight_layout,
        "rows_sharded_over_data": eng.mesh.shape[sharding.DATA] > 1
        and rows % eng.mesh.shape[sharding.DATA] == 0,
        "cache_slots": eng.kv_shape.cache_length,
        "hits": _timed(grafted, hit_runs),
        "attempts": _timed(tried, attempt_runs),
        "reference": {
            "bit_identical": verdict.bit_identical,
            "identical_items": verdict.identical_items,
            "items": verdict.items,
        },
    }
    if alone_hits is not None:
        against = batch.compare(grafted, alone_hits)
        row["against_alone"] = {
            "identical_items": against.identical_items,
            "items": against.items,
            "argmax_agreement": against.argmax_agreement,
        }
    return row, grafted


def targets(sizes: list[dict[str, Any]]) -> dict[str, Any]:
    at = {s["batch_size"]: s for s in sizes}
    if 1 not in at or 8 not in at:
        return {"note": "the target compares B = 8 with B = 1; give both in --bench_batch_sizes"}
    ratio = at[8]["hits"]["decode_tokens_per_s"] / at[1]["hits"]["decode_tokens_per_s"]
    return {
        "decode_tokens_per_s_at_8_over_1": {
            "value": ratio,
            "target": TARGET_DECODE_AT_8_OVER_1,
            "met": ratio >= TARGET_DECODE_AT_8_OVER_1,
        }
    }


def plot(sizes: list[dict[str, Any]], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = np.arange(len(sizes))
    labels = [str(s["batch_size"]) for s in sizes]
    for offset, kind in ((-0.2, "hits"), (0.2, "attempts")):
        left.bar(xs + offset, [s[kind]["decode_tokens_per_s"] for s in sizes], 0.4, label=kind)
        right.bar(xs + offset, [s[kind]["items_per_s"] for s in sizes], 0.4, label=kind)
    for ax, title in ((left, "Decode tokens/s"), (right, "Items/s (whole queue)")):
        ax.set_xticks(xs, labels)
        ax.set_xlabel("batch size (rows)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg, *, directory: str | None = None) -> BatchBench:
    mesh, tok, loaded = runtime.start(cfg, text_for="--bench=batch")
    sizes = sorted(set(cfg.bench_batch_sizes))
    count = ITEMS_PER_ROW * max(sizes)
    rows_out = []
    with tempfile.TemporaryDirectory(dir=directory, prefix="kvgraft-batch-bench-") as tmp:
        depositor = engine_lib.Engine(
            loaded.module, loaded.params, mesh, batch_size=1, cache_length=max(PREFIX_LENGTHS)
        )
        text = graft_bench.prefix_ids(tok, max(PREFIX_LENGTHS))
        paths = []
        for length in progress.bar(PREFIX_LENGTHS, desc="batch bench: deposits", unit="artifact"):
            paths.append(
                str(
                    deposit.deposit(
                        depositor,
                        np.asarray([text[:length]], np.int32),
                        chunk_size=cfg.chunk_size,
                        path=os.path.join(tmp, f"prefix_{length}"),
                        model=loaded.info,
                        tokenizer=tok.info(),
                        versions=environment.versions(),
                    ).path
                )
            )
        hits, attempts = _queues(tok, paths, count, cfg.max_new_tokens)
        alone = None
        for rows in progress.bar(sizes, desc="batch bench", unit="batch size"):
            logging.info("batch bench: %d rows, %d items", rows, count)
            row, grafted = _one_size(loaded, mesh, rows, hits, attempts, cfg.chunk_size, alone)
            if rows == 1:
                alone = grafted
            rows_out.append(row)
    base = next((s for s in rows_out if s["batch_size"] == 1), None)
    for s in rows_out:
        if base is not None:
            s["over_batch_of_one"] = {
                kind: {
                    key: s[kind][key] / base[kind][key]
                    for key in ("items_per_s", "decode_tokens_per_s", "tokens_per_s")
                }
                for kind in ("hits", "attempts")
            }
    plot_path = None
    if cfg.report:
        plot_path = str(Path(cfg.report).with_suffix(".png"))
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        plot(rows_out, plot_path)
    return BatchBench(
        config=cfg.to_json(),
        model=loaded.name,
        mesh=str(sharding.MeshSpec(**dict(mesh.shape))),
        machine=graft_bench.machine_info(),
        versions=environment.versions(),
        items={
            "count": count,
            "hit_prefix_tokens": list(PREFIX_LENGTHS),
            "hit_query_tokens": len(hits[0].query_ids),
            "attempt_tokens": ATTEMPT_TOKENS,
            "new_tokens_per_item": cfg.max_new_tokens,
            "chunk_size": cfg.chunk_size,
        },
        batch_sizes=rows_out,
        targets=targets(rows_out),
        plot=plot_path,
    )
