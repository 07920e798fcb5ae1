"""What each `--mode` does, as functions that return typed reports (`reports.py`); `run` picks one."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging

from kvgraft_jax.cli import reports
from kvgraft_jax.core import bits, environment, progress, sharding
from kvgraft_jax.core import engine as engine_lib
from kvgraft_jax.core import model as model_lib
from kvgraft_jax.run import config as config_lib
from kvgraft_jax.run import runtime


def run_generate(cfg: config_lib.RunConfig) -> reports.GenerateReport:
    mesh, tok, loaded = runtime.start(cfg, text_for="" if cfg.prompt_ids else "--prompt")
    ids = runtime.prompt_ids(cfg, tok)
    prompt = np.tile(np.asarray(ids, np.int32)[None, :], (cfg.batch_size, 1))
    cache_length = cfg.cache_length or len(ids) + cfg.max_new_tokens
    engine = engine_lib.Engine(
        loaded.module, loaded.params, mesh, batch_size=cfg.batch_size, cache_length=cache_length
    )
    runtime.log_replicated(engine.cache_replicated)
    schedule = engine_lib.chunk_schedule(len(ids), cfg.chunk_size)
    logging.info(
        "prompt %d tokens in %d chunks of %d; cache %d slots",
        len(ids),
        len(schedule),
        cfg.chunk_size,
        cache_length,
    )
    stop = tok.eos_id if (tok is not None and cfg.stop_at_eos) else None
    gen = engine.generate(
        prompt,
        max_new_tokens=cfg.max_new_tokens,
        chunk_size=cfg.chunk_size,
        stop_token=stop,
        progress=progress.counter(desc="prefill", unit="chunk", total=len(schedule))
        if len(schedule) > 1
        else None,
    )
    rows = [[int(t) for t in row] for row in gen.token_ids]
    if stop is not None:
        rows = [row[: row.index(stop) + 1] if stop in row else row for row in rows]
    t = gen.timings
    return reports.GenerateReport(
        config=cfg.to_json(),
        model={
            "name": loaded.name,
            "weights": cfg.weights,
            "seed": cfg.seed,
            "num_params": loaded.num_params,
            "fingerprint": loaded.fingerprint,
        },
        tokenizer=dataclasses.asdict(tok.info()) | {"source": tok.source} if tok else None,
        mesh=str(sharding.MeshSpec(**dict(mesh.shape))),
        num_devices=mesh.size,
        versions=environment.versions(),
        prompt_ids=ids,
        schedule=[[c.start, c.length] for c in gen.schedule],
        new_token_ids=rows,
        continuation=[tok.decode(r) for r in rows] if tok else None,
        step_logits_sha256=[bits.sha256(x) for x in gen.step_logits],
        timings={
            "compile_s": t.compile_s,
            "prefill_s": t.prefill_s,
            "prefill_tokens_per_s": len(ids) * cfg.batch_size / t.prefill_s if t.prefill_s else 0.0,
            "first_token_s": t.first_token_s,
            "decode_s": t.decode_s,
            "decode_steps": t.decode_steps,
            "decode_tokens_per_s": t.decode_tokens_per_s if t.decode_steps else 0.0,
        },
    )


def _signer(cfg: config_lib.RunConfig):
    from kvgraft_jax.store import signing

    return signing.load_signer(cfg.signing_key) if cfg.signing_key else None


def trusted_keys(cfg: config_lib.RunConfig):
    """The public keys `--trusted_keys` names (None: signatures not required); every mode that
    reads artifacts, batches included, refuses what none of them signed."""
    from kvgraft_jax.store import signing

    return signing.load_trusted(cfg.trusted_keys) if cfg.trusted_keys else None


def _read_text(cfg: config_lib.RunConfig) -> tuple[str, str]:
    if cfg.text:
        return cfg.text, "--text"
    path = Path(cfg.text_file)
    if not path.is_file():
        raise config_lib.ConfigError(f"--text_file={cfg.text_file}: no such file")
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except UnicodeDecodeError as e:
        raise config_lib.ConfigError(
            f"--text_file={cfg.text_file}: not UTF-8 text (byte {e.start}): deposit text, not binary"
        ) from None


def _artifact_bytes(manifest) -> int:
    """State bytes from the manifest's file inventory (works on any epath, gs:// included)."""
    return sum(f.size for f in manifest.files)


