"""The command-line surface: absl flag definitions and their translation into a `RunConfig`.

Flags are defined on a `FlagValues` passed in, so tests parse flagfiles without touching the global
`absl.flags.FLAGS`. `--flagfile=configs/X.flags` is absl's own.
"""

from __future__ import annotations

from absl import flags

from kvgraft_jax.run import config


def define_flags(fv: flags.FlagValues) -> None:
    """Defines every kvgraft_jax flag on `fv` (once)."""
    d = {"flag_values": fv}
    flags.DEFINE_enum("mode", "generate", config.MODES, "What to run.", **d)
    flags.DEFINE_enum("model", "tiny", config.MODEL_NAMES, "Gemma 3 model or tiny test model.", **d)
    flags.DEFINE_string(
        "weights",
        "",
        "Empty: the model's default (tiny: random; gemma3_270m: the embedded GGUF); 'random' "
        "(seeded by --seed); a Gemma 3 .gguf file; or a Gemma Orbax checkpoint directory.",
        **d,
    )
    flags.DEFINE_string(
        "tokenizer",
        "",
        "SentencePiece .model file; empty: the model's default (tiny: shipped).",
        **d,
    )
    flags.DEFINE_integer("seed", 0, "Seed of random weights (and of sampling, where used).", **d)
    flags.DEFINE_string(
        "mesh", "", "Mesh axes and sizes, e.g. 'data:2,model:4'; empty: all devices on model.", **d
    )
    flags.DEFINE_integer(
        "batch_size", 1, "Rows per batch; the prompt is repeated on every row.", **d
    )
    flags.DEFINE_integer(
        "chunk_size", 64, "Prefill chunk length; part of the exactness contract.", **d
    )
    flags.DEFINE_integer(
        "cache_length", 0, "KV cache slots; 0 sizes it to prompt + max_new_tokens.", **d
    )
    flags.DEFINE_integer("max_new_tokens", 16, "Tokens to decode greedily.", **d)
    flags.DEFINE_boolean("stop_at_eos", True, "Stop decoding once every row produced EOS.", **d)
    flags.DEFINE_string("prompt", "", "Prompt text (generate).", **d)
    flags.DEFINE_list(
        "prompt_ids", [], "Prompt as token ids, e.g. 2,651,235 (no tokenizer needed).", **d
    )
    flags.DEFINE_string("text", "", "Knowledge text to deposit.", **d)
    flags.DEFINE_string("text_file", "", "File holding the knowledge text to deposit.", **d)
    flags.DEFINE_string("query", "", "Query to prefill after a grafted prefix.", **d)
    flags.DEFINE_string("artifact", "", "Artifact directory (local or gs://).", **d)
    flags.DEFINE_string(
        "library", "", "Library directory: artifacts named by root plus an SQLite catalog.", **d
    )
    flags.DEFINE_string(
        "library_artifacts",
        "",
        "Where a new library keeps its artifacts (e.g. gs://bucket/lib); recorded in the library.",
        **d,
    )
    flags.DEFINE_enum("bench", "artifact", config.BENCHES, "Benchmark run by --mode=bench.", **d)
    flags.DEFINE_integer("bench_mb", 128, "Size in MiB of the benchmark's synthetic KV state.", **d)
    flags.DEFINE_list(
        "bench_lengths",
        ["512", "2048", "8192"],
        "--bench=graft: prefix lengths in tokens, e.g. 512,2048,8192.",
        **d,
    )
    flags.DEFINE_boolean(
        "overwrite", False, "Deposit: replace a different artifact already at --artifact.", **d
    )
    flags.DEFINE_string(
        "parent",
        "",
        "Deposit: extend this artifact (a prefix chain); only new positions stored.",
        **d,
    )
    flags.DEFINE_boolean(
        "compact",
        True,
        "Deposit: sliding-window compaction (local layers keep their last `window` positions; "
        "grafting stays bit-identical).",
        **d,
    )
    flags.DEFINE_integer(
        "graft_position",
        -1,
        "Graft/verify: first position of the grafted prefix; -1 (default): its own positions.",
        **d,
    )
    flags.DEFINE_boolean(
        "allow_relocation",
        False,
        "Graft/verify: allow --graft_position other than the artifact's own (re-rotated keys, "
        "approximate, measured against a recompute there).",
        **d,
    )
    flags.DEFINE_string(
        "report",
        "",
        "Write the run's JSON report (with its resolved config) here; solve: DIR/summary.json, "
        "with problems.jsonl and flywheel.png beside it (default LIBRARY/report/summary.json).",
        **d,
    )
    flags.DEFINE_string(
        "dataset",
        "",
        "JSONL problems {id, problem, answer}: --mode=solve solves them; --mode=deposit with "
        "--library seeds the library from records that also hold a solution (and optionally a "
        "program), verified first.",
        **d,
    )
    flags.DEFINE_integer(
        "attempts", 4, "Solve: generations per missed problem (greedy, then sampled).", **d
    )
    flags.DEFINE_integer("solve_tokens", 32, "Solve: token budget of one attempt.", **d)
    flags.DEFINE_integer(
        "answer_tokens", 12, "Solve: decode budget of an answer from a grafted item.", **d
    )
    flags.DEFINE_float(
        "temperature", 0.8, "Solve: sampling temperature of attempts after the first.", **d
    )
    flags.DEFINE_float(
        "route_threshold",
        0.8,
        "Solve: minimum term similarity (Jaccard) of a full-text match; below it, no knowledge.",
        **d,
    )
    flags.DEFINE_integer("passes", 2, "Solve: passes over the dataset.", **d)
    flags.DEFINE_integer(
        "chapter_items", 1, "Deposit --dataset: verified items per artifact (a chapter).", **d
    )
    flags.DEFINE_string(
        "signing_key",
        "",
        "Deposits: sign each artifact's manifest with this Ed25519 private key (PEM; "
        "python -m kvgraft_jax.store.signing PATH makes one).",
        **d,
    )
    flags.DEFINE_list(
        "trusted_keys",
        [],
        "Restore, graft, verify, inspect and the library: refuse any artifact not signed by one "
        "of these Ed25519 public keys (PEM files, comma-separated).",
        **d,
    )
    flags.DEFINE_bool(
        "allow_unsandboxed_programs",
        False,
        "Run program verifiers even where bubblewrap cannot isolate them; every item verified "
        "so is labelled 'program (unsandboxed)' in the catalog and the manifest.",
        **d,
    )
    flags.DEFINE_float(
        "joules_per_flop", 1e-10, "Energy estimate: assumed joules per FLOP (labelled).", **d
    )
    flags.DEFINE_float(
        "device_watts", 65.0, "Energy estimate: assumed device power in watts (labelled).", **d
    )
    flags.DEFINE_boolean(
        "distributed",
        False,
        "Join a multi-process run (jax.distributed.initialize); on TPU VMs the rest is detected.",
        **d,
    )
    flags.DEFINE_string(
        "coordinator_address", "", "host:port of process 0 (empty: detected, e.g. TPU VMs).", **d
    )
    flags.DEFINE_integer("num_processes", 0, "Processes in the run (0: detected).", **d)
    flags.DEFINE_integer("process_id", -1, "This process's index (-1: detected).", **d)


