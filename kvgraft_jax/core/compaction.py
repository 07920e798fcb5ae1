"""Sliding-window compaction of a KV state: what an artifact stores of its local layers, and back.

Gemma 3's local (sliding-window) layers never read a cached position more than `window` - 1 behind
the newest query token, so an artifact may drop them (`compact`) and a restore zero-fills the
dropped slots (`expand`), which the mask excludes: the grafted computation is bit-identical.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kvgraft_jax.core import kvstate


@dataclasses.dataclass(frozen=True)
class Compaction:
    """Sliding-window compaction: local layers store only the K/V no future token can skip.

    A query token at position q attends, in a local layer, to cached positions p > q - window, so
    after an artifact that ends at position E only the last `window` - 1 positions are ever read.
    Local layers keep their K/V from slot `kept_from` (relative to this artifact) on; positions
    arrays and global layers are kept whole. Restore zero-fills the dropped slots, which the
    sliding-window mask excludes: the grafted computation is bit-identical (tests prove it).
    """

    window: int
    local_layers: list[int]
    kept_from: int  # first stored slot of a local layer's k and v

    @classmethod
    def for_state(cls, length: int, *, window: int, local_layers: Sequence[int]) -> Compaction:
        return cls(
            window=window, local_layers=list(local_layers), kept_from=max(0, length - window)
        )

    def stored_length(self, name: str, length: int) -> int:
        """Slots stored for array `layer_i/field` of an artifact of `length` positions."""
        layer, field = name.split("/")
        if field in ("k", "v") and int(layer.removeprefix("layer_")) in self.local_layers:
            return length - self.kept_from
        return length


def compact(state: kvstate.KVState, compaction: Compaction, mesh: Mesh) -> kvstate.KVState:
    """The arrays an artifact stores: local layers' k/v cut to `kept_from..` (ragged layers)."""
    if not compaction.kept_from:
        return state
    program = _compact_program(
        state.shape, state.length, tuple(compaction.local_layers), compaction.kept_from, mesh
    )
    return kvstate.KVState(program(state.layers), state.length)


@functools.lru_cache(maxsize=64)
def _compact_program(
    full: kvstate.KVShape, length: int, local_layers: tuple[int, ...], kept_from: int, mesh: Mesh
):
    """The jitted cut for one (shape, length, compaction, mesh): compiled once, not per deposit
    (a fresh closure was traced and compiled again on every deposit)."""
    short = dataclasses.replace(full, cache_length=length - kept_from)
    short_shardings = short.shardings(mesh)[0]
    local = set(local_layers)

    def cut(layers):
        return tuple(
            dataclasses.replace(layer, k=layer.k[:, kept_from:], v=layer.v[:, kept_from:])
            if i in local
            else layer
            for i, layer in enumerate(layers)
        )

    out = tuple(
        dataclasses.replace(s, k=short_shardings.k, v=short_shardings.v) if i in local else s
        for i, s in enumerate(full.shardings(mesh))
    )
    return jax.jit(cut, out_shardings=out)


def expand(layers, shape: kvstate.KVShape, compaction: Compaction, mesh: Mesh):
    """Zero-fills the slots a compacted artifact dropped, back to the uniform KV state."""
    program = _expand_program(shape, tuple(compaction.local_layers), compaction.kept_from, mesh)
    return program(layers)


def stored_offsets(c: Compaction | None, num_layers: int) -> tuple[int, ...]:
    """Per layer, the slot its stored K/V start at: `kept_from` for compacted local layers."""
    if c is None or not c.kept_from:
        return (0,) * num_layers
    return tuple(c.kept_from if i in set(c.local_layers) else 0 for i in range(num_layers))


@functools.lru_cache(maxsize=64)
def _expand_program(shape: kvstate.KVShape, local_layers: tuple[int, ...], kept_from: int, mesh):
    """The jitted zero-fill for one (shape, compaction, mesh): compiled once, not per restore."""
    local = set(local_layers)
    kv = (shape.batch_size, shape.cache_length, shape.num_kv_heads, shape.head_dim)

    def fill(layers):
        out = []
        for i, layer in enumerate(layers):
            if i in local and kept_from:
                at = (0, kept_from, 0, 0)
                k = jax.lax.dynamic_update_slice(jnp.zeros(kv, layer.k.dtype), layer.k, at)
                v = jax.lax.dynamic_update_slice(jnp.zeros(kv, layer.v.dtype), layer.v, at)
                layer = dataclasses.replace(layer, k=k, v=v)
            out.append(layer)
        return tuple(out)

    return jax.jit(fill, out_shardings=shape.shardings(mesh))


def stored_abstract(shape: kvstate.KVShape, compaction: Compaction | None, mesh: Mesh):
    """Restore targets: each stored array's shape with the rules' sharding for it on `mesh`."""
    full = shape.abstract(mesh)
    if compaction is None or not compaction.kept_from:
        return full
    short = dataclasses.replace(shape, cache_length=shape.cache_length - compaction.kept_from)
    short_layer = short.abstract(mesh)[0]
    return tuple(
        dataclasses.replace(layer, k=short_layer.k, v=short_layer.v)
        if i in set(compaction.local_layers)
        else layer
        for i, layer in enumerate(full)
    )