def run_deposit(cfg: config_lib.RunConfig):
    """One artifact from --text, or (with --library and --dataset) a library seeded from records."""
    if cfg.dataset:
        return run_seed(cfg)
    return _deposit_artifact(cfg)


def _deposit_artifact(cfg: config_lib.RunConfig) -> reports.DepositReport:
    from kvgraft_jax.exact import deposit
    from kvgraft_jax.store import manifest as manifest_lib

    text, source = _read_text(cfg)
    # A child continues its parent's text: no BOS in the middle of a document.
    start = manifest_lib.read_manifest(cfg.parent).end_position if cfg.parent else 0
    mesh, tok, loaded = runtime.start(cfg, text_for="--mode=deposit")
    ids = tok.encode(text, add_bos=not cfg.parent)
    tokens = np.tile(np.asarray(ids, np.int32)[None, :], (cfg.batch_size, 1))
    engine = engine_lib.Engine(
        loaded.module, loaded.params, mesh, batch_size=cfg.batch_size, cache_length=start + len(ids)
    )
    runtime.log_replicated(engine.cache_replicated)
    schedule = engine_lib.chunk_schedule(len(ids), cfg.chunk_size, start=start)
    logging.info(
        "depositing %d tokens at positions %d..%d in %d chunks of %d%s",
        len(ids),
        start,
        start + len(ids) - 1,
        len(schedule),
        cfg.chunk_size,
        f" on top of {cfg.parent}" if cfg.parent else "",
    )
    compile_s = engine.compile(schedule)
    result = deposit.deposit(
        engine,
        tokens,
        chunk_size=cfg.chunk_size,
        path=cfg.artifact,
        model=loaded.info,
        tokenizer=tok.info(),
        versions=environment.versions(),
        text=text,
        source=source,
        parent=cfg.parent or None,
        overwrite=cfg.overwrite,
        compact=cfg.compact,
        progress=progress.counter(desc="prefill", unit="chunk", total=len(schedule))
        if len(schedule) > 1
        else None,
        signer=_signer(cfg),
    )
    return reports.DepositReport(
        config=cfg.to_json(),
        artifact=str(result.path),
        root=result.root,
        tokens=len(ids),
        positions=[result.manifest.first_position, result.manifest.last_position],
        parent=result.manifest.parent,
        schedule=result.manifest.protocol.schedule,
        cache_slots=engine.kv_shape.cache_length,
        artifact_bytes=_artifact_bytes(result.manifest),
        timings={
            "compile_s": compile_s,
            "prefill_s": result.prefill_s,
            "digest_s": result.digest_s,
            "write_s": result.write_s,
        },
    )


def run_inspect(cfg: config_lib.RunConfig) -> reports.InspectReport:
    """Manifest summary, then a full restore on the run's mesh: every state file's bytes and
    every restored array's digests re-verified."""
    from kvgraft_jax.store import chain as chain_lib
    from kvgraft_jax.store import errors, files
    from kvgraft_jax.store import manifest as manifest_lib
    from kvgraft_jax.store import restore as restore_lib

    mesh = runtime.build_mesh(cfg)
    mesh_name = str(sharding.MeshSpec(**dict(mesh.shape)))
    summary = None
    try:
        link = chain_lib.Link(files.as_path(cfg.artifact), manifest_lib.read_manifest(cfg.artifact))
        manifest = link.manifest
        summary = {
            "root": manifest.root,
            "format": manifest.format,
            "model": manifest.model.name,
            "weights_fingerprint": manifest.model.fingerprint,
            "tokenizer_fingerprint": manifest.tokenizer.fingerprint if manifest.tokenizer else None,
            "positions": [manifest.first_position, manifest.last_position],
            "length": manifest.length,
            "batch_size": manifest.protocol.batch_size,
            "chunk_size": manifest.protocol.chunk_size,
            "chunks": len(manifest.protocol.schedule),
            "deposit_mesh": manifest.protocol.mesh,
            "arrays": len(manifest.arrays),
            "bytes": _artifact_bytes(manifest),
            "parent": manifest.parent,
            "compaction": dataclasses.asdict(manifest.compaction) if manifest.compaction else None,
            "created": manifest.provenance.created,
            "versions": manifest.protocol.versions,
        }
        trusted = trusted_keys(cfg)
        expected = manifest_lib.Expected(trusted_keys=trusted) if trusted else None
        restored = restore_lib.restore(link, mesh, every_file=True, expected=expected)
    except errors.ArtifactError as e:
        return reports.InspectReport(
            cfg.to_json(), cfg.artifact, False, f"{type(e).__name__}: {e}", summary, mesh_name, {}
        )
    return reports.InspectReport(
        cfg.to_json(),
        cfg.artifact,
        True,
        None,
        summary,
        mesh_name,
        {"restore_s": restored.restore_s, "verify_s": restored.verify_s},
    )


