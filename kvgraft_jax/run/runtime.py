"""Turns a `RunConfig` into live objects: the mesh, the model with its weights, the tokenizer.

This is the one place that logs the process, its devices and what the sharding rules left
replicated, so every mode starts the same way.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
from absl import logging
from gemma import gm
from jax.sharding import Mesh

from kvgraft_jax.core import model as model_lib
from kvgraft_jax.core import sharding, tokenizer
from kvgraft_jax.run import config as config_lib


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

    @property
    def info(self) -> model_lib.ModelInfo:
        """What a manifest records of this model (the fingerprint computed at load, once)."""
        return model_lib.ModelInfo(
            self.name, model_lib.config_to_json(self.config), self.fingerprint
        )


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


def is_gguf(source: str) -> bool:
    return source.endswith(".gguf")


def weights_source(cfg: config_lib.RunConfig) -> str | None:
    """None for random weights, else the GGUF file or checkpoint directory they come from."""
    if cfg.weights == "random":
        return None
    if cfg.weights:
        if "://" not in cfg.weights and not Path(cfg.weights).exists():
            raise config_lib.ConfigError(
                f"--weights={cfg.weights}: no such file or directory. It takes a Gemma 3 .gguf "
                "file, a Hugging Face Gemma 3 text checkpoint directory (config.json + "
                "safetensors) or the gemma package's Orbax checkpoint directory (local or gs://), "
                "fetched beforehand; nothing is downloaded at run time"
            )
        return cfg.weights
    if model_lib.is_tiny(cfg.model):
        return None
    if cfg.model == "gemma3_270m":
        from kvgraft_jax.core import gguf_import

        return str(gguf_import.embedded_gguf())
    raise config_lib.ConfigError(
        f"--model={cfg.model} has no embedded weights: pass --weights=PATH.gguf (a Gemma 3 GGUF), "
        "--weights=DIR (a Hugging Face Gemma 3 text checkpoint, or the gemma package's Orbax "
        "checkpoint with its tokenizer.model or --tokenizer), or --weights=random"
    )


@functools.cache
def _conversion(path: str, model_name: str):
    from kvgraft_jax.core import gguf_import

    return gguf_import.prepare(path, model_lib.build_model(model_name), model_name=model_name)


def load_model(cfg: config_lib.RunConfig, mesh: Mesh) -> LoadedModel:
    from kvgraft_jax.core import conversion, hf_checkpoint

    module = model_lib.build_model(cfg.model)
    source = weights_source(cfg)
    try:
        if source is None:
            params, plan = model_lib.init_random_params(module, seed=cfg.seed, mesh=mesh)
            fingerprint = model_lib.weights_fingerprint(module.config, params)
            described = f"random weights (seed {cfg.seed})"
        elif is_gguf(source):
            converted = _conversion(source, cfg.model)
            params, plan, fingerprint = conversion.load_params(converted, module, mesh)
            described = f"weights from {source}"
        elif hf_checkpoint.looks_like_hf(source):
            hf = hf_checkpoint.load(source, module, mesh, model_name=cfg.model)
            params, plan, fingerprint = hf.params, hf.plan, hf.fingerprint
            described = f"Hugging Face checkpoint {source}"
        else:
            params, plan = model_lib.load_checkpoint_params(
                module, source, mesh=mesh, model_name=cfg.model
            )
            fingerprint = model_lib.weights_fingerprint(module.config, params)
            described = f"Orbax Gemma checkpoint {source}"
    except (conversion.WeightsError, model_lib.CheckpointError) as e:
        raise config_lib.ConfigError(str(e)) from None
    loaded = LoadedModel(
        name=cfg.model,
        module=module,
        params=params,
        fingerprint=fingerprint,
        num_params=model_lib.param_count(params),
        replicated=plan.replicated,
    )
    logging.info(
        "model %s: %.2fM params, %s, fingerprint %s",
        cfg.model,
        loaded.num_params / 1e6,
        described,
        fingerprint[:16],
    )
    log_replicated(plan.replicated)
    return loaded


def log_replicated(entries) -> None:
    for line in sharding.describe_replicated(entries):
        logging.warning("%s", line)


def load_tokenizer(cfg: config_lib.RunConfig) -> tokenizer.Tokenizer | None:
    """The run's tokenizer: `--tokenizer`, the tiny one, the GGUF's vocabulary, the weights
    directory's `tokenizer.model`, or None (ids only)."""
    try:
        return _tokenizer(cfg)
    except tokenizer.TokenizerError as e:
        raise config_lib.ConfigError(str(e)) from None


def _tokenizer(cfg: config_lib.RunConfig) -> tokenizer.Tokenizer | None:
    if cfg.tokenizer:
        return tokenizer.Tokenizer.from_file(cfg.tokenizer)
    if model_lib.is_tiny(cfg.model):
        return tokenizer.tiny_tokenizer()
    source = weights_source(cfg)
    if source is None:
        return None
    if not is_gguf(source):  # a checkpoint directory's own tokenizer
        own = Path(source) / "tokenizer.model"
        return tokenizer.Tokenizer.from_file(own) if own.is_file() else None
    from kvgraft_jax.core import gguf_import

    try:
        converted = _conversion(source, cfg.model)  # rebuilt from the GGUF's own vocabulary
    except gguf_import.GGUFError as e:
        raise config_lib.ConfigError(str(e)) from None
    return tokenizer.Tokenizer(converted.tokenizer_proto(), source=f"{source} (GGUF vocab)")


def prompt_ids(cfg: config_lib.RunConfig, tok: tokenizer.Tokenizer | None) -> list[int]:
    if cfg.prompt_ids:
        return list(cfg.prompt_ids)
    if tok is None:
        raise config_lib.ConfigError(
            f"--model={cfg.model} has no tokenizer here: pass --tokenizer=PATH/tokenizer.model "
            "(Gemma 3's SentencePiece file) or give the prompt as --prompt_ids=2,..."
        )
    return tok.encode(cfg.prompt, add_bos=True)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The live objects every mode starts from."""

    mesh: Mesh
    tok: tokenizer.Tokenizer | None
    loaded: LoadedModel

    def __iter__(self):
        """`mesh, tok, loaded = runtime.start(cfg)` (no copy: `dataclasses.astuple` would
        deep-copy the weights)."""
        return iter((self.mesh, self.tok, self.loaded))


def start(cfg: config_lib.RunConfig, *, text_for: str = "") -> Runtime:
    """The run's mesh, tokenizer and model, checked to belong together. `text_for` names what
    needs a tokenizer (e.g. "--mode=deposit"): without one, that is a `ConfigError`."""
    mesh = build_mesh(cfg)
    tok = load_tokenizer(cfg)
    if tok is None and text_for:
        ids = (
            " or give token ids (--prompt_ids=2,...)" if text_for in ("--prompt", "--query") else ""
        )
        raise config_lib.ConfigError(
            f"{text_for} works on text: pass --tokenizer=PATH/tokenizer.model for {cfg.model} "
            f"(Gemma 3's SentencePiece file){ids}"
        )
    loaded = load_model(cfg, mesh)
    if tok is not None and tok.vocab_size > loaded.config.num_embed:
        raise config_lib.ConfigError(
            f"tokenizer {tok.source} has {tok.vocab_size} pieces, model {cfg.model} embeds only "
            f"{loaded.config.num_embed}: they do not belong together"
        )
    return Runtime(mesh, tok, loaded)
