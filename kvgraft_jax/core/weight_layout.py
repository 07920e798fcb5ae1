"""The engine's copy of the layer weights, laid out so that XLA:CPU reads them contiguously.

A decode step multiplies one token's activations by every weight matrix: a matrix-vector product
that XLA:CPU emits as a loop over output elements, each a sum along the contracted axis. gemma
stores `q_einsum` as `[N, D, H]`, `kv_einsum` as `[2, K, D, H]`, `attn_vec_einsum` as
`[N, H, D]` and `linear` as `[H, D]`, so for all four that sum walks memory with a stride. Measured
on the 270M's `linear` (18 matrices of 2048 x 640, 2 cores): 3.1 GB/s as stored, 36 GB/s with the
contracted axes last. The head (`embedder.decode`, `x @ table.T`) and the gating einsum already
contract their last axis.

So on CPU the engine holds, for each of those weights, a transposed copy with the contracted
axes last (`CONTRACT_LAST`), and its forward pass runs gemma's einsums on it through flax's method
interception: gemma's parameter tree, checkpoints and fingerprint stay gemma's own. The copy is
made once per parameter tree and shared by every engine on it; it costs the layer weights' bytes
once more (200 MB for the 270M: the embedding, most of its bytes, is shared, not copied). XLA:CPU sums each product in the
same order whichever axis is contiguous (no fast-math reassociation; Eigen packs GEMM operands
before its kernels), so the copy changes no bit: logits and cache are bit-identical to gemma's
layout (`tests/test_engine.py`, on the tiny models every run and on the 270M when measured), and
the layout is not a term of the exactness contract. Accelerators choose their own layouts: there
the engine uses gemma's (`GEMMA`), with no copy.

A chunk of two or more tokens is a matrix-matrix product, which XLA:CPU runs as a float32 GEMM,
converting each bf16 weight into a fresh float32 array on every call (most of a 9-token query
chunk's time). So the engine's chunks read a float32 copy held once (`GEMM_F32`'s layer weights,
`for_chunks`), each weight in the shape XLA converts it into, and activations widened by their
bits: the same products on the same values in the same order, and bit-identical (tests on the
tiny models every run; the 270M measured: chunks of 1 to 512 tokens, every K/V and logit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import os
import threading
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from gemma.gm.nn import _config as gemma_config
from gemma.gm.nn import _layers, _modules
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvgraft_jax.core import sharding

GEMMA = "gemma"
CONTRACT_LAST = "contract-last"  # matrix-vector loops read each row contiguously
# A batch's products are matrix-matrix: XLA:CPU runs them as float32 GEMMs, and given bf16
# weights it converts every matrix into a fresh float32 array on every call (the 270M's batched
# decode step: 440 ms at 4 rows, against 42 ms for one row). This layout holds a float32 copy of
# the layer weights once, each in the shape its GEMM reads (`gemm_operand`): a weight in any other
# shape is copied into that one on every call (contracted-first `kv_einsum` and `attn_vec_einsum`
# copies cost the 270M's 8-row step 49 of 217 ms). The head reads the embedding table's bf16 bit
# patterns (a uint16 copy, held once), widened a tile at a time (`tiled_head`), and attention
# takes float32 products (`attention.attend`). It may change bits (other GEMM paths than bf16
# operands'), so it is for batch engines only, whose reference replays the same batch program,
# and the batch schedule records it. The name versions that program: v2 replaced a float32 head
# copy by the tiled head and made attention's products float32 (the 8-row step 170 -> 100 ms).
GEMM_F32 = "gemm-f32-v2"
# The batch program for CPUs with bf16 dot instructions (AVX-512 BF16, AMX): the layer weights
# stay bf16, in `GEMM_F32`'s shapes, and each product takes bf16 operands with float32 results
# (`preferred_element_type`), rounded to bf16 as gemma does; the head and attention are
# `GEMM_F32`'s. The products are exact either way (8-bit significands), but another GEMM sums them,
# so the bits may differ from `GEMM_F32`'s: another program, named and recorded. On the AVX-512
# BF16 host that measured it, the 270M's 8-row decode step 58 -> 49 ms, and half the weight copy
# (200 MB instead of 400); where the CPU has no such instructions XLA:CPU converts the operands on
# every call instead, so there the batch program stays `GEMM_F32` (`batch_program`).
GEMM_BF16 = "gemm-bf16-v1"
BATCH_PROGRAMS = (GEMM_F32, GEMM_BF16)
LAYOUTS = (GEMMA, CONTRACT_LAST, *BATCH_PROGRAMS)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProgramWeights:
    """What the engine's compiled programs read: gemma's tree with the einsum weights in the
    layout's copy (gemma's own leaves where the layout needs none), and (`GEMM_F32`) the
    embedding table's bits for `tiled_head`, the bf16 table staying for the token lookup."""

    params: Any
    head_bits: jax.Array | None = None