def run_bench(cfg: config_lib.RunConfig) -> reports.BenchReport:
    if cfg.bench == "graft":
        from kvgraft_jax.bench import graft_bench

        return reports.BenchReport(graft_bench.run(cfg))
    if cfg.bench == "batch":
        from kvgraft_jax.bench import batch_bench

        return reports.BenchReport(batch_bench.run(cfg))
    if cfg.bench == "weights":
        from kvgraft_jax.bench import weights_bench

        return reports.BenchReport(weights_bench.run(cfg))
    from kvgraft_jax.bench import artifact_bench

    return reports.BenchReport(artifact_bench.run_artifact_bench(cfg, megabytes=cfg.bench_mb))


@dataclasses.dataclass(frozen=True)
class _GraftSetup:
    links: tuple  # --artifact's resolved chain, root first (each manifest read once)
    mesh: Any
    tok: Any
    loaded: runtime.LoadedModel
    query: np.ndarray  # int32[batch, query]
    cache_length: int
    expected: Any  # manifest_lib.Expected
    offset: int  # engine position offset: 0 unless relocated

    @property
    def manifest(self):
        return self.links[-1].manifest

    def engine(self, mesh=None, params=None) -> engine_lib.Engine:
        return engine_lib.Engine(
            self.loaded.module,
            self.loaded.params if params is None else params,
            self.mesh if mesh is None else mesh,
            batch_size=self.manifest.protocol.batch_size,
            cache_length=self.cache_length,
            position_offset=self.offset,
        )


def _graft_setup(cfg: config_lib.RunConfig) -> _GraftSetup:
    from kvgraft_jax.store import chain as chain_lib
    from kvgraft_jax.store import manifest as manifest_lib

    if not cfg.query and not cfg.prompt_ids:
        raise config_lib.ConfigError(
            f"--mode={cfg.mode} needs --query=TEXT (or --prompt_ids=... as the query)"
        )
    links = tuple(chain_lib.resolve_chain(cfg.artifact))
    manifest = links[-1].manifest
    mesh, tok, loaded = runtime.start(cfg, text_for="" if cfg.prompt_ids else "--query")
    query = list(cfg.prompt_ids) if cfg.prompt_ids else tok.encode(cfg.query)
    batch = manifest.protocol.batch_size
    # A chain always starts at position 0; --graft_position moves the whole chain.
    offset = max(cfg.graft_position, 0)
    cache_length = cfg.cache_length or manifest.end_position + len(query) + cfg.max_new_tokens
    expected = manifest_lib.Expected.of(
        loaded.info, tok.info() if tok else None, trusted_keys=trusted_keys(cfg)
    )
    return _GraftSetup(
        links,
        mesh,
        tok,
        loaded,
        np.asarray([query] * batch, np.int32),
        cache_length,
        expected,
        offset,
    )


def _graft_run(cfg: config_lib.RunConfig):
    """The run's setup, its engine and the graft of `--artifact` into it (graft and verify)."""
    from kvgraft_jax.exact import graft

    setup = _graft_setup(cfg)
    eng = setup.engine()
    grafted = graft.graft(
        eng,
        setup.links,
        setup.query,
        max_new_tokens=cfg.max_new_tokens,
        expected=setup.expected,
        allow_relocation=cfg.allow_relocation,
    )
    return setup, eng, grafted


def _relocation_summary(grafted, verdict) -> dict[str, Any]:
    return {
        "from_position": 0,
        "to_position": grafted.prefix.relocated_by,
        "reference": "recompute of the same chain and query at the new positions",
        "mean_kl_divergence": verdict.mean_kl_divergence,
        "max_kl_divergence": verdict.max_kl_divergence,
        "argmax_agreement": verdict.argmax_agreement,
        "max_abs_logit_diff": verdict.max_abs_logit_diff,
    }


