"""Run settings as one frozen, JSON-serialisable dataclass, validated in one place.

`flags.py` builds a `RunConfig` from absl flags; notebooks and tests build one directly. The
resolved config is written next to every report, so a run can be repeated from its output.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# Model names are listed here (not imported from model.py) so that parsing flags does not import
# gemma and TensorFlow; tests check that model.py builds exactly these.
MODEL_NAMES = (
    "gemma3_270m",
    "gemma3_1b",
    "gemma3_4b",
    "gemma3_12b",
    "gemma3_27b",
    "tiny",
    "tiny_mqa",
)
MODES = (
    "generate",
    "deposit",
    "graft",
    "verify",
    "cycle",
    "inspect",
    "solve",
    "bench",
    "reindex",
)
BENCHES = ("artifact", "graft", "weights", "batch")


MAX_TOKENS = 131_072  # Gemma 3's longest context window: no cache or decode needs more


class ConfigError(ValueError):
    """Flags that are unknown, contradictory or incomplete; the CLI exits with code 2."""


def setting(default: Any, help: str, *, choices: tuple[str, ...] | None = None):
    """A `RunConfig` field with its flag's help (and choices): the one place a setting is declared.

    `cli/flags.py` defines every flag from these fields and the README's flag table is generated
    from them (`python -m kvgraft_jax.cli.flags --markdown`; a test keeps the README equal).
    """
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def default(name: str) -> Any:
    """`RunConfig`'s default of setting `name`, for views of the settings kept elsewhere
    (`library.flywheel.Settings`), so a default is written once."""
    return RunConfig.__dataclass_fields__[name].default


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every setting of one run, as plain values."""

    mode: str = setting(
        "generate",
        "What to run: `generate`; `deposit` (one artifact, or with --library --dataset a seeded "
        "library); `inspect`; `graft`; `verify`; `cycle` (deposit, then graft and verify it: the "
        "main job); `solve` (the flywheel); `bench`; `reindex` (a library's catalog rebuilt from "
        "its manifests).",
        choices=MODES,
    )
    model: str = setting(
        "tiny",
        "Gemma 3 model (gemma's classes, text only) or a tiny random-weight test model.",
        choices=MODEL_NAMES,
    )
    weights: str = setting(
        "",
        "Empty: the model's default (tiny: random; gemma3_270m: the embedded GGUF); `random` "
        "(seeded by --seed); a Gemma 3 .gguf file; a Hugging Face Gemma 3 text checkpoint "
        "directory (config.json + safetensors, read shard by shard into the mesh's sharding); or "
        "a Gemma Orbax checkpoint directory (the gemma package's layout, read through gm.ckpts; "
        "local or gs://).",
    )
    tokenizer: str = setting(
        "",
        "SentencePiece .model file; empty: the model's default (the tiny models' shipped one, "
        "the GGUF's vocabulary, or the --weights directory's tokenizer.model). Nothing is "
        "downloaded.",
    )
    seed: int = setting(0, "Seed of random weights (and of sampling, where used).")
    mesh: str = setting(
        "",
        "Mesh axes and sizes, e.g. `data:2,model:4` (one size may be -1); empty: all devices on "
        "model.",
    )
    batch_size: int = setting(
        1,
        "Rows per batch: generate repeats the prompt on every row; graft/verify --batch_file runs "
        "its items through this many rows; solve answers up to this many routed problems "
        "together from their grafts, then attempts the misses together (a ragged batch, float32 "
        "weights on CPU).",
    )
    chunk_size: int = setting(
        64, "Prefill chunk length; the chunk schedule is recorded: part of the exactness contract."
    )
    cache_length: int = setting(
        0,
        "KV cache slots; 0: prompt + --max_new_tokens (rounded up to whole 256-slot attention "
        "blocks; not part of the exactness contract).",
    )
    max_new_tokens: int = setting(16, "Tokens to decode greedily.")
    stop_at_eos: bool = setting(True, "Stop decoding once every row produced EOS.")
    prompt: str = setting("", "Prompt text (generate); not with --prompt_ids.")
    prompt_ids: tuple[int, ...] = setting(
        (), "Prompt as token ids, e.g. 2,651,235 (no tokenizer needed); graft/verify: the query."
    )
    text: str = setting("", "Deposit: the knowledge text; not with --text_file.")
    text_file: str = setting("", "Deposit: a file holding the knowledge text.")
    query: str = setting("", "Graft/verify/cycle: the query prefilled after the grafted prefix.")
    artifact: str = setting("", "Artifact directory (local or gs://).")
    batch_file: str = setting(
        "",
        "Graft/verify: a JSONL file of items {id, artifact, query | query_ids, max_new_tokens}, "
        "answered in a ragged batch of --batch_size rows (queries in chunks of --chunk_size; "
        "relative artifact paths from the file's folder); the report records the batch schedule.",
    )
    batch_report: str = setting(
        "",
        "Verify: the report of an earlier `--mode=graft --batch_file` run; its recorded schedule "
        "is replayed as the reference and compared with its recorded logits digests.",
    )
    library: str = setting(
        "", "Library directory (local): artifacts named by root plus an SQLite catalog."
    )
    library_artifacts: str = setting(
        "",
        "Where a new library keeps its artifacts (e.g. gs://bucket/lib); recorded in the "
        "library; empty: DIR/artifacts.",
    )
    report: str = setting(
        "",
        "Write the run's JSON report (with its resolved config) here; solve: DIR/summary.json, "
        "with problems.jsonl and flywheel.png beside it (default LIBRARY/report/summary.json).",
    )
    overwrite: bool = setting(False, "Deposit: replace a different artifact already at --artifact.")
    bench: str = setting(
        "artifact",
        "Benchmark run by --mode=bench: `artifact` (restore and digest throughput of a synthetic "
        "state of --bench_mb MiB), `graft` (graft vs recompute vs llama.cpp per prefix length), "
        "`weights` (load time of the same weights as GGUF, Hugging Face and Orbax checkpoints) or "
        "`batch` (a queue of grafts and attempts through --bench_batch_sizes rows).",
        choices=BENCHES,
    )
    bench_mb: int = setting(128, "Size in MiB of the artifact benchmark's synthetic KV state.")
    bench_lengths: tuple[int, ...] = setting(
        (512, 2048, 8192), "--bench=graft: prefix lengths in tokens."
    )
    bench_batch_sizes: tuple[int, ...] = setting(
        (1, 4, 8), "--bench=batch: rows per batch, each timed over the same queue of items."
    )
    parent: str = setting(
        "", "Deposit: extend this artifact (a prefix chain); only the new positions are stored."
    )
    compact: bool = setting(
        True,
        "Deposit: sliding-window compaction (local layers keep their last `window` positions; "
        "grafting stays bit-identical).",
    )
    graft_position: int = setting(
        -1, "Graft/verify: first position of the grafted prefix; -1: its own positions."
    )
    allow_relocation: bool = setting(
        False,
        "Graft/verify: allow a --graft_position other than the artifact's own (re-rotated keys: "
        "approximate, labelled and measured against a recompute there).",
    )
    dataset: str = setting(
        "",
        "JSONL problems {id, problem, answer}: --mode=solve solves them; --mode=deposit with "
        "--library seeds the library from records that also hold a solution (and optionally a "
        "program), verified first.",
    )
    attempts: int = setting(4, "Solve: generations per missed problem (greedy, then sampled).")
    solve_tokens: int = setting(32, "Solve: token budget of one attempt.")
    answer_tokens: int = setting(12, "Solve: decode budget of an answer from a grafted item.")
    temperature: float = setting(0.8, "Solve: sampling temperature of attempts after the first.")
    route_threshold: float = setting(
        0.8,
        "Solve: minimum term similarity (Jaccard) of a full-text match; below it, no knowledge.",
    )
    passes: int = setting(2, "Solve: passes over the dataset (the second shows reuse).")
    chapter_items: int = setting(
        1, "Deposit --dataset: verified items per artifact (1: one per item; more: chapters)."
    )
    allow_unsandboxed_programs: bool = setting(
        False,
        "Run program verifiers even where bubblewrap cannot isolate them (refused otherwise, exit "
        "2); every item verified so is labelled `program (unsandboxed)` in the catalog and the "
        "manifest.",
    )
    signing_key: str = setting(
        "",
        "Deposits: sign each artifact's manifest with this Ed25519 private key (PEM; `python -m "
        "kvgraft_jax.store.signing PATH` makes one).",
    )
    trusted_keys: tuple[str, ...] = setting(
        (),
        "Restore, graft, verify, inspect and the library: refuse any artifact not signed by one "
        "of these Ed25519 public keys (PEM files, comma-separated).",
    )
    joules_per_flop: float = setting(
        1e-10, "Energy estimate: assumed joules per FLOP (labelled as an assumption)."
    )
    device_watts: float = setting(
        65.0, "Energy estimate: assumed device power in watts (labelled as an assumption)."
    )
    distributed: bool = setting(
        False,
        "Join a multi-process run (jax.distributed.initialize); on TPU VMs the rest is detected "
        "(BUILD.md, Multi-host).",
    )
    coordinator_address: str = setting(
        "", "host:port of process 0 (empty: detected, e.g. on TPU VMs)."
    )
    num_processes: int = setting(0, "Processes in the run (0: detected).")
    process_id: int = setting(-1, "This process's index (-1: detected).")

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"--mode={self.mode!r}: expected one of {', '.join(MODES)}")
        if self.model not in MODEL_NAMES:
            raise ConfigError(f"--model={self.model!r}: expected one of {', '.join(MODEL_NAMES)}")
        if self.chunk_size < 1:
            raise ConfigError(f"--chunk_size must be >= 1, got {self.chunk_size}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch_size must be >= 1, got {self.batch_size}")
        if self.max_new_tokens > MAX_TOKENS or self.cache_length > MAX_TOKENS:
            raise ConfigError(
                f"--max_new_tokens={self.max_new_tokens} / --cache_length={self.cache_length}: at "
                f"most {MAX_TOKENS:,} (Gemma 3's longest context)"
            )
        if self.cache_length < 0:
            raise ConfigError(
                f"--cache_length must be >= 0 (0: sized to fit), got {self.cache_length}"
            )
        if self.prompt and self.prompt_ids:
            raise ConfigError("--prompt and --prompt_ids are mutually exclusive: give one")
        if self.text and self.text_file:
            raise ConfigError("--text and --text_file are mutually exclusive: give one")
        if self.mode == "generate" and not (self.prompt or self.prompt_ids):
            raise ConfigError("--mode=generate needs --prompt=TEXT or --prompt_ids=1,2,3")
        seeding = self.mode == "deposit" and bool(self.library or self.dataset)
        if seeding and not (self.library and self.dataset):
            raise ConfigError(
                "--mode=deposit into a library needs both --library=DIR and --dataset=FILE.jsonl"
            )
        if seeding and (self.text or self.text_file or self.artifact or self.parent):
            raise ConfigError(
                "--mode=deposit --dataset deposits verified records into --library; "
                "--text/--text_file/--artifact/--parent are for a single artifact"
            )
        if self.library_artifacts and not self.library:
            raise ConfigError("--library_artifacts needs --library=DIR (the local catalog)")
        if self.mode in ("solve", "reindex") and not self.library:
            raise ConfigError(f"--mode={self.mode} needs --library=DIR")
        if self.mode == "solve" and not self.dataset:
            raise ConfigError(
                "--mode=solve needs --dataset=FILE.jsonl (records {id, problem, answer})"
            )
        for name in ("attempts", "solve_tokens", "answer_tokens", "passes", "chapter_items"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ConfigError(f"--temperature must be > 0, got {self.temperature}")
        if not 0 < self.route_threshold <= 1:
            raise ConfigError(f"--route_threshold must be in (0, 1], got {self.route_threshold}")
        if self.joules_per_flop < 0 or self.device_watts < 0:
            raise ConfigError("--joules_per_flop and --device_watts must be >= 0")
        if self.num_processes < 0:
            raise ConfigError(
                f"--num_processes must be >= 0 (0: detected), got {self.num_processes}"
            )
        if self.process_id < -1 or (self.num_processes and self.process_id >= self.num_processes):
            raise ConfigError(
                f"--process_id={self.process_id} is not in [0, --num_processes={self.num_processes})"
            )
        if (self.coordinator_address or self.num_processes or self.process_id >= 0) and not (
            self.distributed
        ):
            raise ConfigError(
                "--coordinator_address/--num_processes/--process_id need --distributed"
            )
        if self.distributed and (seeding or self.mode in ("solve", "reindex", "bench")):
            raise ConfigError(
                f"--mode={self.mode}{' --dataset' if seeding else ''} runs on one process: the "
                "library's catalog is a local SQLite file and the benchmarks time one host; "
                "--distributed is for deposit, graft, verify, cycle, inspect and generate"
            )
        if self.mode in ("deposit", "cycle") and not seeding and not (self.text or self.text_file):
            raise ConfigError(f"--mode={self.mode} needs --text=... or --text_file=PATH")
        if self.mode == "cycle" and not (self.query or self.prompt_ids):
            raise ConfigError("--mode=cycle needs --query=TEXT (or --prompt_ids=... as the query)")
        batched = bool(self.batch_file or self.batch_report)
        if self.batch_file and self.mode not in ("graft", "verify"):
            raise ConfigError("--batch_file is for --mode=graft and --mode=verify")
        if self.batch_report and self.mode != "verify":
            raise ConfigError("--batch_report is for --mode=verify")
        if self.batch_file and self.batch_report:
            raise ConfigError(
                "--batch_file and --batch_report are mutually exclusive: verify answers a batch "
                "file now, or checks the recorded answers of an earlier run"
            )
        if batched and (self.artifact or self.query or self.prompt_ids or self.graft_position >= 0):
            raise ConfigError(
                "a batch names its artifacts and queries in --batch_file (or --batch_report): "
                "no --artifact, --query, --prompt_ids or --graft_position with it"
            )
        if batched and self.allow_relocation:
            raise ConfigError("a batch grafts at own positions only: no --allow_relocation")
        needs_artifact = ("inspect", "cycle") + (() if seeding else ("deposit",))
        needs_artifact += () if batched else ("graft", "verify")
        if self.mode in needs_artifact and not self.artifact:
            raise ConfigError(f"--mode={self.mode} needs --artifact=DIR")
        if self.bench not in BENCHES:
            raise ConfigError(f"--bench={self.bench!r}: expected one of {', '.join(BENCHES)}")
        if not self.bench_lengths or min(self.bench_lengths) < 1:
            raise ConfigError(f"--bench_lengths must be positive, got {list(self.bench_lengths)}")
        if not self.bench_batch_sizes or min(self.bench_batch_sizes) < 1:
            raise ConfigError(
                f"--bench_batch_sizes must be positive, got {list(self.bench_batch_sizes)}"
            )
        if self.bench_mb < 1:
            raise ConfigError(f"--bench_mb must be >= 1, got {self.bench_mb}")
        if self.parent and self.mode not in ("deposit", "cycle"):
            raise ConfigError("--parent is for --mode=deposit (a graft finds parents itself)")
        if self.graft_position < -1:
            raise ConfigError(
                f"--graft_position must be >= 0 (or -1: the artifact's own), got {self.graft_position}"
            )
        if (self.graft_position >= 0 or self.allow_relocation) and self.mode not in (
            "graft",
            "verify",
        ):
            raise ConfigError("--graft_position and --allow_relocation are for --mode=graft/verify")

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["prompt_ids"] = list(self.prompt_ids)
        out["bench_lengths"] = list(self.bench_lengths)
        out["bench_batch_sizes"] = list(self.bench_batch_sizes)
        out["trusted_keys"] = list(self.trusted_keys)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys: {', '.join(unknown)}")
        data = dict(data)
        if "prompt_ids" in data:
            data["prompt_ids"] = tuple(int(i) for i in data["prompt_ids"])
        for name in ("bench_lengths", "bench_batch_sizes"):
            if name in data:
                data[name] = tuple(int(i) for i in data[name])
        if "trusted_keys" in data:
            data["trusted_keys"] = tuple(str(k) for k in data["trusted_keys"])
        return cls(**data)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")
