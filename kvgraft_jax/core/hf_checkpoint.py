"""Gemma 3 text weights from a Hugging Face checkpoint directory, and back.

    loaded = hf_checkpoint.load("gemma-3-270m/", module, mesh, model_name="gemma3_270m")
    loaded.params, loaded.fingerprint      # bf16, each device's block read by itself
    hf_checkpoint.write(params, module.config, "export/", tokenizer_proto=proto, shards=2)

A Hugging Face Gemma 3 text checkpoint (`Gemma3ForCausalLM`, `model_type: gemma3_text`) is a
`config.json`, the weights in `model.safetensors` or in shards listed by
`model.safetensors.index.json`, and the tokenizer (`tokenizer.model`, SentencePiece).

What a load does, and why:
- `config.json` is checked against the gemma config before any weight is read, one line per
  mismatch: layers, widths, heads, head dim, the local/global layer pattern, the sliding window,
  both RoPE bases and the global RoPE scaling (`rope_scaling` or transformers 5's
  `rope_parameters`), the query scaling, softcaps, norm epsilon and activation. A multimodal
  (`Gemma3ForConditionalGeneration`) or non-Gemma-3 checkpoint is refused by its name.
- Every tensor is checked (present, shape, float dtype) and every tensor in the checkpoint must be
  used: an untied `lm_head`, a vision tower or a missing shard is refused by name.
- Layouts: Hugging Face stores `Linear` weights `[out, in]` with the output features ordered
  (head, head_dim); gemma keeps `q_einsum [N, D, H]`, `kv_einsum [2, K, D, H]`,
  `attn_vec_einsum [N, H, D]`, `gating_einsum [2, F, D]`, `linear [F, D]`. Gemma's RMSNorm in
  both libraries computes `x * (1 + weight)`, so norm weights are copied as they are (llama.cpp's
  GGUF adds the 1; `gguf_import` takes it off). The output head is tied to the embedding.
- Each device's block is read straight from the memory-mapped safetensors file by
  `jax.make_array_from_callback` (only the rows and columns that device holds), so no host copy
  of the whole model is made and each process of a multi-host run reads only its own shards.
- Nothing is cached: unlike a GGUF (parse and dequantize, ~15 s), this conversion is a change of
  layout done during the read. Measured on the 270M here (`--bench=weights`), a content-keyed
  Orbax cache was slower on a hit (2.30 s) than reading the safetensors again (1.73 s, and
  0.95 s once the read stopped copying each block), because proving a hit means hashing every
  source byte first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import logging
from gemma import gm
from jax.sharding import Mesh

from kvgraft_jax.core import atomic, conversion, multihost, progress
from kvgraft_jax.core import model as model_lib

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.model"
FLOAT_DTYPES = ("BF16", "F16", "F32")
MAX_JSON_BYTES = 16 << 20  # config.json and the index are kilobytes (the 27B's index: ~70 KB)
# transformers' Gemma3TextConfig defaults for keys a config.json may leave out.
_DEFAULTS = {
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": None,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "sliding_window_pattern": 6,
}
_GEMMA_RMS_NORM_EPS = 1e-6  # gemma's RMSNorm hard-codes it
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


class HFCheckpointError(conversion.WeightsError):
    """A Hugging Face checkpoint this loader cannot use: incomplete, multimodal, another model."""


def is_hf_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / CONFIG_FILE).is_file()


def looks_like_hf(path: str | os.PathLike) -> bool:
    """A directory with a config.json or safetensors: read (or refused) as Hugging Face's."""
    path = Path(path)
    return is_hf_checkpoint(path) or (path.is_dir() and any(path.glob("*.safetensors")))


# -------------------------------------------------------------------------------------------
# config.json