class WeightLayoutError(ValueError):
    """gemma ran an einsum this module does not know: its weights' layout cannot be trusted."""


@dataclasses.dataclass(frozen=True)
class Transposition:
    """One weight's contract-last copy: `perm` makes it from gemma's leaf, `equation` uses it."""

    gemma_equation: str
    perm: tuple[int, ...]
    equation: str


def contract_last(equation: str) -> Transposition:
    """The permutation that puts a weight's contracted axes last, in the order the activations
    hold them, and the einsum equation that reads the permuted weight."""
    lhs, rhs, out = _operands(equation)
    return _permutation(equation, (*_kept(rhs, out), *_contracted(lhs, rhs, out)))


def gemm_operand(equation: str, *, contracted: str | None = None) -> Transposition:
    """The weight laid out as XLA:CPU's GEMM reads it, so that no call copies it: where the output
    names a weight axis first (`kv_einsum`'s `CBSKH`), the weight is the GEMM's left operand, its
    kept axes first ([M, K]); else its right operand, contracted axes first ([K, N]).
    `contracted` orders the contracted axes as the activation is laid out in memory, where that
    is not the order of its labels."""
    lhs, rhs, out = _operands(equation)
    kept = _kept(rhs, out)
    order = [rhs.index(a) for a in contracted] if contracted else _contracted(lhs, rhs, out)
    left = out[0] in rhs
    return _permutation(equation, (*kept, *order) if left else (*order, *kept))


def _operands(equation: str) -> tuple[str, str, str]:
    inputs, out = equation.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    if "..." in rhs:
        raise WeightLayoutError(f"einsum {equation!r}: the weight has an ellipsis")
    return lhs, rhs, out


def _kept(rhs: str, out: str) -> list[int]:
    return [i for i, label in enumerate(rhs) if label in out]


def _contracted(lhs: str, rhs: str, out: str) -> list[int]:
    return sorted(
        (i for i, label in enumerate(rhs) if label not in out), key=lambda i: lhs.index(rhs[i])
    )


def _permutation(equation: str, perm: tuple[int, ...]) -> Transposition:
    lhs, rhs, out = _operands(equation)
    new_rhs = "".join(rhs[i] for i in perm)
    return Transposition(equation, perm, f"{lhs},{new_rhs}->{out}")


# Where a weight's GEMM reads another shape than the rule gives: `attention.attend`'s output reaches
# `attn_vec_einsum` laid out head_dim before heads (XLA:CPU's choice for the weighted-sum GEMM),
# and `linear` is read contract-last. Both are what XLA:CPU converts gemma's bf16 weights into for
# a multi-token chunk, so these f32 products sum in the bf16 program's order: on the 270M a
# 9-token chunk gives bit-identical K/V in all 18 layers (contract-first `linear` does not).
_GEMM_CONTRACTED = {"attn_vec_einsum": "HN"}
_GEMM_CONTRACT_LAST = ("linear",)


def gemma_equations(config: gemma_config.TransformerConfig) -> Mapping[str, str]:
    """The einsum gemma runs on each weight (by its parameter name), for this config."""
    return {
        "q_einsum": "BTD,NDH->BTNH",
        "kv_einsum": "BSD,CKDH->CBSKH",
        "qkv_einsum": "BTD,SNDH->SBTNH",
        "attn_vec_einsum": "BTNH,NHD->BTD",
        "gating_einsum": (
            "...F,NHF->...NH" if config.transpose_gating_einsum else "...F,NFH->...NH"
        ),
        "linear": "...H,HF->...F",
    }


def transpositions(config: gemma_config.TransformerConfig, layout: str) -> dict[str, Transposition]:
    """Every einsum weight's permutation into `layout` (the identity where gemma's layout is it
    already; `GEMMA`: none)."""
    if layout not in LAYOUTS:
        raise WeightLayoutError(f"unknown weight layout {layout!r}")
    if layout == GEMMA:
        return {}
    if layout in BATCH_PROGRAMS:
        return {
            name: contract_last(equation)
            if name in _GEMM_CONTRACT_LAST
            else gemm_operand(equation, contracted=_GEMM_CONTRACTED.get(name))
            for name, equation in gemma_equations(config).items()
        }
    return {name: contract_last(equation) for name, equation in gemma_equations(config).items()}


