"""The grafting benchmark: graft vs recompute vs llama.cpp, side by side in one run, per prefix length.

    python -m kvgraft_jax.main --model=gemma3_270m --mode=bench --bench=graft \
        --bench_lengths=512,2048,8192 --report=runs/bench/graft.json     # + graft.png beside it

For each prefix length L (tokens of a deterministic text):
- time to first token: recompute (prefill L with the chunk schedule, then the query) against graft
  (verified restore of the compacted artifact + insert + the same query), and their ratio; the
  two runs' logits are compared bit for bit at every decode step (reference (a));
- artifact bytes per token, full and compacted (the same state written both ways);
- restore + verify throughput against a plain read of the same files, and the canonical digest
  against `hashlib.sha256` on one core over the same bytes;
- decode tokens/s;
- llama.cpp (llama-cpp-python, the same thread count) where the model has a GGUF, twice: on the
  GGUF itself (`llama_cpp`, Q4_K_M for the embedded 270M) and on its unquantized copy
  (`llama_cpp_f32`, `gguf_import.dequantized_copy`: F32 tensors holding exactly the bf16 weights we
  run). Each: its prefill of the same ids, its state saved to a file and loaded back, its own graft
  (state load + the same query + first token), decode tokens/s, and whether the logits after the
  loaded state are bit-identical to its own run;
- the bytes one decode step must move on each side (`decode_bytes_per_step`: the weights, and the
  K/V slots the step reads), and so the memory rate each side reached: a ratio of decode speeds
  is explained by what each must read, not assumed to be waste.

Our graft and verified restore are sampled alternately with llama.cpp's state loads and grafts
on the GGUF (`_Ours.sample` between them), so each ratio compares medians from the same seconds.
Every number comes from this run; the JSON records the machine, versions and thread counts.
`python -m kvgraft_jax.bench.tables REPORT.json` prints the README's tables from the JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import logging

from kvgraft_jax.bench import artifact_bench
from kvgraft_jax.core import (
    attention,
    environment,
    gguf_import,
    host_memory,
    progress,
    sharding,
    tokenizer,
)
from kvgraft_jax.core import engine as engine_lib
from kvgraft_jax.exact import deposit, graft
from kvgraft_jax.run import runtime
from kvgraft_jax.store import chain, layout, manifest, writer
from kvgraft_jax.store import restore as restore_lib

QUERY = " Question: which token comes next? Answer:"
NEW_TOKENS = 16
TARGETS = {
    "graft_ttft_over_recompute_at_8192": 1 / 200,
    "compacted_over_full_bytes_at_8192": 0.25,
    "graft_restore_verify_per_token_over_llama_cpp_state_load_per_token": 1.0,
    "restore_verify_over_serial_floor_at_8192": 0.8,  # serial floor / restore + verify, at least
    "decode_tokens_per_s_over_llama_cpp_f32_at_8192": 1.0,  # at least
    "recompute_prefill_over_llama_cpp_f32_prefill_at_8192": 1.0,  # at most
}


class LlamaCppError(RuntimeError):
    """The llama.cpp side of the benchmark failed (its state file could not be saved or loaded)."""


def kv_bytes_read_per_step(
    config, context: int, *, block: int = 1, windowed: bool = True, value_bytes: int = 2
) -> int:
    """K and V bytes one decode step reads with `context` positions in the cache: a global layer
    all of them, a local layer its sliding window (`windowed`), each rounded up to the whole
    `block`s an attention reads. Ours: `attention.BLOCK`, windowed. llama.cpp here keeps a
    full-size SWA cache (its log says so: needed for its state files) and scores every cell of
    it, so `windowed=False`, block 1. An estimate of what must move, not a measurement."""
    per_slot = 2 * config.num_kv_heads * config.head_dim * value_bytes
    whole = -(-context // block) * block
    # A window not aligned to blocks touches one block more than it covers.
    window = (-(-config.sliding_window_size // block) + (block > 1)) * block
    slots = sum(
        whole if kind.name == "GLOBAL" or not windowed else min(whole, window)
        for kind in config.attention_types
    )
    return slots * per_slot


def decode_traffic(weights_bytes: int, kv_bytes: int, tokens_per_s: float) -> dict[str, float]:
    step = weights_bytes + kv_bytes
    return {
        "weights_bytes": weights_bytes,
        "kv_bytes_read": kv_bytes,
        "decode_bytes_per_step": step,
        "decode_gb_per_s": step * tokens_per_s / 1e9,
    }


def machine_info() -> dict[str, Any]:
    """What a benchmark ran on, for its JSON."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "jax_devices": [str(d) for d in jax.devices()],
        # Whether freed host buffers stayed with the process (`host_memory`; the CLI sets it).
        "freed_pages_kept": host_memory.KEPT,
    }