def _small_json(path: Path) -> Any:
    """A JSON file of a checkpoint's metadata; a forged one of gigabytes is refused unread."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise HFCheckpointError(
            f"{path} is {size:,} bytes: not checkpoint metadata (at most {MAX_JSON_BYTES:,})"
        )
    return json.loads(path.read_text())


def read_config(directory: Path) -> dict[str, Any]:
    """config.json, refusing anything but a Gemma 3 text model by name."""
    path = directory / CONFIG_FILE
    try:
        hf = _small_json(path)
    except HFCheckpointError:
        raise
    except (OSError, ValueError) as e:
        raise HFCheckpointError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(hf, dict):
        raise HFCheckpointError(f"{path} is not a JSON object")
    kind, architectures = hf.get("model_type"), hf.get("architectures") or []
    if kind == "gemma3" or "vision_config" in hf or "text_config" in hf:
        raise HFCheckpointError(
            f"{directory} is a multimodal Gemma 3 checkpoint ({', '.join(architectures) or kind}); "
            "this loader reads text-only Gemma 3 (Gemma3ForCausalLM, model_type gemma3_text): use "
            "the text checkpoint, or the gemma package's Orbax checkpoint with --weights=DIR"
        )
    if kind != "gemma3_text":
        raise HFCheckpointError(
            f"{directory} holds a {kind!r} model ({', '.join(architectures) or 'no architectures'}); "
            "this loader reads Gemma 3 text checkpoints (model_type gemma3_text) only"
        )
    return hf


def _layer_types(hf: dict[str, Any], num_layers: int) -> list[str]:
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    pattern = int(
        hf.get("sliding_window_pattern")
        or hf.get("_sliding_window_pattern")
        or _DEFAULTS["sliding_window_pattern"]
    )
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def _rope(hf: dict[str, Any], path: Path) -> dict[str, float]:
    """RoPE bases and linear scale factors of the global and local layers."""

    def factor(spec: dict[str, Any] | None, which: str) -> float:
        if not spec:
            return 1.0
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind == "default":
            return 1.0
        if kind != "linear":
            raise HFCheckpointError(
                f"{path}: {which} RoPE type {kind!r}; gemma implements linear scaling only"
            )
        return float(spec["factor"])

    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5
        full, local = params["full_attention"], params.get("sliding_attention", {})
        return {
            "global RoPE base": float(full["rope_theta"]),
            "local RoPE base": float(local.get("rope_theta", _DEFAULTS["rope_local_base_freq"])),
            "global RoPE scale": factor(full, "global"),
            "local RoPE scale": factor(local, "local"),
        }
    return {
        "global RoPE base": float(hf.get("rope_theta", _DEFAULTS["rope_theta"])),
        "local RoPE base": float(hf.get("rope_local_base_freq", _DEFAULTS["rope_local_base_freq"])),
        "global RoPE scale": factor(hf.get("rope_scaling"), "global"),
        "local RoPE scale": 1.0,
    }


def _query_scalar(config) -> int:
    norm = gm.nn.config.QueryPreAttentionNormalisation
    if config.query_pre_attn_norm == norm.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS:
        return config.embed_dim // config.num_heads
    if config.query_pre_attn_norm == norm.BY_ONE_OVER_SQRT_HEAD_DIM:
        return config.head_dim
    raise HFCheckpointError(f"gemma's {config.query_pre_attn_norm} has no Hugging Face equivalent")


def _global_layers(types) -> list[int]:
    return [i for i, t in enumerate(types) if t in ("full_attention", "GLOBAL")]


def check_config(hf: dict[str, Any], config, *, model_name: str, path: Path) -> None:
    """Refuses a config.json that differs from the gemma config, one line per difference."""
    try:
        _check_config(hf, config, model_name=model_name, path=path)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        if isinstance(e, HFCheckpointError):
            raise
        raise HFCheckpointError(
            f"{path / CONFIG_FILE} has a malformed field ({type(e).__name__}: {e})"
        ) from None


def _check_config(hf: dict[str, Any], config, *, model_name: str, path: Path) -> None:
    required = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    )
    lacking = [k for k in required if k not in hf]
    if lacking:
        raise HFCheckpointError(f"{path / CONFIG_FILE} lacks {', '.join(lacking)}")
    get = lambda k: hf.get(k, _DEFAULTS.get(k))  # noqa: E731
    layers = int(hf["num_hidden_layers"])
    types = _layer_types(hf, layers)
    global_layers = _global_layers(types)
    pairs: dict[str, tuple[Any, Any]] = {
        "layers": (layers, config.num_layers),
        "vocab size": (hf["vocab_size"], config.num_embed),
        "embedding width": (hf["hidden_size"], config.embed_dim),
        "MLP width": (hf["intermediate_size"], config.hidden_dim),
        "query heads": (hf["num_attention_heads"], config.num_heads),
        "KV heads": (hf["num_key_value_heads"], config.num_kv_heads),
        "head dim": (get("head_dim"), config.head_dim),
        "global layers": (
            global_layers,
            _global_layers([t.name for t in config.attention_types]),
        ),
        "sliding window": (get("sliding_window"), config.sliding_window_size),
        "query scaling (query_pre_attn_scalar)": (
            get("query_pre_attn_scalar"),
            _query_scalar(config),
        ),
        "final logit softcap": (get("final_logit_softcapping"), config.final_logit_softcap),
        "attention logit softcap": (get("attn_logit_softcapping"), config.attn_logits_soft_cap),
        "RMSNorm epsilon": (get("rms_norm_eps"), _GEMMA_RMS_NORM_EPS),
        "tied embedding": (get("tie_word_embeddings"), True),
    }
    rope = _rope(hf, path / CONFIG_FILE)
    pairs.update(
        {
            "global RoPE base": (rope["global RoPE base"], config.global_base_frequency),
            "local RoPE base": (rope["local RoPE base"], config.local_base_frequency),
            "global RoPE scale": (rope["global RoPE scale"], config.global_scale_factor),
            "local RoPE scale": (rope["local RoPE scale"], config.local_scale_factor),
        }
    )
    lines = [
        f"{name}: checkpoint {got}, {model_name} {want}"
        for name, (got, want) in pairs.items()
        if not _same(got, want)
    ]
    if len(types) != layers:
        lines.append(f"layer_types: {len(types)} entries for num_hidden_layers {layers}")
    activation = (
        hf.get("hidden_activation") or hf.get("hidden_act") or _DEFAULTS["hidden_activation"]
    )
    if activation not in _GELU_TANH:
        lines.append(f"activation: checkpoint {activation}, {model_name} gelu (tanh)")
    if lines:
        raise HFCheckpointError(
            f"{path} does not match --model={model_name}:\n  " + "\n  ".join(lines)
        )


def _same(got: Any, want: Any) -> bool:
    if got is None or want is None:
        return got is None and want is None
    if isinstance(want, list):
        return list(got) == want
    try:
        return float(got) == float(want)
    except (TypeError, ValueError):
        return got == want


def hf_config(config, *, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """The config.json of a Hugging Face Gemma 3 text checkpoint of this gemma config."""
    if config.local_scale_factor != 1.0:
        raise HFCheckpointError("Hugging Face Gemma 3 has no local RoPE scaling")
    types = [
        "full_attention" if t.name == "GLOBAL" else "sliding_attention"
        for t in config.attention_types
    ]
    scaling = (
        None
        if config.global_scale_factor == 1.0
        else {"rope_type": "linear", "factor": float(config.global_scale_factor)}
    )
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": config.num_embed,
        "hidden_size": config.embed_dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "query_pre_attn_scalar": _query_scalar(config),
        "layer_types": types,
        "sliding_window": config.sliding_window_size,
        "rope_theta": float(config.global_base_frequency),
        "rope_local_base_freq": float(config.local_base_frequency),
        "rope_scaling": scaling,
        "final_logit_softcapping": config.final_logit_softcap,
        "attn_logit_softcapping": config.attn_logits_soft_cap,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": _GEMMA_RMS_NORM_EPS,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "use_bidirectional_attention": False,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "torch_dtype": torch_dtype,
    }


# -------------------------------------------------------------------------------------------
# The mapping: which Hugging Face tensors make each gemma leaf, and how


@dataclasses.dataclass(frozen=True)
class Source:
    """A gemma leaf made of Hugging Face tensors: stacked (when `stacked`) on a new first axis,
    each first transposed (`transpose`), its first axis split into (-1, `split`), then its axes
    permuted by `perm`."""

    names: tuple[str, ...]
    stacked: bool = False
    transpose: bool = False
    split: int | None = None
    perm: tuple[int, ...] | None = None

    def hf_shape(self, part_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face tensor's shape for one part of the leaf (stack axis removed)."""
        shape = list(part_shape)
        if self.perm:
            shape = [shape[self.perm.index(j)] for j in range(len(shape))]
        if self.split:
            shape = [shape[0] * shape[1], *shape[2:]]
        return tuple(reversed(shape)) if self.transpose else tuple(shape)

    def read(self, tensor, index: tuple[slice, ...]) -> np.ndarray:
        """This part's block at `index` (concrete slices of the leaf part), reading only it."""
        pre = index
        if self.perm:
            pre = tuple(index[self.perm.index(j)] for j in range(len(index)))
        if self.split:
            heads, within, rest = pre[0], pre[1], pre[2:]
            pre = (slice(heads.start * self.split, heads.stop * self.split), *rest)
        block = tensor[pre[::-1] if self.transpose else pre]
        if self.transpose:
            block = block.T
        if self.split:
            block = block.reshape(heads.stop - heads.start, self.split, *block.shape[1:])
            block = block[:, within]
        if self.perm:
            block = block.transpose(self.perm)
        return block

    def to_hf(self, part: np.ndarray) -> np.ndarray:
        """The inverse of `read` over the whole part: the Hugging Face tensor."""
        if self.perm:
            part = part.transpose(np.argsort(self.perm))
        if self.split:
            part = part.reshape(-1, *part.shape[2:])
        return np.ascontiguousarray(part.T if self.transpose else part)


