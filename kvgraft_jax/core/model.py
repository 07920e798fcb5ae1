"""Which Gemma: gemma's `gm.nn` Gemma 3 text models by name, the tiny test family, weights and fingerprint.

Real-size models are built from gemma's own classes (text only: the vision encoder is dropped). The
tiny family keeps the traits that matter for grafting (5 local : 1 global layers, a sliding window
shorter than the test prefixes, QK norm, GQA with several KV heads so head sharding is exercised)
at a size that compiles in seconds on CPU. Random weights are initialised under `jax.jit` directly
in their target sharding; with JAX's partitionable threefry the values do not depend on the mesh.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from gemma import gm
from gemma.gm.nn import _config as gemma_config
from gemma.gm.nn import _gemma as gemma_models
from jax.sharding import Mesh

from kvgraft_jax.core import multihost, sharding

GEMMA3_MODELS: Mapping[str, Callable[[], gm.nn.Transformer]] = {
    "gemma3_270m": lambda: gm.nn.Gemma3_270M(),
    "gemma3_1b": lambda: gm.nn.Gemma3_1B(),
    "gemma3_4b": lambda: gm.nn.Gemma3_4B(text_only=True),
    "gemma3_12b": lambda: gm.nn.Gemma3_12B(text_only=True),
    "gemma3_27b": lambda: gm.nn.Gemma3_27B(text_only=True),
}


def _tiny_config(
    *, num_heads: int, num_kv_heads: int, num_layers: int
) -> gemma_config.TransformerConfig:
    return gemma_config.TransformerConfig(
        final_logit_softcap=None,
        num_embed=1024,  # the tiny tokenizer's vocabulary
        embed_dim=128,
        hidden_dim=256,
        num_heads=num_heads,
        head_dim=32,
        num_kv_heads=num_kv_heads,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        use_qk_norm=True,
        attention_types=gemma_config.make_attention_layers_types(
            gemma_models.GEMMA3_ATTENTION_PATTERN, num_layers=num_layers
        ),
        query_pre_attn_norm=gemma_config.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM,
        attn_logits_soft_cap=None,
        sliding_window_size=16,
        transpose_gating_einsum=True,
        local_base_frequency=10_000,
        global_base_frequency=1_000_000,
        vision_encoder=None,
    )


TINY_CONFIGS: Mapping[str, gemma_config.TransformerConfig] = {
    # 6 layers = one 5:1 period; 8 query heads over 4 KV heads (GQA, shardable over model:2 and :4).
    "tiny": _tiny_config(num_heads=8, num_kv_heads=4, num_layers=6),
    # Like Gemma 3 270M/1B: one KV head (nothing to shard on heads), two 5:1 periods.
    "tiny_mqa": _tiny_config(num_heads=4, num_kv_heads=1, num_layers=12),
}

MODEL_NAMES = (*GEMMA3_MODELS, *TINY_CONFIGS)

# Published context windows (tokens); the tiny models were never trained to one.
CONTEXT_WINDOW: Mapping[str, int] = {
    "gemma3_270m": 32_768,
    "gemma3_1b": 32_768,
    "gemma3_4b": 131_072,
    "gemma3_12b": 131_072,
    "gemma3_27b": 131_072,
}


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a manifest records about a model."""

    name: str
    config: dict[str, Any]
    fingerprint: str  # SHA-256 over the config and every parameter (model.weights_fingerprint)


class UnknownModelError(ValueError):
    pass


def build_model(name: str) -> gm.nn.Transformer:
    """The gemma `Transformer` module for a model name (no weights)."""
    if name in GEMMA3_MODELS:
        return GEMMA3_MODELS[name]()
    if name in TINY_CONFIGS:
        return gm.nn.Transformer(config=TINY_CONFIGS[name])
    raise UnknownModelError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")


def is_tiny(name: str) -> bool:
    return name in TINY_CONFIGS


def config_to_json(config: gemma_config.TransformerConfig) -> dict[str, Any]:
    """The config as plain JSON values (enums by name); part of the weights fingerprint."""

    def plain(value: Any) -> Any:
        if isinstance(value, enum.Enum):
            return value.name
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return value

    return {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config)}


# ---------------------------------------------------------------------------------------------
# Parameter layout: logical axes per gemma parameter, so sharding comes from the rules alone.


def param_logical_axes(
    path: tuple[str, ...], shape: tuple[int, ...], config: gemma_config.TransformerConfig
) -> tuple[str, ...]:
    """Logical axes of one gemma parameter, from its path (`layer_3/attn/q_einsum/w`)."""
    s = sharding
    leaf = "/".join(path)
    if leaf.endswith("embedder/input_embedding"):
        return (s.VOCAB, s.EMBED)
    if leaf.endswith("attn/q_einsum/w"):
        return (s.HEADS, s.EMBED, s.HEAD_DIM)
    if leaf.endswith("attn/kv_einsum/w"):
        return (s.STACK, s.KV_HEADS, s.EMBED, s.HEAD_DIM)
    if leaf.endswith("attn/qkv_einsum/w"):
        return (s.STACK, s.HEADS, s.EMBED, s.HEAD_DIM)
    if leaf.endswith("attn/attn_vec_einsum/w"):
        return (s.HEADS, s.HEAD_DIM, s.EMBED)
    if leaf.endswith("mlp/gating_einsum"):
        return (
            (s.STACK, s.MLP, s.EMBED)
            if config.transpose_gating_einsum
            else (s.STACK, s.EMBED, s.MLP)
        )
    if leaf.endswith("mlp/linear"):
        return (s.MLP, s.EMBED)
    if leaf.endswith("scale") and len(shape) == 1:
        return (s.NORM,)
    raise KeyError(f"no logical axes known for gemma parameter {leaf!r} of shape {shape}")