def prefix_ids(tok, length: int) -> list[int]:
    """`length` token ids (BOS first) of a deterministic text, long enough for any length."""
    ids: list[int] = []
    seed = 0
    while len(ids) < length:
        ids += tok.encode(tokenizer.tiny_corpus(num_lines=2000, seed=seed), add_bos=not ids)
        seed += 1
    return ids[:length]


# Restores, grafts and their limits take tens of milliseconds and vary by +-15% run to run here:
# take the median of more of them than of the seconds-long prefills. llama.cpp's state loads and
# grafts are as many, alternating with ours.
RESTORE_REPEATS = 9


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _jax_side(cfg, loaded, mesh, tok, length: int, directory: str) -> _Ours:
    """Deposits the prefix, recomputes the reference and warms the graft: what a run times
    next (`_Ours.sample`), alone or alternately with llama.cpp's graft."""
    ids = prefix_ids(tok, length)
    query = tok.encode(QUERY, add_bos=False)
    batch = np.asarray([ids], np.int32)
    query_batch = np.asarray([query], np.int32)
    eng = engine_lib.Engine(
        loaded.module,
        loaded.params,
        mesh,
        batch_size=1,
        cache_length=length + len(query) + NEW_TOKENS,
    )
    eng.compile(
        engine_lib.chunk_schedule(length, cfg.chunk_size),
        engine_lib.chunk_schedule(len(query), cfg.chunk_size, start=length),
        decode=True,
    )
    info = loaded.info
    compact_path = os.path.join(directory, f"prefix_{length}")
    deposited = deposit.deposit(
        eng,
        batch,
        chunk_size=cfg.chunk_size,
        path=compact_path,
        model=info,
        tokenizer=tok.info(),
        versions=environment.versions(),
        compact=True,
    )
    # The same state written without compaction: the full bytes, nothing recomputed.
    full_digests, full_root = layout.digest_state(deposited.state)
    full_path = os.path.join(directory, f"prefix_{length}_full")
    writer.write(
        full_path,
        deposited.state,
        dataclasses.replace(
            deposited.manifest,
            compaction=None,
            arrays=layout.array_entries(deposited.state, full_digests),
            root=full_root,
            files=[],
        ),
    )
    compact_bytes = sum(f.size for f in manifest.read_manifest(compact_path).files)
    full_bytes = sum(f.size for f in manifest.read_manifest(full_path).files)
    links = chain.resolve_chain(compact_path)

    # Recompute: the recorded schedule, then the query, on the same programs.
    started = time.perf_counter()
    replayed = graft.replay_prefix(eng, links)
    prefill_s = time.perf_counter() - started
    reference = graft.continue_from(
        eng,
        replayed.state,
        query_batch,
        chunk_size=cfg.chunk_size,
        max_new_tokens=NEW_TOKENS,
        dropped=graft.Dropped.of(links),
    )
    recompute_ttft = prefill_s + reference.first_token_s

    # Warm, like the recompute side: the first graft compiles the insert and zero-fill programs.
    graft.graft(eng, compact_path, query_batch, max_new_tokens=NEW_TOKENS)

    return _Ours(
        length=length,
        ids=ids,
        query_tokens=len(query),
        chunk_size=cfg.chunk_size,
        eng=eng,
        path=compact_path,
        query_batch=query_batch,
        reference=reference,
        prefill_s=prefill_s,
        recompute_ttft_s=recompute_ttft,
        compact_bytes=compact_bytes,
        full_bytes=full_bytes,
        weights_bytes=sum(x.nbytes for x in jax.tree.leaves(loaded.params)),
        config=loaded.config,
    )