def _graft_report(cfg, eng, grafted, tok, query, relocation=None) -> reports.GraftReport:
    run, prefix = grafted.run, grafted.prefix
    rows = [[int(t) for t in row] for row in run.token_ids]
    first_token_s = prefix.restore_s + prefix.verify_s + prefix.insert_s + run.first_token_s
    return reports.GraftReport(
        config=cfg.to_json(),
        artifact=cfg.artifact,
        root=grafted.manifest.root,
        chain=[link.manifest.root for link in grafted.links],
        prefix_tokens=prefix.length,
        cache_slots=eng.kv_shape.cache_length,
        positions=[prefix.relocated_by, prefix.relocated_by + prefix.length - 1],
        exact=grafted.exact,
        relocation=relocation,
        query_ids=[int(i) for i in query[0]],
        query_schedule=[[c.start, c.length] for c in run.query_schedule],
        new_token_ids=rows,
        continuation=[tok.decode(r) for r in rows] if tok else None,
        step_logits_sha256=[bits.sha256(x) for x in run.step_logits],
        state_root_after_query=run.state_root_after_query,
        timings={
            "restore_s": prefix.restore_s,
            "verify_s": prefix.verify_s,
            "insert_s": prefix.insert_s,
            "query_prefill_s": run.query_prefill_s,
            "first_token_s": first_token_s,
            "graft_call_to_first_token_s": grafted.ttft_s,  # manifest reads and checks included
            "decode_s": run.decode_s,
            "decode_tokens_per_s": run.decode_steps / run.decode_s
            if run.decode_steps and run.decode_s
            else 0.0,
        },
    )


def run_graft(cfg: config_lib.RunConfig) -> reports.GraftReport | reports.BatchGraftReport:
    from kvgraft_jax.exact import graft

    if cfg.batch_file:
        from kvgraft_jax.cli import batch_modes

        return batch_modes.run_graft(cfg)

    setup, eng, grafted = _graft_run(cfg)
    relocation = None
    if not grafted.exact:
        reference = graft.recompute(
            eng, grafted.links, setup.query, max_new_tokens=cfg.max_new_tokens
        )
        relocation = _relocation_summary(grafted, graft.compare(grafted.run, reference))
    return _graft_report(cfg, eng, grafted, setup.tok, setup.query, relocation)


def run_verify(cfg: config_lib.RunConfig) -> reports.VerifyReport | reports.BatchVerifyReport:
    """Graft, then the strongest reference this machine can run, compared at every decode step."""
    from kvgraft_jax.exact import verify

    if cfg.batch_file or cfg.batch_report:
        from kvgraft_jax.cli import batch_modes

        return batch_modes.run_verify(cfg)

    setup, eng, grafted = _graft_run(cfg)

    def engine_on(mesh):
        # The same weights, placed on the deposit mesh (the fingerprint proves they are the same).
        src = runtime.load_model(cfg, mesh)
        if src.fingerprint != setup.loaded.fingerprint:
            raise config_lib.ConfigError(
                f"--weights={cfg.weights or '(default)'} give other weights on the deposit mesh "
                f"than on this run's (fingerprint {src.fingerprint[:16]} vs "
                f"{setup.loaded.fingerprint[:16]}): reference (b) needs the same weights on both"
            )
        return setup.engine(mesh, src.params)

    v = verify.verify(
        eng,
        grafted,
        setup.query,
        max_new_tokens=cfg.max_new_tokens,
        model_fingerprint=setup.loaded.fingerprint,
        tokenizer_fingerprint=setup.expected.tokenizer_fingerprint,
        engine_on=engine_on,
    )
    relocation = _relocation_summary(grafted, v.comparison) if v.kind == "r" else None
    return reports.VerifyReport(
        config=cfg.to_json(),
        graft=_graft_report(cfg, eng, grafted, setup.tok, setup.query, relocation),
        reference=v.reference,
        deposit_mesh=" + ".join(v.deposit_meshes),
        run_mesh=v.run_mesh,
        comparison=dataclasses.asdict(v.comparison),
        contract=[dataclasses.asdict(t) for t in v.terms],
        natural=v.natural,
        notes=v.notes,
        exit_code=v.exit_code,
    )


def run_cycle(cfg: config_lib.RunConfig) -> reports.CycleReport:
    """The whole claim in one run: deposit the text, graft it into a fresh cache, prove the bits."""
    deposited = _deposit_artifact(dataclasses.replace(cfg, mode="deposit", query="", prompt_ids=()))
    verified = run_verify(dataclasses.replace(cfg, mode="verify", parent=""))
    return reports.CycleReport(cfg.to_json(), deposited, verified, verified.exit_code)


