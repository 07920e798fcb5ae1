"""Batches from a file: `--mode=graft --batch_file=F` grafts every item of F in a ragged batch of
`--batch_size` rows and writes, with the results, the batch schedule that is their contract;
`--mode=verify --batch_file=F` does the same and proves it against the batch reference in the same
run; `--mode=verify --batch_report=R` proves an earlier run's recorded results later, in another
process (the workflow a batch job's user runs: answer now, prove when asked).

A batch file is JSONL, one item per line:

    {"id": "q1", "artifact": "artifacts/manual", "query": "How do I reset it?"}
    {"id": "q2", "artifact": null, "query_ids": [2, 651, 235], "max_new_tokens": 8}

`artifact` (a directory, local or gs://; relative paths are read from the batch file's folder;
null or absent: no prefix, a fresh attempt), `query` (text) or `query_ids` (token ids), and
optionally `id` and `max_new_tokens` (default `--max_new_tokens`). A query after a prefix
continues it (no BOS); a query without one starts a text (BOS first).
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import logging

from kvgraft_jax.cli import reports
from kvgraft_jax.core import engine as engine_lib
from kvgraft_jax.core import progress, sharding
from kvgraft_jax.exact import batch
from kvgraft_jax.run import config as config_lib
from kvgraft_jax.run import inputs, runtime

MAX_ITEMS = 100_000  # a batch job's queue; more is a file to split, not one run
MAX_FILE_BYTES = 256 << 20
_KEYS = frozenset({"id", "artifact", "query", "query_ids", "max_new_tokens"})


@dataclasses.dataclass(frozen=True)
class FileItem:
    """One line of a batch file, resolved: the artifact's path and the query's ids."""

    id: str
    artifact: str | None
    query_ids: tuple[int, ...]
    max_new_tokens: int


def _resolve(value: str, folder: Path) -> str:
    if "://" in value or Path(value).is_absolute():
        return value
    return str(folder / value)


def _item(raw: Any, where: str, folder: Path, tok, default_new_tokens: int) -> FileItem:
    if not isinstance(raw, dict):
        raise config_lib.ConfigError(f"{where}: an item is a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise config_lib.ConfigError(
            f"{where}: unknown keys {unknown} (an item has {', '.join(sorted(_KEYS))})"
        )
    artifact = raw.get("artifact")
    if artifact is not None and not (isinstance(artifact, str) and artifact):
        raise config_lib.ConfigError(f"{where}: `artifact` is a directory path or null")
    if ("query" in raw) == ("query_ids" in raw):
        raise config_lib.ConfigError(f"{where}: give exactly one of `query` and `query_ids`")
    if "query" in raw:
        if not isinstance(raw["query"], str) or not raw["query"]:
            raise config_lib.ConfigError(f"{where}: `query` is non-empty text")
        if tok is None:
            raise config_lib.ConfigError(
                f"{where}: a text query needs a tokenizer (--tokenizer=PATH), or give `query_ids`"
            )
        ids = tok.encode(raw["query"], add_bos=artifact is None)
    else:
        ids = raw["query_ids"]
        if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
            raise config_lib.ConfigError(f"{where}: `query_ids` is a non-empty list of token ids")
    if len(ids) > config_lib.MAX_TOKENS:
        raise config_lib.ConfigError(
            f"{where}: a query of {len(ids):,} tokens (at most {config_lib.MAX_TOKENS:,})"
        )
    new = raw.get("max_new_tokens", default_new_tokens)
    if type(new) is not int or not 1 <= new <= config_lib.MAX_TOKENS:
        raise config_lib.ConfigError(
            f"{where}: `max_new_tokens` is an integer in [1, {config_lib.MAX_TOKENS:,}], got {new!r}"
        )
    name = raw.get("id", where.rsplit(" ", 1)[-1])
    if not isinstance(name, str | int) or isinstance(name, bool):
        raise config_lib.ConfigError(f"{where}: `id` is a string")
    return FileItem(
        str(name), None if artifact is None else _resolve(artifact, folder), tuple(ids), new
    )


def read_batch_file(path: str, tok, *, default_new_tokens: int) -> list[FileItem]:
    """Every item of the JSONL batch file at `path`, checked; any bad line is a `ConfigError`
    naming the file and line, before a model is built or an artifact read."""
    folder = Path(path).parent
    items: list[FileItem] = []
    lines = inputs.json_lines(
        path,
        flag="--batch_file",
        error=config_lib.ConfigError,
        where=lambda number: f"--batch_file={path} line {number}",
        max_bytes=MAX_FILE_BYTES,
    )
    for where, raw in lines:
        items.append(_item(raw, where, folder, tok, default_new_tokens))
        if len(items) > MAX_ITEMS:
            raise config_lib.ConfigError(f"--batch_file={path}: more than {MAX_ITEMS:,} items")
    if not items:
        raise config_lib.ConfigError(f"--batch_file={path}: no items")
    duplicated = sorted(n for n, k in collections.Counter(i.id for i in items).items() if k > 1)
    if duplicated:
        raise config_lib.ConfigError(f"--batch_file={path}: ids used twice: {duplicated[:5]}")
    return items


@dataclasses.dataclass(frozen=True)
class _Setup:
    runtime: runtime.Runtime
    items: list[FileItem]
    links: list[tuple]  # each item's resolved chain (every manifest read once)
    batch_items: list[batch.BatchItem]
    expected: Any  # manifest_lib.Expected

    def engine(
        self, batch_size: int, cache_length: int, program: str | None = None
    ) -> engine_lib.Engine:
        """The batch engine (`program`: a recorded batch program to replay, `batch_engine`)."""
        loaded = self.runtime.loaded
        return batch.batch_engine(
            loaded.module,
            loaded.params,
            self.runtime.mesh,
            batch_size=batch_size,
            cache_length=cache_length,
            program=program,
        )

    def single(self, eng: engine_lib.Engine) -> engine_lib.Engine:
        """The batch-of-one engine the reference recomputes prefixes on (only a verify builds
        it: its weight layout is another copy of the weights)."""
        loaded = self.runtime.loaded
        return engine_lib.Engine(
            loaded.module,
            loaded.params,
            self.runtime.mesh,
            batch_size=1,
            cache_length=eng.kv_shape.cache_length,
        )


def _setup(cfg: config_lib.RunConfig, items: list[FileItem] | None = None) -> _Setup:
    from kvgraft_jax.cli import modes
    from kvgraft_jax.store import chain as chain_lib
    from kvgraft_jax.store import manifest as manifest_lib

    started = runtime.start(cfg)
    tok = started.tok
    if items is None:
        items = read_batch_file(cfg.batch_file, tok, default_new_tokens=cfg.max_new_tokens)
    links = [tuple(chain_lib.resolve_chain(i.artifact)) if i.artifact else () for i in items]
    batch_items = [
        batch.BatchItem(ls or None, np.asarray(i.query_ids, np.int32), i.max_new_tokens)
        for i, ls in zip(items, links, strict=True)
    ]
    expected = manifest_lib.Expected.of(
        started.loaded.info, tok.info() if tok else None, trusted_keys=modes.trusted_keys(cfg)
    )
    return _Setup(started, items, links, batch_items, expected)


def _stop(cfg: config_lib.RunConfig, tok) -> int | None:
    return tok.eos_id if (tok is not None and cfg.stop_at_eos) else None


def _graft_report(
    cfg: config_lib.RunConfig, setup: _Setup, eng: engine_lib.Engine, run: batch.BatchRun
) -> reports.BatchGraftReport:
    tok, loaded = setup.runtime.tok, setup.runtime.loaded
    items = []
    for item, ls, done in zip(setup.items, setup.links, run.items, strict=True):
        ids = [int(t) for t in done.token_ids]
        items.append(
            {
                "id": item.id,
                "artifact": item.artifact,
                "chain": [link.manifest.root for link in ls],
                "prefix_tokens": done.prefix_length,
                "query_ids": list(item.query_ids),
                "max_new_tokens": item.max_new_tokens,
                "row": done.row,
                "new_token_ids": ids,
                "continuation": tok.decode(ids) if tok else None,
                "logits_sha256": list(done.logits_sha256),
                "prefix_s": done.prefix_s,
                "first_token_s": done.first_token_s,
            }
        )
    return reports.BatchGraftReport(
        config=cfg.to_json(),
        batch_file=cfg.batch_file,
        model={"name": loaded.name, "fingerprint": loaded.fingerprint},
        mesh=str(sharding.MeshSpec(**dict(eng.mesh.shape))),
        processes=jax.process_count(),
        cache_slots=eng.kv_shape.cache_length,
        items=items,
        schedule=json.loads(run.schedule.to_json()),  # its JSON form, as the report holds it
        timings={
            "compile_s": run.compile_s,
            "seconds": run.seconds,
            "items_per_s": len(run.items) / run.seconds if run.seconds else 0.0,
            "decode_tokens": run.decode_tokens,
            "decode_tokens_per_s": run.decode_tokens_per_s if run.decode_tokens else 0.0,
        },
    )


def _graft(cfg: config_lib.RunConfig) -> tuple[_Setup, engine_lib.Engine, batch.BatchRun]:
    setup = _setup(cfg)
    needed = batch.cache_length(setup.batch_items, cfg.chunk_size, links=setup.links)
    eng = setup.engine(cfg.batch_size, max(cfg.cache_length, needed))
    logging.info(
        "batch of %d items through %d rows (%s weights), %d cache slots",
        len(setup.items),
        cfg.batch_size,
        eng.weight_layout,
        eng.kv_shape.cache_length,
    )
    run = batch.run(
        eng,
        setup.batch_items,
        batch.grafted(eng, expected=setup.expected),
        chunk_size=cfg.chunk_size,
        stop_token=_stop(cfg, setup.runtime.tok),
        progress=progress.counter(total=len(setup.items), desc="batch", unit="item"),
    )
    return setup, eng, run


def run_graft(cfg: config_lib.RunConfig) -> reports.BatchGraftReport:
    setup, eng, run = _graft(cfg)
    return _graft_report(cfg, setup, eng, run)


def _reference(setup: _Setup, eng, plan: batch.BatchSchedule, chunk_size: int):
    """The batch reference: `plan` replayed, every prefix recomputed from its tokens."""
    return batch.run(
        eng,
        setup.batch_items,
        batch.recomputed(setup.single(eng)),
        chunk_size=chunk_size,
        plan=plan,
        progress=progress.counter(total=len(setup.items), desc="reference", unit="item"),
    )


def _verdict(
    cfg: config_lib.RunConfig,
    setup: _Setup,
    eng: engine_lib.Engine,
    comparison: batch.BatchComparison,
    graft: reports.BatchGraftReport | None,
    *,
    recorded: dict[str, Any] | None = None,
) -> reports.BatchVerifyReport:
    run_mesh = str(sharding.MeshSpec(**dict(eng.mesh.shape)))
    deposit_meshes = sorted({link.manifest.protocol.mesh for ls in setup.links for link in ls})
    elsewhere = [m for m in deposit_meshes if m != run_mesh]
    notes = []
    if elsewhere:
        notes.append(
            f"prefixes deposited on {elsewhere} are recomputed on {run_mesh} for the reference: "
            "a different computation, so a difference is not proof of a fault (rerun on the "
            "deposit mesh)"
        )
    if recorded is not None and recorded.get("mesh") != run_mesh:
        notes.append(
            f"the recorded batch ran on mesh {recorded.get('mesh')}, its reference here on "
            f"{run_mesh}: other programs, so a difference is not proof of a fault (rerun with "
            f"--mesh={recorded.get('mesh')})"
        )
    if recorded is not None and recorded.get("processes", 1) != jax.process_count():
        # Measured on CPU: a reduction over more than two devices sums in the collective
        # library's order, which is not the same on one process as across several.
        notes.append(
            f"the recorded batch ran on {recorded.get('processes', 1)} processes, its reference "
            f"here on {jax.process_count()}: where more than two devices reduce (a `model` axis "
            "over 2), the sums run in another order, so a difference is not proof of a fault"
        )
    code = 0 if comparison.bit_identical else 3 if notes else 1  # 3: not provable here
    return reports.BatchVerifyReport(
        config=cfg.to_json(),
        graft=graft,
        checked_report=cfg.batch_report or None,
        reference=(
            f"the recorded batch schedule replayed on {run_mesh} with every prefix recomputed "
            "from its tokens by its recorded chunk schedule (batch of one, as deposited)"
        ),
        deposit_meshes=deposit_meshes,
        run_mesh=run_mesh,
        comparison=dataclasses.asdict(comparison),
        notes=notes,
        exit_code=code,
    )


def run_verify(cfg: config_lib.RunConfig) -> reports.BatchVerifyReport:
    """The batch grafted, then its reference replayed in the same run; or (`--batch_report`) an
    earlier run's recorded results against the reference replayed here."""
    if cfg.batch_report:
        return _verify_recorded(cfg)
    setup, eng, run = _graft(cfg)
    reference = _reference(setup, eng, run.schedule, cfg.chunk_size)
    graft = _graft_report(cfg, setup, eng, run)
    return _verdict(cfg, setup, eng, batch.compare(run, reference), graft)