def for_mesh(mesh: Mesh, *, rows: int = 1) -> str:
    """CPU meshes read the contract-last copy, or with `rows` > 1 (a ragged batch's
    matrix-matrix products) the `batch_program`; accelerators lay out weights themselves."""
    platforms = {d.platform for d in mesh.devices.flat}
    if platforms != {"cpu"}:
        return GEMMA
    if rows > 1:
        return batch_program(mesh, rows)
    # With the weights split over `model`, the contract-last copy changed bits against gemma's
    # layout on a 2-core AVX2 host (tiny models, meshes model:8 and data:2,model:4;
    # tests/test_engine.py), so there one row reads gemma's layout: exactness before speed.
    return CONTRACT_LAST if mesh.shape.get(sharding.MODEL, 1) == 1 else GEMMA


def batch_program(mesh: Mesh, rows: int) -> str:
    """`GEMM_BF16` where this CPU has bf16 dot instructions and each device multiplies at least
    two rows (XLA:CPU runs a one-row bf16 product as a slow loop: 60 matrices of 640 x 2,048 took
    92 ms against 10 in float32), else `GEMM_F32`."""
    data = mesh.shape.get(sharding.DATA, 1)
    per_device = rows // data if rows % data == 0 else rows
    return GEMM_BF16 if per_device >= 2 and cpu_has_bf16_dot() else GEMM_F32


@functools.lru_cache(maxsize=1)
def cpu_has_bf16_dot() -> bool:
    """Whether this CPU multiplies bf16 operands in hardware (AVX-512 BF16 or AMX BF16, from Linux's
    /proc/cpuinfo; another OS, or a CPU without them: no, the measured float32 program stays).
    `KVGRAFT_BF16_DOT=0` or `1` overrides the answer, e.g. to run the other program's tests."""
    forced = os.environ.get("KVGRAFT_BF16_DOT")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


# The float32 chunk copy is held where it costs at most this share of the machine's memory (the
# 270M's: 400 MB; a 4B model's would be 13 GB, left to convert per call instead).
CHUNK_COPY_MEMORY_SHARE = 0.25


def for_chunks(layout: str, params: Any, config: gemma_config.TransformerConfig) -> str:
    """What a single-row engine's chunks of two or more tokens read: on CPU (`CONTRACT_LAST`
    for one token) the float32 copy (`GEMM_F32`'s layer weights), whose products are the ones
    XLA:CPU runs on bf16 weights after converting them on every call, so the bits are the same
    (`tests/test_engine.py`; the 270M's 9-token query chunk: 204 -> 56 ms). Where that copy
    would take more than `CHUNK_COPY_MEMORY_SHARE` of memory, the one-token layout."""
    if layout != CONTRACT_LAST:
        return layout
    weights = sum(
        x.size
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if _weight_name(_path_names(path)) in gemma_equations(config)
    )
    return GEMM_F32 if 4 * weights <= CHUNK_COPY_MEMORY_SHARE * _memory_bytes() else layout


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host: assume a laptop's 8 GiB
        return 8 << 30


def _copy_dtype(layout: str):
    """The dtype of `layout`'s copy of a weight (None: the weight's own; `GEMM_BF16` rounds no
    weight to bf16, it reads bf16 weights as they are)."""
    return jnp.float32 if layout == GEMM_F32 else None


def _weight_name(path: tuple[str, ...]) -> str:
    # `layer_3/attn/q_einsum/w` -> q_einsum; `layer_3/mlp/linear` -> linear
    return path[-2] if path[-1] == "w" else path[-1]


def _path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _permuted(s: NamedSharding, perm: tuple[int, ...], ndim: int) -> NamedSharding:
    spec = tuple(s.spec) + (None,) * (ndim - len(s.spec))
    return NamedSharding(s.mesh, PartitionSpec(*(spec[i] for i in perm)))