def _path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def abstract_params(model: gm.nn.Transformer) -> dict[str, Any]:
    """Parameter shapes and dtypes via `jax.eval_shape`: nothing is allocated."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(lambda t: model.init(jax.random.key(0), t)["params"], tokens)


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """Shardings for every parameter and what the rules had to leave replicated."""

    shardings: Any  # pytree of NamedSharding, like the params
    replicated: tuple[sharding.Replicated, ...]


def param_plan(abstract: Any, config: gemma_config.TransformerConfig, mesh: Mesh) -> ParamPlan:
    replicated: list[sharding.Replicated] = []

    def one(path, leaf):
        names = _path_names(path)
        axes = param_logical_axes(names, leaf.shape, config)
        return sharding.named_sharding(
            mesh,
            axes,
            leaf.shape,
            name="/".join(names),
            nbytes=int(np.prod(leaf.shape)) * leaf.dtype.itemsize,
            replicated=replicated,
        )

    return ParamPlan(jax.tree_util.tree_map_with_path(one, abstract), tuple(replicated))


def init_random_params(model: gm.nn.Transformer, *, seed: int, mesh: Mesh) -> tuple[Any, ParamPlan]:
    """Deterministic random weights from `seed`, created in their target sharding."""
    abstract = abstract_params(model)
    plan = param_plan(abstract, model.config, mesh)
    init = jax.jit(
        lambda key: model.init(key, jnp.zeros((1, 1), jnp.int32))["params"],
        out_shardings=plan.shardings,
    )
    return init(jax.random.key(seed)), plan


def param_count(params: Any) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def weights_fingerprint(config: gemma_config.TransformerConfig, params: Any) -> str:
    """SHA-256 over the config and every parameter's path, dtype, shape and C-order bytes.

    Leaves are visited in sorted path order and fetched one at a time, so the fingerprint is the
    same whatever mesh holds the weights.
    """
    digest = hashlib.sha256()
    digest.update(json.dumps(config_to_json(config), sort_keys=True).encode())
    leaves = {"/".join(_path_names(p)): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    for path in sorted(leaves):
        value = multihost.host_value(leaves[path])  # an all-gather across processes
        header = json.dumps([path, str(value.dtype), list(value.shape)])
        digest.update(header.encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


class CheckpointError(ValueError):
    """An Orbax Gemma checkpoint that is missing or does not hold this model's parameters."""


def load_checkpoint_params(
    model: gm.nn.Transformer, path: str, *, mesh: Mesh, model_name: str
) -> tuple[Any, ParamPlan]:
    """Parameters from an Orbax Gemma checkpoint (the layout `gm.ckpts` reads), in their sharding.

    The restore target carries each parameter's `NamedSharding` for `mesh`, so every device reads
    only its own shard; multimodal parameters of a published checkpoint are left unread.
    """
    from etils import epath

    if not epath.Path(path).is_dir():
        raise CheckpointError(
            f"no Orbax Gemma checkpoint at {path}: download the Gemma 3 checkpoint for "
            f"{model_name} (the Flax/Orbax release, e.g. from Kaggle `google/gemma-3`) and pass its "
            "directory as --weights, with --tokenizer=its tokenizer.model; nothing is downloaded "
            "at run time"
        )
    abstract = abstract_params(model)
    plan = param_plan(abstract, model.config, mesh)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, plan.shardings
    )
    try:
        params = gm.ckpts.load_params(path, params=target, donate=False, text_only=True)
    except Exception as e:  # orbax/gemma raise ValueError, KeyError, FileNotFoundError, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path} does not hold {model_name} parameters ({type(e).__name__}: {first[:300]})"
        ) from None
    got = {jax.tree_util.keystr(p): (x.shape, x.dtype) for p, x in _leaves(params)}
    want = {jax.tree_util.keystr(p): (x.shape, x.dtype) for p, x in _leaves(abstract)}
    if got != want:
        wrong = sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))
        raise CheckpointError(
            f"{path} does not hold {model_name} parameters: {wrong[0]} is "
            f"{got.get(wrong[0])}, the model needs {want.get(wrong[0])}"
        )
    return params, plan


def _leaves(tree):
    return jax.tree_util.tree_leaves_with_path(tree)


def describe_model(name: str, module: gm.nn.Transformer, params: Any) -> ModelInfo:
    """Name, config and weights fingerprint (which hashes every parameter: keep the result)."""
    return ModelInfo(
        name, config_to_json(module.config), weights_fingerprint(module.config, params)
    )