def _recorded(path: str) -> dict[str, Any]:
    def malformed(why: str) -> config_lib.ConfigError:
        return config_lib.ConfigError(f"--batch_report={path}: {why}")

    text = inputs.read_text(
        path, flag="--batch_report", error=config_lib.ConfigError, max_bytes=MAX_FILE_BYTES
    )
    try:
        report = json.loads(text)
    except json.JSONDecodeError as e:
        raise malformed(f"not JSON ({e})") from None
    if not isinstance(report, dict):
        raise malformed("not a JSON object")
    missing = {"items", "schedule", "model", "cache_slots", "config"} - set(report)
    if missing:
        raise malformed(f"no {sorted(missing)}: not the report of --mode=graft --batch_file")
    if not isinstance(report["items"], list) or not report["items"]:
        raise malformed("no items")
    if not isinstance(report["model"], dict) or not isinstance(report["config"], dict):
        raise malformed("`model` and `config` are JSON objects in a batch report")
    return report


def _recorded_run(
    report: dict[str, Any], path: str
) -> tuple[list[FileItem], batch.BatchRun, int, int]:
    """A batch graft report's items, results, schedule, chunk size and cache slots, checked for
    shape (a forged report is refused before any model is built)."""
    try:
        schedule = batch.BatchSchedule.from_json(json.dumps(report["schedule"]))
        items, results = [], []
        for n, raw in enumerate(report["items"]):
            if not (raw["artifact"] is None or isinstance(raw["artifact"], str)):
                raise TypeError(f"item {n}: `artifact` is a path or null")
            items.append(
                FileItem(
                    str(raw["id"]),
                    raw["artifact"],
                    tuple(int(i) for i in raw["query_ids"]),
                    int(raw["max_new_tokens"]),
                )
            )
            results.append(
                batch.ItemResult(
                    item=n,
                    row=int(raw["row"]),
                    prefix_length=int(raw["prefix_tokens"]),
                    token_ids=np.asarray(raw["new_token_ids"], np.int32),
                    logits_sha256=tuple(str(d) for d in raw["logits_sha256"]),
                    prefix_s=0.0,
                    first_token_s=0.0,
                )
            )
        chunk_size = int(report["config"]["chunk_size"])
        slots = int(report["cache_slots"])
    except (KeyError, TypeError, ValueError, batch.BatchError) as e:
        raise config_lib.ConfigError(
            f"--batch_report={path}: a malformed batch report ({type(e).__name__}: {e})"
        ) from None
    if not 1 <= schedule.batch_size <= len(items) or chunk_size < 1:
        raise config_lib.ConfigError(
            f"--batch_report={path}: a malformed batch report ({schedule.batch_size} rows for "
            f"{len(items)} items in chunks of {chunk_size})"
        )
    run = batch.BatchRun(schedule, tuple(results), 0.0, 0.0, 0, 0.0)
    return items, run, chunk_size, slots