@dataclasses.dataclass
class _Ours:
    """One length's graft and verified restore, ready to time. `sample` times one of each; a run
    with llama.cpp calls it between llama.cpp's own state loads and grafts, so both sides' medians
    come from the same seconds (this 2-core host's speed drifts by up to a third over minutes,
    and the two sides used to be timed a minute apart)."""

    length: int
    ids: list[int]
    query_tokens: int
    chunk_size: int
    eng: engine_lib.Engine
    path: str
    query_batch: np.ndarray
    reference: graft.Continuation
    prefill_s: float
    recompute_ttft_s: float
    compact_bytes: int
    full_bytes: int
    weights_bytes: int
    config: Any
    restores: list[restore_lib.Restored] = dataclasses.field(default_factory=list)
    grafts: list[graft.Grafted] = dataclasses.field(default_factory=list)

    def sample(self) -> None:
        # As a graft restores: the stored arrays, no zero-filled copy of the dropped slots. Its
        # state is dropped at once: only the timings and root are kept.
        restored = restore_lib.restore(self.path, self.eng.mesh, expand=False)
        self.restores.append(dataclasses.replace(restored, state=None))
        self.grafts.append(
            graft.graft(self.eng, self.path, self.query_batch, max_new_tokens=NEW_TOKENS)
        )

    def row(self, repeats: int) -> dict[str, Any]:
        """The length's report row, with at least `RESTORE_REPEATS` samples taken."""
        while len(self.restores) < RESTORE_REPEATS:
            self.sample()
        mesh, reference = self.eng.mesh, self.reference

        def ttft(g) -> float:
            return g.ttft_s  # the whole call to the first token, manifest reads and checks included

        # The median graft: one graft's query prefill varied 2x from run to run here.
        grafts = sorted(self.grafts, key=ttft)
        grafted = grafts[len(grafts) // 2]
        p = grafted.prefix
        graft_ttft = ttft(grafted)
        verdict = graft.compare(grafted.run, reference)
        # Every sample must be bit-identical too, not only the one whose timing is reported.
        all_identical = all(graft.compare(g.run, reference).bit_identical for g in grafts)

        # Restore + verify vs a plain read of the same files; digest vs hashlib on one core.
        limit = artifact_bench.restore_limit(self.path, mesh, repeats=RESTORE_REPEATS)
        plain_s = limit["plain_read_s"]
        # The whole call, manifest read and checks included: what a caller of restore waits for.
        restore_verify_s = statistics.median(r.total_s for r in self.restores)
        state = restore_lib.restore(self.path, mesh, expand=False).state
        host = [np.asarray(x) for x in jax.tree.leaves(state.layers)]
        state_bytes = sum(x.nbytes for x in host)
        digest_s = _median_time(lambda: layout.digest_state(state), repeats)

        def one_core():
            h = hashlib.sha256()
            for a in host:
                h.update(a.reshape(-1).view(np.uint8).data)

        hashlib_s = _median_time(one_core, repeats)
        run = grafted.run
        decode_tps = run.decode_steps / run.decode_s if run.decode_s else 0.0
        length, query_tokens = self.length, self.query_tokens
        kv_read = kv_bytes_read_per_step(self.config, length + query_tokens, block=attention.BLOCK)
        compact_bytes, full_bytes = self.compact_bytes, self.full_bytes
        return {
            "tokens": length,
            "query_tokens": query_tokens,
            "ids_sha256": hashlib.sha256(np.asarray(self.ids, np.int32).tobytes()).hexdigest(),
            "chunk_size": self.chunk_size,
            "samples": len(self.restores),
            "recompute_prefill_s": self.prefill_s,
            "recompute_ttft_s": self.recompute_ttft_s,
            "graft_ttft_s": graft_ttft,
            "graft_parts_s": {
                "restore": p.restore_s,
                "verify": p.verify_s,
                "insert": p.insert_s,
                "query_and_first_token": run.first_token_s,
                "manifests_and_the_rest": graft_ttft
                - (p.restore_s + p.verify_s + p.insert_s + run.first_token_s),
            },
            "graft_over_recompute_ttft": graft_ttft / self.recompute_ttft_s,
            "bit_identical": verdict.bit_identical and all_identical,
            "argmax_agreement": verdict.argmax_agreement,
            "bytes": {
                "full": full_bytes,
                "compacted": compact_bytes,
                "full_per_token": full_bytes / length,
                "compacted_per_token": compact_bytes / length,
                "compacted_over_full": compact_bytes / full_bytes,
            },
            "restore": {
                "plain_read_s": plain_s,
                "restore_verify_s": restore_verify_s,
                "restore_verify_over_plain_read": restore_verify_s / plain_s,
                "sha256_all_cores_s": limit["sha256_all_cores_s"],
                "limit_s": limit["limit_s"],
                "efficiency": artifact_bench.efficiency(limit["limit_s"], restore_verify_s),
                "serial_floor_s": limit["serial_floor_s"],
                "efficiency_vs_serial_floor": limit["serial_floor_s"] / restore_verify_s,
                "tensorstore_read_s": limit["tensorstore_read_s"],
                "tensorstore_floor_s": limit["tensorstore_floor_s"],
                "efficiency_vs_tensorstore_floor": limit["tensorstore_floor_s"] / restore_verify_s,
                "restore_verify_per_token_s": restore_verify_s / length,
            },
            "digest": {
                "state_bytes": state_bytes,
                "digest_all_cores_s": digest_s,
                "hashlib_one_core_s": hashlib_s,
                "speedup": hashlib_s / digest_s if digest_s else 0.0,
            },
            "decode_tokens_per_s": decode_tps,
            "decode_traffic": decode_traffic(self.weights_bytes, kv_read, decode_tps),
        }


def load_llama(path, **kwargs):
    """A `llama_cpp.Llama` with weight repacking off (`use_extra_bufts=False`, llama.cpp's
    `--no-repack`): the same CPU kernels on every x86 machine. With repacking on, a CPU that
    reports AMX gets llama.cpp's AMX backend, which segfaulted in the first decode on this VM."""
    import llama_cpp

    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def no_repack():
        params = defaults()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = no_repack
    try:
        return llama_cpp.Llama(model_path=str(path), verbose=False, **kwargs)
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = defaults


def _last_logits(llm) -> np.ndarray:
    """The last evaluated position's logits, copied out of llama.cpp's context."""
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).astype(np.float32)


