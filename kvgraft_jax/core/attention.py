"""Attention whose bits do not depend on the cache length: fixed blocks, online softmax, fixed order.

gemma's `Attention` scores a query against every slot of the cache and reduces over all of them
at once. On XLA:CPU the order of that reduction follows the cache length, so the same prefix
prefilled into a 433-slot cache and into a 450-slot cache gives different K/V bits (Gemma 3 270M,
max |delta logit| 0.66 after the same query): a deposit and a later graft, whose cache also has
room for the query and the answer, disagree.

Here the cache is cut into blocks of `BLOCK` slots aligned at slot 0, and a loop visits only the
blocks that hold at least one slot some query may see, in ascending order, carrying a running
max, sum and weighted value (the online softmax). Every iteration is the same program on the same
block shape, so a slot's contribution, and the order in which it is added, is a function of the
positions alone: empty slots after the used ones are never read, and the cache length can be
anything (a multiple of `BLOCK`, see `cache_slots`). Unused blocks are skipped, so a short prefix
in a long cache costs what its own length costs.

The math is gemma's (scores from the RoPE'd, scaled query and key, optional soft cap, sliding
window for local layers, softmax, weighted values); scores and the softmax are float32, the
weighted sum takes the weights rounded to bf16. Both products take float32 operands, widened
from the bf16 values by their bits, because XLA:CPU runs a product of bf16 operands in a slow
loop of its own and a float32 one in its GEMM (v2; v1 kept bf16 operands). Results are close to
gemma's own attention, not bit-equal to it; the name and block size are recorded in every
artifact's protocol (`ATTENTION`) and verify compares them.

`blockwise()` is a context manager that routes gemma's `Attention.__call__` here through
flax's method interception: the parameter tree and checkpoints stay gemma's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import jax
import jax.numpy as jnp
from flax import linen as nn
from gemma.gm.math import _positional_embeddings
from gemma.gm.nn import _modules

from kvgraft_jax.core import kvstate, weight_layout

BLOCK = 256
# Recorded in every artifact's protocol; a change to the loop, the block size or the dtypes above is
# a change of the computation and must change this name. v2: float32 products (v1's bf16 products
# gave other bits, so a v1 artifact is refused by name, not grafted into another computation).
ATTENTION = f"kvgraft-blockwise/v2/block={BLOCK}"
_MASKED = _modules.K_MASK  # gemma's masked score; exp(_MASKED - finite) is exactly 0 in float32


def cache_slots(length: int) -> int:
    """The cache length that holds `length` positions: whole blocks (alignment is what makes a
    slot's block, and so its bits, independent of the cache it was computed in)."""
    return -(-max(length, 1) // BLOCK) * BLOCK


def attend(
    query: jax.Array,  # [batch, q_len, heads, head_dim], RoPE'd and scaled
    keys: jax.Array,  # [batch, cache, kv_heads, head_dim], as the cache holds them (bits)
    values: jax.Array,  # [batch, cache, kv_heads, head_dim], as the cache holds them (bits)
    mask: jax.Array,  # bool[batch, q_len, cache]: True where the query may see the slot
    *,
    soft_cap: float | None = None,
    per_row: bool = False,
) -> jax.Array:  # [batch, q_len, heads, head_dim] in the query's dtype
    """Masked softmax attention over the blocks that hold a visible slot, in ascending order.

    Each block is sliced from the held cache and only then widened to float32 by its bits
    (`_float32`): a conversion of the whole cache would cost what the block loop saves.
    With `per_row` (a ragged batch, rows at different positions) iteration i reads each row's
    own i-th visible block, so a row's sliding window costs its own blocks, not the union of
    every row's; a row with fewer visible blocks sees the rest fully masked.

    Both products take float32 operands widened by their bits, the softmax weights rounded to
    bf16 first, through bits, so XLA's excess-precision pass cannot skip the rounding. Measured
    against v1's bf16 products on the 270M: a global layer's attention in an 8-row decode step
    5.4 -> 2.4 ms, a local one's 3.7 -> 1.5 (with `_per_kv_head`); one row's decode step at 8,192
    tokens 29 -> 23 ms, a 512-token chunk at 7,680 850 -> 590 ms.
    """
    batch, q_len, heads, head_dim = query.shape
    cache, kv_heads = keys.shape[1], keys.shape[2]
    if cache % BLOCK:
        raise ValueError(f"cache length {cache} is not a multiple of the block size {BLOCK}")
    groups = heads // kv_heads
    q = query.reshape(batch, q_len, kv_heads, groups, head_dim)
    q = _float32(q)
    num_blocks = cache // BLOCK
    # Which blocks a row may see: a function of the positions only, never of the cache length.
    by_row = jnp.any(mask.reshape(batch, q_len, num_blocks, BLOCK), axis=(1, 3))
    if per_row:
        first = jnp.argmax(by_row, axis=1).astype(jnp.int32)  # [batch]
        stop = (num_blocks - jnp.argmax(by_row[:, ::-1], axis=1)).astype(jnp.int32)
        loop_start, loop_stop = jnp.int32(0), jnp.max(stop - first)
    else:
        visible = jnp.any(by_row, axis=0)
        loop_start = jnp.argmax(visible).astype(jnp.int32)
        loop_stop = (num_blocks - jnp.argmax(visible[::-1])).astype(jnp.int32)

    def row_slice(array, starts, axis):
        take = lambda a, s: jax.lax.dynamic_slice_in_dim(a, s, BLOCK, axis=axis - 1)  # noqa: E731
        return jax.vmap(take)(array, starts)

    def block(i):
        """Block i (ascending) of every row: its keys, values and which slots each query sees."""
        if not per_row:
            start = i * BLOCK
            k = jax.lax.dynamic_slice_in_dim(keys, start, BLOCK, axis=1)
            v = jax.lax.dynamic_slice_in_dim(values, start, BLOCK, axis=1)
            return k, v, jax.lax.dynamic_slice_in_dim(mask, start, BLOCK, axis=2)
        index = first + i
        starts = jnp.minimum(index, num_blocks - 1) * BLOCK
        seen = row_slice(mask, starts, 2) & (index < stop)[:, None, None]
        return row_slice(keys, starts, 1), row_slice(values, starts, 1), seen

    def step(i, carry):
        run_max, run_sum, acc = carry
        k, v, seen = block(i)
        k, v = _float32(k), _float32(v)
        seen = seen[:, :, None, None, :]
        scores = _per_kv_head(q, k, contract=3)
        if soft_cap is not None:
            scores = jnp.tanh(scores / soft_cap) * soft_cap
        scores = jnp.where(seen, scores, _MASKED)
        new_max = jnp.maximum(run_max, scores.max(axis=-1))
        rescale = jnp.exp(run_max - new_max)
        weights = jnp.where(seen, jnp.exp(scores - new_max[..., None]), 0.0)
        run_sum = run_sum * rescale + weights.sum(axis=-1)
        probabilities = _float32(weights.astype(kvstate.value_dtype(values.dtype)))
        weighted = _per_kv_head(probabilities, v, contract=2)
        acc = acc * rescale[..., None] + weighted
        return new_max, run_sum, acc

    stats = (batch, q_len, kv_heads, groups)
    init = (
        jnp.full(stats, _MASKED, jnp.float32),
        jnp.zeros(stats, jnp.float32),
        jnp.zeros((*stats, head_dim), jnp.float32),
    )
    _, total, acc = jax.lax.fori_loop(loop_start, loop_stop, step, init)
    out = acc / total[..., None]
    return out.reshape(batch, q_len, heads, head_dim).astype(query.dtype)


def _per_kv_head(lhs: jax.Array, cache: jax.Array, *, contract: int) -> jax.Array:
    """`lhs` [B, T, K, G, X] times a block of the cache [B, S, K, H] as one GEMM per row and KV
    head, that head's queries as its rows: [B, T, K, G, S] (scores, `contract=3`: over H) or
    [B, T, K, G, H] (weighted values, `contract=2`: over S). The einsum's own form made XLA:CPU
    copy every block into another layout (the 270M's 8-row step: 16 ms)."""
    b, t, kv_heads, g, x = lhs.shape
    rows = lhs.transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, t * g, x)
    out = jax.lax.dot_general(
        rows, cache.transpose(0, 2, 1, 3), (((3,), (contract,)), ((0, 1), (0, 1)))
    )
    return out.reshape(b, kv_heads, t, g, -1).transpose(0, 2, 1, 3, 4)


def _float32(x: jax.Array) -> jax.Array:
    """bf16 values, or a cache's held bf16 bits, as float32, by their bits."""
    if kvstate.value_dtype(x.dtype) == jnp.bfloat16 and x.dtype == jnp.uint16:
        return weight_layout.from_bf16_bits(x)
    return weight_layout.widened(x)


def _write_slots(cache: jax.Array, update: jax.Array, slot: jax.Array, *, per_row: bool):
    """Writes `update` ([batch, length, ...]) into `cache` at `slot` in place: one slot for every
    row (gemma's `end_index[0]`), or each row at its own (`per_row`, a ragged batch)."""
    if not per_row:
        return jax.lax.dynamic_update_slice(cache, update, (0, slot[0]) + (0,) * (cache.ndim - 2))
    write = jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u, (s,) + (0,) * (c.ndim - 1)))
    return write(cache, update, slot)