def sources(config) -> dict[str, Source]:
    """Every gemma leaf (as "a/b/c") and the Hugging Face tensors it is made of."""
    h = config.head_dim
    out = {
        "embedder/input_embedding": Source(("model.embed_tokens.weight",)),
        "final_norm/scale": Source(("model.norm.weight",)),
    }
    for i in range(config.num_layers):
        g, p = f"layer_{i}/", f"model.layers.{i}."
        attn = p + "self_attn."
        heads = {"split": h, "perm": (0, 2, 1)}  # [N*H, D] -> [N, D, H]
        if config.num_kv_heads == config.num_heads:
            out[g + "attn/qkv_einsum/w"] = Source(
                tuple(attn + f"{x}_proj.weight" for x in "qkv"), stacked=True, **heads
            )
        else:
            out[g + "attn/q_einsum/w"] = Source((attn + "q_proj.weight",), **heads)
            out[g + "attn/kv_einsum/w"] = Source(
                (attn + "k_proj.weight", attn + "v_proj.weight"), stacked=True, **heads
            )
        out[g + "attn/attn_vec_einsum/w"] = Source(
            (attn + "o_proj.weight",), transpose=True, split=h
        )  # [D, N*H] -> [N, H, D]
        if config.use_qk_norm:
            out[g + "attn/_query_norm/scale"] = Source((attn + "q_norm.weight",))
            out[g + "attn/_key_norm/scale"] = Source((attn + "k_norm.weight",))
        out[g + "mlp/gating_einsum"] = Source(
            (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            stacked=True,
            transpose=not config.transpose_gating_einsum,
        )
        out[g + "mlp/linear"] = Source((p + "mlp.down_proj.weight",), transpose=True)
        out[g + "pre_attention_norm/scale"] = Source((p + "input_layernorm.weight",))
        out[g + "post_attention_norm/scale"] = Source((p + "post_attention_layernorm.weight",))
        out[g + "pre_ffw_norm/scale"] = Source((p + "pre_feedforward_layernorm.weight",))
        out[g + "post_ffw_norm/scale"] = Source((p + "post_feedforward_layernorm.weight",))
    return out


def _leaf_path(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


# -------------------------------------------------------------------------------------------
# Reading


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """An opened checkpoint directory: its config and which file holds each tensor."""

    directory: Path
    config: dict[str, Any]
    weight_map: dict[str, str]  # tensor name -> safetensors file name


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The checkpoint at `path`, with every shard the index names present and readable."""
    from safetensors import safe_open

    directory = Path(path)
    if not is_hf_checkpoint(directory):
        raise HFCheckpointError(
            f"no Hugging Face checkpoint at {directory}: it has no {CONFIG_FILE}"
        )
    hf = read_config(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = dict(_small_json(index)["weight_map"])
        except HFCheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HFCheckpointError(f"{index} is not a safetensors index: {e!r}") from None
    elif (directory / SINGLE_FILE).is_file():
        weight_map = None
    else:
        raise HFCheckpointError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    if weight_map is not None:
        odd = [
            f
            for f in weight_map.values()
            if not isinstance(f, str) or Path(f).name != f or not f.endswith(".safetensors")
        ]
        if odd:
            raise HFCheckpointError(
                f"{index} names {str(odd[0])[:80]!r}: shards must be .safetensors files beside it"
            )
    files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise HFCheckpointError(f"{directory}: {INDEX_FILE} names {', '.join(missing)}, missing")
    found: dict[str, str] = {}
    for name in files:
        try:
            with safe_open(directory / name, framework="numpy") as f:
                keys = list(f.keys())
        except Exception as e:  # safetensors raises SafetensorError, OSError, ...
            raise HFCheckpointError(
                f"{directory / name} is not a readable safetensors file (truncated?): {e}"
            ) from None
        found.update(dict.fromkeys(keys, name))
    if weight_map is not None:
        wrong = sorted(k for k, f in weight_map.items() if found.get(k) != f)
        if wrong:
            raise HFCheckpointError(
                f"{directory}: {INDEX_FILE} places {wrong[0]} in {weight_map[wrong[0]]}, "
                f"which does not hold it ({len(wrong)} such)"
            )
    return Checkpoint(directory, hf, found)


def _check_tensors(ckpt: Checkpoint, table: dict[str, Source], abstract: dict[str, Any]) -> None:
    from safetensors import safe_open

    used: set[str] = set()
    problems: list[str] = []
    for leaf, src in table.items():
        part_shape = abstract[leaf].shape[1:] if src.stacked else abstract[leaf].shape
        want = src.hf_shape(tuple(part_shape))
        for name in src.names:
            used.add(name)
            if name not in ckpt.weight_map:
                problems.append(f"lacks {name}")
                continue
            with safe_open(ckpt.directory / ckpt.weight_map[name], framework="numpy") as f:
                tensor = f.get_slice(name)
                shape, dtype = tuple(tensor.get_shape()), tensor.get_dtype()
            if shape != want:
                problems.append(f"{name} is {list(shape)}, the model needs {list(want)}")
            elif dtype not in FLOAT_DTYPES:
                problems.append(f"{name} is {dtype}; readable: {', '.join(FLOAT_DTYPES)}")
    unused = sorted(set(ckpt.weight_map) - used)
    if "lm_head.weight" in unused:
        problems.append(
            "holds lm_head.weight: an untied output head, gemma ties it to the embedding"
        )
    elif unused:
        problems.append(f"holds tensors this loader does not map: {', '.join(unused[:5])}")
    if problems:
        raise HFCheckpointError(
            f"{ckpt.directory}: {len(problems)} problem(s):\n  " + "\n  ".join(problems[:20])
        )


def read_params(ckpt: Checkpoint, module: gm.nn.Transformer, mesh: Mesh):
    """gemma's parameter tree, every device's block read from the safetensors by itself."""
    from safetensors import safe_open

    abstract_tree = model_lib.abstract_params(module)
    plan = model_lib.param_plan(abstract_tree, module.config, mesh)
    abstract = {_leaf_path(p): x for p, x in jax.tree_util.tree_leaves_with_path(abstract_tree)}
    table = sources(module.config)
    if set(table) != set(abstract):
        raise HFCheckpointError(
            f"the mapping does not cover the model: {sorted(set(table) ^ set(abstract))[:3]}"
        )
    _check_tensors(ckpt, table, abstract)
    handles: dict[str, Any] = {}
    opened = contextlib.ExitStack()

    def tensor(name: str):
        file = ckpt.weight_map[name]
        if file not in handles:
            handles[file] = opened.enter_context(
                safe_open(ckpt.directory / file, framework="numpy")
            )
        return handles[file].get_slice(name)

    def build(path, leaf, leaf_sharding):
        src, shape = table[_leaf_path(path)], leaf.shape
        blocks: dict[tuple, np.ndarray] = {}  # replicated shards share one read

        def block(index: tuple[slice, ...]) -> np.ndarray:
            index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape, strict=True))
            key = tuple((s.start, s.stop) for s in index)
            if key not in blocks:
                if src.stacked:
                    parts = range(*index[0].indices(len(src.names)))
                    got = np.stack([src.read(tensor(src.names[i]), index[1:]) for i in parts])
                else:
                    got = src.read(tensor(src.names[0]), index)
                blocks[key] = np.asarray(got).astype(leaf.dtype, copy=False)
            return blocks[key]

        return jax.make_array_from_callback(shape, leaf_sharding, block)

    with opened:  # every file opened (memory-mapped) once, closed when all leaves are read
        leaves = [
            build(path, leaf, s)
            for (path, leaf), s in progress.bar(
                list(
                    zip(
                        jax.tree_util.tree_leaves_with_path(abstract_tree),
                        jax.tree.leaves(plan.shardings),
                        strict=True,
                    )
                ),
                desc="read safetensors",
                unit="tensor",
            )
        ]
    return jax.tree.unflatten(jax.tree.structure(abstract_tree), leaves), plan


@dataclasses.dataclass(frozen=True)
class Loaded:
    params: Any
    plan: model_lib.ParamPlan
    fingerprint: str  # model.weights_fingerprint: the same for the same numbers from any format


def load(
    path: str | os.PathLike, module: gm.nn.Transformer, mesh: Mesh, *, model_name: str
) -> Loaded:
    """The checkpoint's parameters on `mesh`, checked against the model before any is read."""
    ckpt = open_checkpoint(path)
    check_config(ckpt.config, module.config, model_name=model_name, path=ckpt.directory)
    started = time.perf_counter()
    params, plan = read_params(ckpt, module, mesh)
    fingerprint = model_lib.weights_fingerprint(module.config, params)
    logging.info("read %s in %.1f s", path, time.perf_counter() - started)
    return Loaded(params, plan, fingerprint)


# -------------------------------------------------------------------------------------------
# Writing


def write(
    params: Any,
    config,
    directory: str | os.PathLike,
    *,
    tokenizer_proto: bytes | None = None,
    shards: int = 1,
) -> Path:
    """`params` as a Hugging Face Gemma 3 text checkpoint (bf16 as gemma holds it), all or nothing.

    With `shards > 1` the tensors are split over `model-0000i-of-0000n.safetensors` by size, with
    `model.safetensors.index.json`, as the Hugging Face Hub lays out larger models.
    """
    from safetensors.numpy import save_file

    leaves = {
        _leaf_path(p): np.asarray(multihost.host_value(x))
        for p, x in jax.tree_util.tree_leaves_with_path(params)
    }
    tensors: dict[str, np.ndarray] = {}
    for leaf, src in sources(config).items():
        value = leaves[leaf]
        parts = list(value) if src.stacked else [value]
        for name, part in zip(src.names, parts, strict=True):
            tensors[name] = src.to_hf(part)
    dtype = str(next(iter(tensors.values())).dtype)
    torch_dtype = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}[dtype]
    groups = _split_by_size(list(tensors), lambda n: tensors[n].nbytes, shards)
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise HFCheckpointError(f"{directory} exists and is not empty: not overwritten")
    if directory.exists():
        directory.rmdir()
    with atomic.staged_directory(directory, accept_existing=lambda _: False) as staging:
        (staging / CONFIG_FILE).write_text(
            json.dumps(hf_config(config, torch_dtype=torch_dtype), indent=2)
        )
        if shards == 1:
            save_file(tensors, staging / SINGLE_FILE, metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, names in enumerate(groups, 1):
                file = f"model-{i:05d}-of-{shards:05d}.safetensors"
                save_file({n: tensors[n] for n in names}, staging / file, metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(names, file))
            total = sum(t.nbytes for t in tensors.values())
            index = {
                "metadata": {"total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2))
        if tokenizer_proto is not None:
            (staging / TOKENIZER_FILE).write_bytes(tokenizer_proto)
    return directory


def _split_by_size(names: list[str], size: Callable[[str], int], shards: int) -> list[list[str]]:
    """Consecutive groups of about equal bytes (the Hub's shards keep the tensor order)."""
    if shards < 1:
        raise HFCheckpointError(f"shards must be at least 1, not {shards}")
    total = sum(size(n) for n in names)
    per = math.ceil(total / shards)
    groups: list[list[str]] = [[] for _ in range(shards)]
    done = 0
    for name in names:
        groups[min(done // per, shards - 1) if per else 0].append(name)
        done += size(name)
    if any(not g for g in groups):
        raise HFCheckpointError(f"{len(names)} tensors cannot fill {shards} shards")
    return groups