def llama_cpp_side(
    gguf_path: str,
    ids: list[int],
    query: list[int],
    directory: str,
    *,
    config=None,
    between: Callable[[], None] | None = None,
):
    """llama.cpp on the same GGUF and ids: prefill, state file save/load, logits bit-identity;
    with the gemma `config`, the bytes a decode step moves (its file's weights, its f16 K/V).
    `between` runs before each of its state loads and grafts: our side's sample, so the two are
    timed alternately."""
    try:
        import llama_cpp
    except ImportError:
        return {"skipped": "llama-cpp-python is not installed (requirements/crosscheck.lock)"}
    threads = os.cpu_count() or 1
    llm = load_llama(
        gguf_path,
        n_ctx=len(ids) + len(query) + NEW_TOKENS,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        seed=0,
    )
    import ctypes

    path = str(Path(directory) / f"llama_state_{len(ids)}.bin").encode()
    try:
        started = time.perf_counter()
        llm.eval(ids)
        prefill_s = time.perf_counter() - started
        # llama.cpp's own state file (llama_state_save_file / _load_file: KV cache, logits and the
        # token ids), not the Python wrapper's save_state, which also copies its score buffers.
        tokens = (llama_cpp.llama_token * len(ids))(*ids)
        started = time.perf_counter()
        if not llama_cpp.llama_state_save_file(llm._ctx.ctx, path, tokens, len(ids)):
            raise LlamaCppError("llama_state_save_file failed")
        save_s = time.perf_counter() - started
        llm.eval(query)
        computed = _last_logits(llm)
        started = time.perf_counter()
        decode_from = llm.n_tokens
        for _ in range(NEW_TOKENS - 1):
            llm.eval([int(np.argmax(_last_logits(llm)))])
        decode_s = time.perf_counter() - started
        decoded = llm.n_tokens - decode_from
        # Its graft, repeated as ours is (the median of RESTORE_REPEATS): one sample of each
        # side's ~80 ms moved the ratio by a tenth between runs of the same code.
        loads, grafts = [], []
        for _ in range(RESTORE_REPEATS):
            if between is not None:
                between()
            out = (llama_cpp.llama_token * llm.n_ctx())()
            count = ctypes.c_size_t(0)
            started = time.perf_counter()
            if not llama_cpp.llama_state_load_file(
                llm._ctx.ctx, path, out, llm.n_ctx(), ctypes.byref(count)
            ):
                raise LlamaCppError("llama_state_load_file failed")
            loads.append(time.perf_counter() - started)
            if list(out[: count.value]) != ids:
                raise LlamaCppError("llama.cpp's state file holds other token ids")
            llm.n_tokens = count.value
            llm.input_ids[: count.value] = ids
            llm.eval(query)
            restored = _last_logits(llm)
            first_token = int(np.argmax(restored))
            grafts.append(time.perf_counter() - started)  # state load, query, first token
        load_s, graft_ttft_s = statistics.median(loads), statistics.median(grafts)
        state_bytes = os.path.getsize(path)
    finally:
        llm.close()
    delta = np.abs(restored - computed)
    tokens_per_s = decoded / decode_s if decode_s else 0.0
    side = {
        "threads": threads,
        "prefill_s": prefill_s,
        "state_bytes": state_bytes,
        "state_save_s": save_s,
        "state_load_s": load_s,
        "state_load_per_token_s": load_s / len(ids),
        # llama.cpp's own graft: load its state file, evaluate the same query, pick the first
        # token; the peer of our graft_ttft_s.
        "graft_ttft_s": graft_ttft_s,
        "graft_first_token": first_token,
        "restored_logits_bit_identical": bool(
            np.array_equal(restored.view(np.uint32), computed.view(np.uint32))
        ),
        "restored_max_abs_logit_diff": float(delta.max()),
        "restored_argmax_agrees": bool(np.argmax(restored) == np.argmax(computed)),
        "decode_tokens_per_s": tokens_per_s,
        "gguf_bytes": os.path.getsize(gguf_path),
    }
    if config is not None:  # its file is its tensors, bar a few MB of vocabulary; f16 K/V
        kv_read = kv_bytes_read_per_step(config, len(ids) + len(query), windowed=False)
        side["decode_traffic"] = decode_traffic(side["gguf_bytes"], kv_read, tokens_per_s)
    return side