def _attention_call(
    module: _modules.Attention,
    x,
    segment_pos,
    cache,
    attn_mask,
    *,
    per_row: bool = False,
):
    """gemma's `Attention.__call__` (projections, QK norm, RoPE, cache write) with `attend`."""
    if module.use_qkv_einsum:
        query, key, value = module.qkv_einsum("BTD,SNDH->SBTNH", x)
    else:
        query = module.q_einsum("BTD,NDH->BTNH", x)
        key, value = module.kv_einsum("BSD,CKDH->CBSKH", x)
    if module.use_qk_norm:
        query = module._query_norm(query)
        key = module._key_norm(key)
    rope = dict(base_frequency=module.rope_base_frequency, scale_factor=module.rope_scale_factor)
    query = _positional_embeddings.apply_rope(query, segment_pos, **rope)
    query = query * module.query_pre_attn_scalar
    key = _positional_embeddings.apply_rope(key, segment_pos, **rope)
    if cache is None:
        raise ValueError("kvgraft_jax runs gemma with a KV cache only")
    cache_size = cache["v"].shape[1]
    slot = cache["end_index"] % cache_size
    # The cache holds bits (`kvstate`): written in place, one token's slots.
    held = cache["k"].dtype
    value = _write_slots(cache["v"], kvstate.to_storage(value, held), slot, per_row=per_row)
    key = _write_slots(cache["k"], kvstate.to_storage(key, held), slot, per_row=per_row)
    positions = _write_slots(cache["positions"], segment_pos, slot, per_row=per_row)
    mask = attn_mask
    if module.attn_type == _modules.AttentionType.LOCAL_SLIDING:
        mask = mask & _modules.create_sliding_mask(
            segment_pos,
            cache_positions=positions,
            sliding_window_size=module.sliding_window_size,
        )
    encoded = attend(
        query,
        key,
        value,
        mask,
        soft_cap=module.attn_logits_soft_cap,
        per_row=per_row,
    )
    new_cache = {
        "v": value,
        "k": key,
        "end_index": cache["end_index"] + x.shape[1],
        "positions": positions,
    }
    return new_cache, module.attn_vec_einsum("BTNH,NHD->BTD", encoded)


_CALL = inspect.signature(_modules.Attention.__call__)


@dataclasses.dataclass
class Interception:
    """How many gemma attention layers ran `attend` while tracing: the engine checks it against the
    model's layer count, so a gemma that renamed its attention cannot silently bypass this."""

    layers: int = 0


@contextlib.contextmanager
def blockwise(*, per_row: bool = False):
    """Inside this context (while tracing), gemma's attention layers run `attend`; with `per_row`
    each row writes its K/V at its own `end_index` (a ragged batch), not all at row 0's."""
    seen = Interception()

    def intercept(next_fun, args, kwargs, context):
        if type(context.module) is _modules.Attention and context.method_name == "__call__":
            bound = _CALL.bind(context.module, *args, **kwargs).arguments
            seen.layers += 1
            return _attention_call(
                bound["self"],
                bound["x"],
                bound["segment_pos"],
                bound["cache"],
                bound["attn_mask"],
                per_row=per_row,
            )
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(intercept):
        yield seen