def _int_list(name: str, values: list[str]) -> tuple[int, ...]:
    try:
        return tuple(int(i) for i in values)
    except ValueError:
        raise config.ConfigError(
            f"--{name} must be comma-separated integers, got {','.join(values)!r}"
        ) from None


def config_from_flags(fv: flags.FlagValues) -> config.RunConfig:
    """The validated `RunConfig` of parsed flags; raises `ConfigError` with a one-line message."""
    prompt_ids = _int_list("prompt_ids", fv.prompt_ids)
    bench_lengths = _int_list("bench_lengths", fv.bench_lengths)
    return config.RunConfig(
        mode=fv.mode,
        model=fv.model,
        weights=fv.weights,
        tokenizer=fv.tokenizer,
        seed=fv.seed,
        mesh=fv.mesh,
        batch_size=fv.batch_size,
        chunk_size=fv.chunk_size,
        cache_length=fv.cache_length,
        max_new_tokens=fv.max_new_tokens,
        stop_at_eos=fv.stop_at_eos,
        prompt=fv.prompt,
        prompt_ids=prompt_ids,
        text=fv.text,
        text_file=fv.text_file,
        query=fv.query,
        artifact=fv.artifact,
        library=fv.library,
        library_artifacts=fv.library_artifacts,
        report=fv.report,
        overwrite=fv.overwrite,
        bench=fv.bench,
        bench_mb=fv.bench_mb,
        bench_lengths=bench_lengths,
        parent=fv.parent,
        compact=fv.compact,
        graft_position=fv.graft_position,
        allow_relocation=fv.allow_relocation,
        dataset=fv.dataset,
        attempts=fv.attempts,
        solve_tokens=fv.solve_tokens,
        answer_tokens=fv.answer_tokens,
        temperature=fv.temperature,
        route_threshold=fv.route_threshold,
        passes=fv.passes,
        chapter_items=fv.chapter_items,
        allow_unsandboxed_programs=fv.allow_unsandboxed_programs,
        signing_key=fv.signing_key,
        trusted_keys=tuple(fv.trusted_keys),
        joules_per_flop=fv.joules_per_flop,
        device_watts=fv.device_watts,
        distributed=fv.distributed,
        coordinator_address=fv.coordinator_address,
        num_processes=fv.num_processes,
        process_id=fv.process_id,
    )


def parse(argv: list[str], fv: flags.FlagValues | None = None) -> config.RunConfig:
    """Parses argv (argv[0] is the program) into a config; for tests and notebooks."""
    if fv is None:
        fv = flags.FlagValues()
        define_flags(fv)
    try:
        rest = fv(argv)
    except flags.Error as e:
        raise config.ConfigError(str(e)) from None
    if len(rest) > 1:
        raise config.ConfigError(f"unexpected positional arguments: {' '.join(rest[1:])}")
    return config_from_flags(fv)