@dataclasses.dataclass(frozen=True)
class GraftBench:
    """The JSON report of `--mode=bench --bench=graft`."""

    config: dict[str, Any]
    model: str
    mesh: str
    machine: dict[str, Any]
    versions: dict[str, str]
    lengths: list[dict[str, Any]]
    targets: dict[str, Any]
    plot: str | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    at = {row["tokens"]: row for row in rows}
    row = at.get(8192)
    if row is None:
        return {"note": "the targets are stated at 8,192 tokens; not in --bench_lengths"}
    # What is left at the format's floor: each restore figure again with restore + verify at
    # TensorStore's read of the same arrays plus SHA-256 on all cores, all else as measured. A
    # target that misses even there cannot be met by a faster restore of this format here.
    restore, parts = row["restore"], row["graft_parts_s"]
    floor_s = restore["tensorstore_floor_s"]
    graft_at_floor = row["graft_ttft_s"] - parts["restore"] - parts["verify"] + floor_s
    ttft = row["graft_over_recompute_ttft"]
    limit = TARGETS["graft_ttft_over_recompute_at_8192"]
    out["graft_ttft_over_recompute_at_8192"] = {
        "value": ttft,
        "target": limit,
        "met": ttft <= limit,
        "at_tensorstore_floor": graft_at_floor / row["recompute_ttft_s"],
    }
    share = row["bytes"]["compacted_over_full"]
    limit = TARGETS["compacted_over_full_bytes_at_8192"]
    out["compacted_over_full_bytes_at_8192"] = {
        "value": share,
        "target": limit,
        "met": share <= limit,
    }
    out["restore_verify_efficiency_at_8192"] = {
        **restore["efficiency"],
        "at_tensorstore_floor": restore["limit_s"] / floor_s,
    }
    llama = row.get("llama_cpp") or {}
    if "graft_ttft_s" in llama:
        ratio = row["graft_ttft_s"] / llama["graft_ttft_s"]
        out["graft_ttft_over_llama_cpp_graft_ttft_at_8192"] = {
            "value": ratio,
            "target": 1.0,
            "met": ratio <= 1.0,
            "at_tensorstore_floor": graft_at_floor / llama["graft_ttft_s"],
        }
    if "state_load_per_token_s" in llama:
        ours = restore["restore_verify_per_token_s"]
        ratio = ours / llama["state_load_per_token_s"]
        out["graft_restore_verify_per_token_over_llama_cpp_state_load_per_token"] = {
            "value": ratio,
            "target": 1.0,
            "met": ratio <= 1.0,
            "at_tensorstore_floor": floor_s / row["tokens"] / llama["state_load_per_token_s"],
        }
    out["restore_verify_over_serial_floor_at_8192"] = {
        **_at_least(
            restore["efficiency_vs_serial_floor"], "restore_verify_over_serial_floor_at_8192"
        ),
        "at_tensorstore_floor": restore["serial_floor_s"] / floor_s,
    }
    f32 = row.get("llama_cpp_f32") or {}
    if f32.get("decode_tokens_per_s"):
        name = "decode_tokens_per_s_over_llama_cpp_f32_at_8192"
        out[name] = _at_least(row["decode_tokens_per_s"] / f32["decode_tokens_per_s"], name)
    if f32.get("prefill_s"):
        name = "recompute_prefill_over_llama_cpp_f32_prefill_at_8192"
        ratio = row["recompute_prefill_s"] / f32["prefill_s"]
        out[name] = {"value": ratio, "target": TARGETS[name], "met": ratio <= TARGETS[name]}
    if llama.get("decode_tokens_per_s") and "decode_traffic" in llama:
        # Against the quantized file: reported with what each side must read, not a target.
        ours, theirs = row["decode_traffic"], llama["decode_traffic"]
        out["decode_against_llama_cpp_q4_at_8192"] = {
            "tokens_per_s_ratio": row["decode_tokens_per_s"] / llama["decode_tokens_per_s"],
            "bytes_per_step_ratio": ours["decode_bytes_per_step"] / theirs["decode_bytes_per_step"],
            "gb_per_s": {"ours": ours["decode_gb_per_s"], "llama_cpp": theirs["decode_gb_per_s"]},
        }
    return out