def _relayout(params: Any, config: gemma_config.TransformerConfig, layout: str) -> ProgramWeights:
    """The tree with each einsum weight replaced by its copy in `layout` (one compiled program
    for all of them, each written straight into its permuted sharding); other leaves, and
    weights already in that layout, are shared."""
    table = transpositions(config, layout)
    dtype = _copy_dtype(layout)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    moved = [
        (i, table[name].perm)
        for i, (path, leaf) in enumerate(leaves)
        if (name := _weight_name(_path_names(path))) in table
        and (dtype not in (None, leaf.dtype) or table[name].perm != tuple(range(leaf.ndim)))
    ]
    if not moved:
        return ProgramWeights(params)
    sources = [leaves[i][1] for i, _ in moved]
    targets = [
        _permuted(x.sharding, perm, x.ndim) for x, (_, perm) in zip(sources, moved, strict=True)
    ]
    copies = _transposer(tuple(perm for _, perm in moved), tuple(targets), dtype)(sources)
    out = [leaf for _, leaf in leaves]
    for (i, _), copy in zip(moved, copies, strict=True):
        out[i] = copy
    return ProgramWeights(jax.tree_util.tree_unflatten(treedef, out))


@functools.lru_cache(maxsize=16)
def _bits_of(target: NamedSharding):
    """The compiled copy of a bf16 table's bit patterns (uint16), in the table's sharding."""
    return jax.jit(lambda w: jax.lax.bitcast_convert_type(w, jnp.uint16), out_shardings=target)


@functools.lru_cache(maxsize=16)
def _transposer(perms: tuple[tuple[int, ...], ...], targets: tuple[NamedSharding, ...], dtype=None):
    """The compiled transposes (and casts) for one model's weights on one mesh (reused: a test
    session builds many parameter trees of the same shapes)."""
    return jax.jit(
        lambda ws: [
            jnp.transpose(w, perm).astype(dtype or w.dtype)
            for w, perm in zip(ws, perms, strict=True)
        ],
        out_shardings=list(targets),
    )


# One copy per parameter tree and kind (by identity; the tree is kept alive with its copy), so
# that the engines a run builds on the same weights share it: a run holds one model and its
# copies (contract-last, float32, head bits), a test session a few at a time.
_COPIES: list[tuple[Any, str, Any]] = []
_COPIES_LOCK = threading.Lock()
_MAX_COPIES = 4
_HEAD_BITS = "head-bits"


def engine_params(
    params: Any, config: gemma_config.TransformerConfig, layout: str, *, tiled_head: bool = False
) -> ProgramWeights:
    """What the engine's programs read for `layout` (gemma's own tree for `GEMMA`), with
    `tiled_head` (a batch program only) the embedding table's bits for `tiled_head`."""
    if layout not in LAYOUTS:
        raise WeightLayoutError(f"unknown weight layout {layout!r}")
    if tiled_head and layout not in BATCH_PROGRAMS:
        raise WeightLayoutError(f"the tiled head reads float32 products, not layout {layout}")
    if layout == GEMMA:
        return ProgramWeights(params)
    with _COPIES_LOCK:
        weights = _held(params, layout, lambda: _relayout(params, config, layout))
        if not tiled_head:
            return weights
        embedding = params["embedder"]["input_embedding"]
        bits = _held(params, _HEAD_BITS, lambda: _bits_of(embedding.sharding)(embedding))
        return ProgramWeights(weights.params, bits)


def _held(params: Any, kind: str, make) -> Any:
    """The cached copy of `kind` for this parameter tree, made on first use (lock held)."""
    for i, (source, made, copy) in enumerate(_COPIES):
        if source is params and made == kind:
            _COPIES.insert(0, _COPIES.pop(i))
            return copy
    copy = make()
    _COPIES.insert(0, (params, kind, copy))
    del _COPIES[_MAX_COPIES:]
    return copy


_EINSUM_CALL = inspect.signature(_layers.Einsum.__call__)


@dataclasses.dataclass
class Interception:
    """The einsums the interception ran while tracing (the engine checks the count)."""

    einsums: int = 0
    heads: int = 0  # logits computed by `tiled_head`


