"""Turns a `RunConfig` into live objects: the mesh, the model with its weights, the tokenizer.

This is the one place that logs the process, its devices and what the sharding rules left
replicated, so every mode starts the same way.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any

import jax
from absl import logging
from gemma import gm
from jax.sharding import Mesh

from kvgraft_jax import config as config_lib
from kvgraft_jax import model as model_lib
from kvgraft_jax import sharding, tokenizer


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    name: str
    module: gm.nn.Transformer
    params: Any
    fingerprint: str
    num_params: int
    replicated: tuple[sharding.Replicated, ...]

    @property
    def config(self):
        return self.module.config


def versions() -> dict[str, str]:
    import flax
    import gemma
    import jaxlib
    import orbax.checkpoint

    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "gemma": getattr(gemma, "__version__", "unknown"),
        "orbax_checkpoint": orbax.checkpoint.__version__,
        "backend": jax.default_backend(),
    }


def normalize_xla_flags(text: str) -> str:
    """XLA flags that can change numerics, sorted; the forced host device count cannot."""
    kept = [f for f in text.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(sorted(kept))


def xla_flags() -> str:
    """This process's `XLA_FLAGS`, normalised: part of the exactness contract, like versions."""
    return normalize_xla_flags(os.environ.get("XLA_FLAGS", ""))


def build_mesh(cfg: config_lib.RunConfig) -> Mesh:
    try:
        spec = sharding.MeshSpec.parse(cfg.mesh)
    except sharding.MeshSpecError as e:
        raise config_lib.ConfigError(str(e)) from None
    mesh = sharding.make_mesh(spec)
    logging.info(
        "process %d of %d, %d local / %d global devices (%s); mesh %s",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        jax.default_backend(),
        spec,
    )
    return mesh


def load_model(cfg: config_lib.RunConfig, mesh: Mesh) -> LoadedModel:
    module = model_lib.build_model(cfg.model)
    if cfg.weights != "random":
        raise config_lib.ModeNotBuiltError(
            f"--weights={cfg.weights}: loading weights from a path (Orbax Gemma checkpoints, GGUF) "
            "arrives with issue #5; use --weights=random for now"
        )
    params, plan = model_lib.init_random_params(module, seed=cfg.seed, mesh=mesh)
    fingerprint = model_lib.weights_fingerprint(module.config, params)
    loaded = LoadedModel(
        name=cfg.model,
        module=module,
        params=params,
        fingerprint=fingerprint,
        num_params=model_lib.param_count(params),
        replicated=plan.replicated,
    )
    logging.info(
        "model %s: %.2fM params, random weights (seed %d), fingerprint %s",
        cfg.model,
        loaded.num_params / 1e6,
        cfg.seed,
        fingerprint[:16],
    )
    log_replicated(plan.replicated)
    return loaded


def log_replicated(entries) -> None:
    for line in sharding.describe_replicated(entries):
        logging.warning("%s", line)


def load_tokenizer(cfg: config_lib.RunConfig) -> tokenizer.Tokenizer | None:
    """The run's tokenizer, or None for a real model given no `--tokenizer` (ids only)."""
    if cfg.tokenizer:
        return tokenizer.Tokenizer.from_file(cfg.tokenizer)
    if model_lib.is_tiny(cfg.model):
        return tokenizer.tiny_tokenizer()
    return None


def prompt_ids(cfg: config_lib.RunConfig, tok: tokenizer.Tokenizer | None) -> list[int]:
    if cfg.prompt_ids:
        return list(cfg.prompt_ids)
    if tok is None:
        raise config_lib.ConfigError(
            f"--model={cfg.model} has no tokenizer here: pass --tokenizer=PATH/tokenizer.model "
            "(Gemma 3's SentencePiece file) or give the prompt as --prompt_ids=2,..."
        )
    return tok.encode(cfg.prompt, add_bos=True)
