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
BENCHES = ("artifact", "graft")


MAX_TOKENS = 131_072  # Gemma 3's longest context window: no cache or decode needs more


class ConfigError(ValueError):
    """Flags that are unknown, contradictory or incomplete; the CLI exits with code 2."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every setting of one run, as plain values."""

    mode: str = "generate"
    model: str = "tiny"
    weights: str = (
        ""  # "": the model's default (tiny: random; gemma3_270m: embedded GGUF), "random", a .gguf
    )
    tokenizer: str = ""  # a SentencePiece .model; empty: the model's default
    seed: int = 0
    mesh: str = ""  # "data:2,model:4"; empty: all devices on model
    batch_size: int = 1
    chunk_size: int = 64
    cache_length: int = 0  # 0: prompt + max_new_tokens
    max_new_tokens: int = 16
    stop_at_eos: bool = True
    prompt: str = ""
    prompt_ids: tuple[int, ...] = ()
    text: str = ""
    text_file: str = ""
    query: str = ""
    artifact: str = ""
    library: str = ""
    library_artifacts: str = ""  # where a new library keeps its artifacts; "": DIR/artifacts
    report: str = ""  # JSON output path; empty: none
    overwrite: bool = False  # deposit: replace a different artifact at --artifact
    bench: str = "artifact"  # which benchmark --mode=bench runs
    bench_mb: int = 128  # size of the benchmark's synthetic KV state
    bench_lengths: tuple[int, ...] = (512, 2048, 8192)  # --bench=graft: prefix lengths
    parent: str = ""  # deposit: the artifact this one extends (a prefix chain)
    compact: bool = True  # deposit: local layers store only their last `window` positions
    graft_position: int = -1  # graft/verify: first position of the prefix; -1: its own
    allow_relocation: bool = False  # graft/verify: allow another position (approximate)
    dataset: str = ""  # JSONL problems: deposit (seed, with solutions) or solve
    attempts: int = 4  # solve: generations per missed problem (greedy, then sampled)
    solve_tokens: int = 32  # solve: token budget of one attempt
    answer_tokens: int = 12  # solve: decode budget of an answer from a grafted item
    temperature: float = 0.8  # solve: sampling temperature of attempts after the first
    route_threshold: float = 0.8  # solve: minimum term similarity of a search match
    passes: int = 2  # solve: passes over the dataset (the second shows reuse)
    chapter_items: int = 1  # deposit --dataset: verified items per artifact
    allow_unsandboxed_programs: bool = False  # program verifiers without isolation (labelled)
    signing_key: str = ""  # deposits: sign each manifest with this Ed25519 private key (PEM)
    trusted_keys: tuple[str, ...] = ()  # reads: refuse artifacts not signed by one of these
    joules_per_flop: float = 1e-10  # energy estimate assumption
    device_watts: float = 65.0  # energy estimate assumption
    distributed: bool = False  # join other processes through jax.distributed (multi-host)
    coordinator_address: str = ""  # "host:port" of process 0; empty: detected (TPU VMs)
    num_processes: int = 0  # 0: detected
    process_id: int = -1  # -1: detected

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
        needs_artifact = ("inspect", "graft", "verify", "cycle") + (() if seeding else ("deposit",))
        if self.mode in needs_artifact and not self.artifact:
            raise ConfigError(f"--mode={self.mode} needs --artifact=DIR")
        if self.bench not in BENCHES:
            raise ConfigError(f"--bench={self.bench!r}: expected one of {', '.join(BENCHES)}")
        if not self.bench_lengths or min(self.bench_lengths) < 1:
            raise ConfigError(f"--bench_lengths must be positive, got {list(self.bench_lengths)}")
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
        if "bench_lengths" in data:
            data["bench_lengths"] = tuple(int(i) for i in data["bench_lengths"])
        if "trusted_keys" in data:
            data["trusted_keys"] = tuple(str(k) for k in data["trusted_keys"])
        return cls(**data)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")
