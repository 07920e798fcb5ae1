"""Benchmark (JSON out) `weights`: how long each weight source takes to load, first and later.

    python -m kvgraft_jax.main --mode=bench --bench=weights --report=runs/bench_weights.json

The same numbers are loaded from every format a user keeps them in, side by side in one run: the
GGUF (`--weights`, default the embedded 270M), and the Hugging Face checkpoint and the gemma
package's Orbax checkpoint written from it into a scratch directory. Each time is the whole call
a user waits for, from the path to checked parameters on the run's mesh, fingerprint included:

- `gguf_first_s`: hash, parse, dequantize, map, write the conversion cache, restore it.
- `gguf_cached_s`: hash the file, find the conversion, restore it into the mesh's sharding.
- `hf_first_s`, `hf_again_s`: read every device's block from the safetensors (nothing is cached:
  the conversion is a change of layout done during the read), twice.
- `orbax_s`: `gm.ckpts.load_params` into the mesh's sharding (no conversion: nothing to cache).

`plain_read_s` reads the safetensors files once with `open().read()`: the floor of any load.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from gemma import gm

from kvgraft_jax.core import conversion, environment, gguf_import, hf_checkpoint
from kvgraft_jax.core import model as model_lib
from kvgraft_jax.run import config as config_lib
from kvgraft_jax.run import runtime


@dataclasses.dataclass(frozen=True)
class WeightsBench:
    """The JSON report of `--mode=bench --bench=weights`."""

    config: dict[str, Any]
    model: str
    mesh: str
    num_params: int
    source_bytes: dict[str, int]  # gguf, hf (safetensors + config + tokenizer), orbax
    seconds: dict[str, float]  # gguf_first_s ... orbax_s, plain_read_s
    ratios: dict[str, float]  # each load over the cached GGUF load, and over the plain read
    same_fingerprint: bool  # every source gave the same parameter digest
    fingerprint: str
    versions: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _timed(fn):
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def _bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _plain_read(directory: Path) -> float:
    started = time.perf_counter()
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
    return time.perf_counter() - started


def run(cfg: config_lib.RunConfig, *, workdir: str | os.PathLike | None = None) -> WeightsBench:
    source = runtime.weights_source(cfg)
    if source is None or not runtime.is_gguf(source):
        raise config_lib.ConfigError(
            "--bench=weights starts from a Gemma 3 GGUF: use --model=gemma3_270m (the embedded "
            "file) or pass --weights=PATH.gguf"
        )
    mesh = runtime.build_mesh(cfg)
    module = model_lib.build_model(cfg.model)
    with tempfile.TemporaryDirectory(dir=workdir, prefix="kvgraft-weights-bench-") as scratch:
        scratch = Path(scratch)
        gguf_root = scratch / "gguf_cache"

        def gguf_load():
            converted = gguf_import.prepare(source, module, model_name=cfg.model, root=gguf_root)
            return conversion.load_params(converted, module, mesh), converted

        gguf_first_s, ((params, _, fingerprint), converted) = _timed(gguf_load)
        gguf_cached_s, ((_, _, again), _) = _timed(gguf_load)
        hf_checkpoint.write(
            params,
            module.config,
            scratch / "hf",
            tokenizer_proto=converted.tokenizer_proto(),
            shards=2,
        )
        gm.ckpts.save_params(params, scratch / "orbax", wait_until_finished=True)
        del params

        def hf_load():
            return hf_checkpoint.load(
                scratch / "hf", module, mesh, model_name=cfg.model
            ).fingerprint

        hf_first_s, hf_first = _timed(hf_load)
        hf_again_s, hf_again = _timed(hf_load)

        def orbax_load():
            loaded, _ = model_lib.load_checkpoint_params(
                module, str(scratch / "orbax"), mesh=mesh, model_name=cfg.model
            )
            return model_lib.weights_fingerprint(module.config, loaded)

        orbax_s, orbax = _timed(orbax_load)
        plain_read_s = _plain_read(scratch / "hf")
        source_bytes = {
            "gguf": _bytes(Path(source)),
            "hf": _bytes(scratch / "hf"),
            "orbax": _bytes(scratch / "orbax"),
        }
    seconds = {
        "gguf_first_s": gguf_first_s,
        "gguf_cached_s": gguf_cached_s,
        "hf_first_s": hf_first_s,
        "hf_again_s": hf_again_s,
        "orbax_s": orbax_s,
        "plain_read_s": plain_read_s,
    }
    loads = {k: v for k, v in seconds.items() if k != "plain_read_s"}
    ratios = {f"{k[:-2]}_over_gguf_cached": v / gguf_cached_s for k, v in loads.items()}
    ratios |= {f"{k[:-2]}_over_plain_read": v / plain_read_s for k, v in loads.items()}
    return WeightsBench(
        config=cfg.to_json(),
        model=cfg.model,
        mesh=cfg.mesh,
        num_params=model_lib.param_count(model_lib.abstract_params(module)),
        source_bytes=source_bytes,
        seconds={k: round(v, 4) for k, v in seconds.items()},
        ratios={k: round(v, 3) for k, v in ratios.items()},
        same_fingerprint=len({fingerprint, again, hf_first, hf_again, orbax}) == 1,
        fingerprint=fingerprint,
        versions=environment.versions(),
    )