def _verify_recorded(cfg: config_lib.RunConfig) -> reports.BatchVerifyReport:
    from kvgraft_jax.store import manifest as manifest_lib

    report = _recorded(cfg.batch_report)
    items, recorded, chunk_size, slots = _recorded_run(report, cfg.batch_report)
    setup = _setup(cfg, items)
    loaded = setup.runtime.loaded
    if report["model"].get("fingerprint") != loaded.fingerprint:
        raise config_lib.ConfigError(
            f"--batch_report={cfg.batch_report} was made with weights "
            f"{str(report['model'].get('fingerprint'))[:16]}, this run loads "
            f"{loaded.fingerprint[:16]}: verify with the same --model and --weights"
        )
    for item, ls, raw in zip(items, setup.links, report["items"], strict=True):
        roots = [link.manifest.root for link in ls]
        if roots != raw.get("chain"):
            raise batch.BatchError(
                f"item {item.id}: the artifact at {item.artifact} now holds the chain {roots}, the "
                f"report grafted {raw.get('chain')}: it is not the state that was answered from"
            )
    # The reference recomputes prefixes from their recorded tokens, restoring no state: what a
    # restore would refuse (other weights, an untrusted signer) is refused here too.
    for ls in setup.links:
        for link in ls:
            manifest_lib.check_compatible(link.manifest, setup.expected, where=str(link.path))
            if setup.expected.trusted_keys is not None:
                manifest_lib.check_signature(link.path, link.manifest, setup.expected.trusted_keys)
    needed = batch.cache_length(setup.batch_items, chunk_size, links=setup.links)
    if not needed <= slots <= max(needed, config_lib.MAX_TOKENS):
        raise batch.BatchError(
            f"--batch_report={cfg.batch_report} records a cache of {slots} slots; this batch "
            f"needs {needed} (at most {config_lib.MAX_TOKENS:,})"
        )
    eng = setup.engine(recorded.schedule.batch_size, slots, recorded.schedule.weight_layout)
    try:  # before anything compiles
        batch.check_program(recorded.schedule, eng)
    except batch.OtherProgramError as e:
        raise batch.OtherProgramError(f"--batch_report={cfg.batch_report}: {e}") from None
    reference = _reference(setup, eng, recorded.schedule, chunk_size)
    comparison = batch.compare(recorded, reference)
    return _verdict(cfg, setup, eng, comparison, None, recorded=report)