# -------------------------------------------------------------------------------------------
# The library and the flywheel


def _flywheel_context(cfg: config_lib.RunConfig):
    from kvgraft_jax.library import flywheel, library

    mesh, tok, loaded = runtime.start(cfg, text_for=f"--mode={cfg.mode}")
    return flywheel.Context(
        module=loaded.module,
        params=loaded.params,
        mesh=mesh,
        tok=tok,
        model=loaded.info,
        model_name=loaded.name,
        versions=environment.versions(),
        library=library.Library(
            cfg.library,
            artifacts=cfg.library_artifacts,
            signer=_signer(cfg),
            trusted_keys=trusted_keys(cfg),
        ),
        context_window=model_lib.CONTEXT_WINDOW.get(loaded.name),
    )


def _flywheel_settings(cfg: config_lib.RunConfig):
    from kvgraft_jax.library import accounting, flywheel

    shared = [f.name for f in dataclasses.fields(flywheel.Settings) if f.name != "energy"]
    return flywheel.Settings(
        **{name: getattr(cfg, name) for name in shared},
        energy=accounting.EnergyAssumptions(cfg.joules_per_flop, cfg.device_watts),
    )


def run_seed(cfg: config_lib.RunConfig) -> reports.SeedReport:
    """Verifies each record's known solution and deposits what passes into the library."""
    from kvgraft_jax.library import dataset, flywheel

    records = dataset.load(cfg.dataset, need_solution=True)
    ctx = _flywheel_context(cfg)
    with ctx.library:
        seeded = flywheel.seed_library(ctx, records, _flywheel_settings(cfg))
        items = len(ctx.library.catalog.items(ctx.model.fingerprint))
    return reports.SeedReport(cfg.to_json(), str(ctx.library.directory), seeded.to_json(), items)


def solve_report_path(cfg: config_lib.RunConfig) -> Path:
    return Path(cfg.report) if cfg.report else Path(cfg.library) / "report" / "summary.json"


def run_solve(cfg: config_lib.RunConfig) -> reports.SolveReport:
    """The flywheel over a dataset, `--passes` times; writes problems.jsonl, summary.json, plot."""
    import os
    import platform

    from kvgraft_jax.library import dataset, flywheel

    records = dataset.load(cfg.dataset)
    settings = _flywheel_settings(cfg)
    out = solve_report_path(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    problems_path = out.parent / "problems.jsonl"
    plot_path = out.parent / "flywheel.png"
    ctx = _flywheel_context(cfg)
    with ctx.library:
        result = flywheel.solve(ctx, records, settings, problems_path)
    flywheel.plot(result.results, plot_path)
    import jax

    return reports.SolveReport(
        config=cfg.to_json(),
        dataset=cfg.dataset,
        library=result.library | {"directory": str(ctx.library.directory)},
        passes=result.passes,
        assumptions=settings.energy.describe(),
        versions=environment.versions(),
        machine={
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "devices": [str(d) for d in jax.devices()],
            "mesh": str(sharding.MeshSpec(**dict(ctx.mesh.shape))),
        },
        outputs={
            "summary": str(out),
            "problems": str(problems_path),
            "plot": str(plot_path),
        },
    )


def run_reindex(cfg: config_lib.RunConfig) -> reports.ReindexReport:
    """Rebuilds the catalog from the committed artifacts' manifests (no model needed)."""
    from kvgraft_jax.library import library

    with library.Library(
        cfg.library, artifacts=cfg.library_artifacts, rebuild_unusable_catalog=True
    ) as lib:
        done = lib.reindex()
        return reports.ReindexReport(
            cfg.to_json(), str(lib.directory), done.artifacts, done.items, done.skipped
        )


RUNNERS = {
    "generate": run_generate,
    "deposit": run_deposit,
    "inspect": run_inspect,
    "bench": run_bench,
    "graft": run_graft,
    "verify": run_verify,
    "cycle": run_cycle,
    "solve": run_solve,
    "reindex": run_reindex,
}


def run(cfg: config_lib.RunConfig) -> reports.Report:
    """Runs `cfg.mode` and returns its report."""
    return RUNNERS[cfg.mode](cfg)


def report_path(cfg: config_lib.RunConfig) -> Path | None:
    """Where the run's JSON report goes: solve always writes one (`solve_report_path`)."""
    if cfg.mode == "solve":
        return solve_report_path(cfg)
    return Path(cfg.report) if cfg.report else None