def _at_least(value: float, name: str) -> dict[str, Any]:
    return {"value": value, "target": TARGETS[name], "met": value >= TARGETS[name]}


def plot(rows: list[dict[str, Any]], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r["tokens"] for r in rows]
    xs = np.arange(len(lengths))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = [
        ("recompute (JAX)", [r["recompute_ttft_s"] for r in rows]),
        ("graft (JAX)", [r["graft_ttft_s"] for r in rows]),
    ]
    if all("prefill_s" in (r.get("llama_cpp") or {}) for r in rows):
        series.append(("llama.cpp prefill", [r["llama_cpp"]["prefill_s"] for r in rows]))
        series.append(("llama.cpp state load", [r["llama_cpp"]["state_load_s"] for r in rows]))
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series):
        left.bar(xs + (k - (len(series) - 1) / 2) * width, values, width, label=label)
    left.set_yscale("log")
    left.set_xticks(xs, [str(n) for n in lengths])
    left.set_xlabel("prefix tokens")
    left.set_ylabel("seconds (log)")
    left.set_title("Time to first token / state load")
    left.legend(fontsize=8)
    full = [r["bytes"]["full_per_token"] for r in rows]
    compact = [r["bytes"]["compacted_per_token"] for r in rows]
    right.bar(xs - 0.2, full, 0.4, label="full")
    right.bar(xs + 0.2, compact, 0.4, label="compacted")
    if all("state_bytes" in (r.get("llama_cpp") or {}) for r in rows):
        right.plot(
            xs,
            [r["llama_cpp"]["state_bytes"] / r["tokens"] for r in rows],
            "k.--",
            label="llama.cpp state file",
        )
    right.set_xticks(xs, [str(n) for n in lengths])
    right.set_xlabel("prefix tokens")
    right.set_ylabel("bytes per token")
    right.set_title("Artifact bytes per token")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg, *, repeats: int = 3, directory: str | None = None) -> GraftBench:
    mesh, tok, loaded = runtime.start(cfg, text_for="--bench=graft")
    source = runtime.weights_source(cfg)
    gguf = source if source and runtime.is_gguf(source) else None
    rows = []
    with tempfile.TemporaryDirectory(dir=directory, prefix="kvgraft-graft-bench-") as tmp:
        peers = {}
        if gguf is not None:
            peers["llama_cpp"] = gguf
            if _has_llama_cpp():  # the same weights unquantized: the same bytes per weight as ours
                logging.info("graft bench: writing the unquantized copy of %s", gguf)
                peers["llama_cpp_f32"] = str(
                    gguf_import.dequantized_copy(gguf, Path(tmp) / "unquantized.gguf")
                )
        for length in progress.bar(cfg.bench_lengths, desc="graft bench", unit="length"):
            logging.info("graft bench: %d tokens", length)
            ours = _jax_side(cfg, loaded, mesh, tok, length, tmp)
            sides = {}
            if gguf is None:
                sides["llama_cpp"] = {"skipped": f"{cfg.model} has no GGUF here"}
            for name, path in peers.items():
                sides[name] = llama_cpp_side(
                    path,
                    ours.ids,
                    tok.encode(QUERY, add_bos=False),
                    tmp,
                    config=loaded.config,
                    # Our graft and restore alternate with the GGUF's own (the targets' peer).
                    between=ours.sample if name == "llama_cpp" else None,
                )
            rows.append(ours.row(repeats) | sides)
            del ours  # its engine and cache
    plot_path = None
    if cfg.report:
        plot_path = str(Path(cfg.report).with_suffix(".png"))
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        plot(rows, plot_path)
    return GraftBench(
        config=cfg.to_json(),
        model=loaded.name,
        mesh=str(sharding.MeshSpec(**dict(mesh.shape))),
        machine=machine_info() | {"jax_threads": "XLA CPU default (all cores)"},
        versions=environment.versions() | _llama_version(),
        lengths=rows,
        targets=targets(rows),
        plot=plot_path,
    )


def _has_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _llama_version() -> dict[str, str]:
    try:
        import llama_cpp
    except ImportError:
        return {}
    return {"llama_cpp_python": llama_cpp.__version__}