@contextlib.contextmanager
def einsums(
    config: gemma_config.TransformerConfig, layout: str, *, head_bits: jax.Array | None = None
):
    """Inside this context (while tracing), gemma's `Einsum` modules read the `layout` copy, and
    with `head_bits` (a batch program) the logits are computed from them by
    `tiled_head` (else by gemma's head)."""
    seen = Interception()
    if layout == GEMMA:
        yield seen
        return
    table = transpositions(config, layout)
    if head_bits is not None and layout not in BATCH_PROGRAMS:
        raise WeightLayoutError(f"the tiled head reads float32 products, not layout {layout}")

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if head_bits is not None and type(module) is _modules.Embedder:
            if context.method_name != "decode":
                return next_fun(*args, **kwargs)
            (x,) = args
            seen.heads += 1
            return tiled_head(x, head_bits)
        if type(module) is not _layers.Einsum or context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        # `q_einsum/w` is named by its module, `mlp/gating_einsum` by its weight (a shared scope).
        name = module.name if module.weight_name == "w" else module.weight_name
        t = table.get(name)
        if t is None:
            return next_fun(*args, **kwargs)
        bound = _EINSUM_CALL.bind(module, *args, **kwargs).arguments
        if bound["eqn"] != t.gemma_equation:
            raise WeightLayoutError(
                f"gemma ran {name} as {bound['eqn']!r}; its contract-last copy was "
                f"made for {t.gemma_equation!r} (kvgraft_jax.core.weight_layout)"
            )
        weight = module.get_variable("params", module.weight_name)
        seen.einsums += 1
        x = bound["x"]
        if layout not in BATCH_PROGRAMS:
            return jnp.einsum(t.equation, x, weight)
        if layout == GEMM_BF16 and x.dtype == weight.dtype == jnp.bfloat16:
            products = jnp.einsum(t.equation, x, weight, preferred_element_type=jnp.float32)
            return products.astype(x.dtype)
        return jnp.einsum(t.equation, widened(x), widened(weight)).astype(x.dtype)

    with nn.intercept_methods(intercept):
        yield seen


def widened(x: jax.Array) -> jax.Array:
    """`x` (bf16) as float32, by its bits (the bf16 pattern is the f32's top half): the same
    values as `astype`, but opaque to XLA's excess-precision rewrite, which folds an f32 -> bf16
    -> f32 round trip into its f32 source and so would skip the rounding gemma's bf16 program
    does (its normalized activations are rounded to bf16 before each product)."""
    if x.dtype != jnp.bfloat16:
        return x.astype(jnp.float32)
    return from_bf16_bits(jax.lax.bitcast_convert_type(x, jnp.uint16))


def from_bf16_bits(bits: jax.Array) -> jax.Array:
    """bf16 bit patterns (uint16) as the float32 values they encode (a shift: XLA:CPU's own
    conversions of bf16 run at a sixth of its speed)."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, jnp.float32)


# Rows of the embedding table per tile of `tiled_head`: a float32 tile of the 270M (4,096 x 640,
# 10 MB) measured fastest against 1,024 and 16,384 rows.
HEAD_TILE_ROWS = 4096


def tiled_head(x: jax.Array, table_bits: jax.Array) -> jax.Array:
    """gemma's head (`x @ table.T`) for a batch's rows, from the bf16 table's bit patterns
    (uint16 [vocab, embed]).

    Handed a bf16 table, XLA:CPU's GEMM widens the whole of it into a fresh float32 array first
    (the 270M: 262,144 x 640, about 240 ms), and a float32 copy held for the call costs 671 MB
    read per step (78 ms at 8 rows). So the table is widened a tile at a time, by its bits, each
    tile multiplied while it is in cache: 33 to 49 ms at 8 rows. Bits, not the bf16 table itself:
    XLA:CPU's conversions of bf16 (`astype`, or `bitcast_convert_type` to uint16) run at a sixth
    of that speed, inside the loop or out. A deterministic program (the tile size is fixed, and
    the layout recorded in the batch schedule), not bit-identical to one whole GEMM."""
    vocab, dim = table_bits.shape
    rows = math.gcd(vocab, HEAD_TILE_ROWS)
    tiles = table_bits.reshape(vocab // rows, rows, dim)
    lead = x.shape[:-1]
    flat = widened(x).reshape(-1, dim).T  # [dim, N]
    out = jax.lax.map(lambda tile: jnp.dot(from_bf16_bits(tile), flat), tiles)  # [tiles, rows, N]
    return out.reshape(vocab, -1).T.reshape(*lead, vocab).astype(x.dtype)


def einsums_per_layer(config: gemma_config.TransformerConfig, layout: str) -> int:
    """How many of one layer's einsums the interception runs, on a copy or (already in the
    layout) on gemma's leaf; the engine checks the traced count against it."""
    if layout == GEMMA:
        return 0
    table = transpositions(config, layout)
    attn = ("qkv_einsum",) if config.num_heads == config.num_kv_heads else ("q_einsum", "kv_einsum")
    return sum(name in table for name in (*attn, "attn_vec_einsum", "gating_einsum", "linear"))
