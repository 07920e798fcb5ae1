"""The typed KV state: gemma's cache dict as a registered dataclass pytree that knows its used length.

gemma keeps its cache as `{'layer_i': {'k', 'v', 'positions', 'end_index'}}`; every public API here
takes and returns a `KVState` instead, and converts at the model boundary. Keys are stored after RoPE,
so a state is only valid at the positions it was computed at. Every layer, local or global, holds the
full cache length; the sliding window is only a mask.

A bf16 cache is held as its bits (`uint16`): XLA:CPU has no bf16 dynamic-update-slice or
dynamic-slice, so on a bf16 array it widens the whole cache to f32 and back to write one token's
slot, every layer of every step (at 8,448 slots that was a third of the 270M's decode step). On
bits the write is in place and the attention reads one block at a time (`attention.attend`).
`KVShape.dtype` stays the values' dtype, which is what artifacts store, digest and record;
`storage_dtype`, `to_values` and `to_storage` convert at those boundaries, bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from kvgraft_jax.core import sharding

# Logical axes of each per-layer array; the physical layout is data, not hard-coded elsewhere.
LAYER_AXES: Mapping[str, tuple[str, ...]] = {
    "k": (sharding.BATCH, sharding.CACHE_SEQ, sharding.KV_HEADS, sharding.HEAD_DIM),
    "v": (sharding.BATCH, sharding.CACHE_SEQ, sharding.KV_HEADS, sharding.HEAD_DIM),
    "positions": (sharding.BATCH, sharding.CACHE_SEQ),
    "end_index": (sharding.BATCH,),
}


def storage_dtype(dtype) -> np.dtype:
    """The dtype a cache of `dtype` values is held in: bf16 as its bits, anything else as is."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.uint16) if dtype == jnp.bfloat16 else dtype


def value_dtype(dtype) -> np.dtype:
    """The values' dtype of a cache array held in `dtype` (the inverse of `storage_dtype`)."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.bfloat16) if dtype == jnp.uint16 else dtype


def to_values(array: jax.Array) -> jax.Array:
    """A held cache array as its values (a bitcast; use inside `jax.jit`)."""
    want = value_dtype(array.dtype)
    return array if array.dtype == want else jax.lax.bitcast_convert_type(array, want)


def to_storage(values: jax.Array, held) -> jax.Array:
    """`values` as a cache held in dtype `held` holds them: cast to its values' dtype, then
    bitcast (use inside `jax.jit`)."""
    values = values.astype(value_dtype(held))
    held = jnp.dtype(held)
    return values if values.dtype == held else jax.lax.bitcast_convert_type(values, held)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerKV:
    """One attention layer's cache."""

    k: jax.Array  # uint16[batch, cache, kv_heads, head_dim]: bf16 bits, after RoPE
    v: jax.Array  # uint16[batch, cache, kv_heads, head_dim]: bf16 bits
    positions: jax.Array  # int32[batch, cache], absolute position held by each slot
    end_index: jax.Array  # int32[batch], next write slot (gemma writes at end_index % cache)


@dataclasses.dataclass(frozen=True)
class KVShape:
    """The static description of a KV state; `abstract()` and `shardings()` derive from it."""

    num_layers: int
    batch_size: int
    cache_length: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def array_shapes(self, *, values: bool = False) -> dict[str, tuple[tuple[int, ...], Any]]:
        """Shape and dtype of each per-layer array as the cache holds it (`values`: as an
        artifact stores and records it)."""
        kv = (self.batch_size, self.cache_length, self.num_kv_heads, self.head_dim)
        held = jnp.dtype(self.dtype) if values else storage_dtype(self.dtype)
        return {
            "k": (kv, held),
            "v": (kv, held),
            "positions": ((self.batch_size, self.cache_length), jnp.dtype(jnp.int32)),
            "end_index": ((self.batch_size,), jnp.dtype(jnp.int32)),
        }

    def shardings(
        self, mesh: Mesh, *, replicated: list[sharding.Replicated] | None = None
    ) -> tuple[LayerKV, ...]:
        """Per-layer `NamedSharding`s, from `LAYER_AXES` and the mesh rules."""
        per_layer = {}
        for name, (shape, dtype) in self.array_shapes().items():
            per_layer[name] = sharding.named_sharding(
                mesh,
                LAYER_AXES[name],
                shape,
                name=f"cache/{name}",
                nbytes=int(jnp.dtype(dtype).itemsize * math.prod(shape) * self.num_layers),
                replicated=replicated,
            )
        layer = LayerKV(**per_layer)
        return tuple(layer for _ in range(self.num_layers))

    def abstract(self, mesh: Mesh) -> tuple[LayerKV, ...]:
        """`ShapeDtypeStruct`s carrying the target sharding: init, restore targets and checks."""
        # Every layer's arrays are alike: one immutable LayerKV for all (72 structs for the 270M
        # cost a restore 0.3 ms each time it sized its targets).
        shardings = self.shardings(mesh)[0]
        layer = LayerKV(
            **{
                name: jax.ShapeDtypeStruct(shape, dtype, sharding=getattr(shardings, name))
                for name, (shape, dtype) in self.array_shapes().items()
            }
        )
        return tuple(layer for _ in range(self.num_layers))


@dataclasses.dataclass(frozen=True)
class KVState:
    """A KV cache plus the number of positions it holds (`length`, host-side and static).

    Only `layers` crosses a `jax.jit` boundary; `length` stays a Python int so that a growing state
    does not retrace the compiled programs.
    """

    layers: tuple[LayerKV, ...]
    length: int

    @property
    def shape(self) -> KVShape:
        k = self.layers[0].k
        return KVShape(
            num_layers=len(self.layers),
            batch_size=k.shape[0],
            cache_length=k.shape[1],
            num_kv_heads=k.shape[2],
            head_dim=k.shape[3],
            dtype=str(value_dtype(k.dtype)),
        )

    @property
    def cache_length(self) -> int:
        return self.layers[0].k.shape[1]

    def shardings(self) -> tuple[LayerKV, ...]:
        return jax.tree.map(lambda x: x.sharding, self.layers)

    def to_gemma(self) -> dict[str, dict[str, jax.Array]]:
        return layers_to_gemma(self.layers)

    def block_until_ready(self) -> KVState:
        jax.block_until_ready(self.layers)
        return self


def layers_to_gemma(layers: tuple[LayerKV, ...]) -> dict[str, dict[str, jax.Array]]:
    """gemma's cache dict (`layer_i` -> k, v, positions, end_index)."""
    # Not dataclasses.asdict: it deep-copies every array.
    return {
        f"layer_{i}": {name: getattr(layer, name) for name in LAYER_AXES}
        for i, layer in enumerate(layers)
    }


def layers_from_gemma(cache: Mapping[str, Mapping[str, jax.Array]]) -> tuple[LayerKV, ...]:
    num_layers = len(cache)
    expected = {f"layer_{i}" for i in range(num_layers)}
    if set(cache) != expected:
        raise ValueError(
            f"gemma cache keys {sorted(cache)} are not layer_0..layer_{num_layers - 1}"
        )
    return tuple(LayerKV(**cache[f"layer_{i}"]) for i in range(num_layers))


def zeros(shape: KVShape, mesh: Mesh) -> KVState:
    """An empty cache allocated directly in its target sharding (no host copy, no resharding)."""
    return KVState(layers=_zeros_program(shape, mesh)(), length=0)


@functools.lru_cache(maxsize=16)
def _zeros_program(shape: KVShape, mesh: Mesh):
    """The jitted zero cache of one shape and mesh: compiled once, not on every call."""
    abstract = shape.abstract(mesh)
    out_shardings = jax.tree.map(lambda a: a.sharding, abstract)
    return jax.jit(
        lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract),
        out_shardings=out_shardings,
    )


def assert_shardings(state: KVState, mesh: Mesh) -> None:
    """Raises if any leaf's sharding differs from what the rules give for `mesh`."""
    expected = state.shape.shardings(mesh)
    for i, (layer, want) in enumerate(zip(state.layers, expected, strict=True)):
        for name in LAYER_AXES:
            got: NamedSharding = getattr(layer, name).sharding
            target: NamedSharding = getattr(want, name)
            if not got.is_equivalent_to(target, getattr(layer, name).ndim):
                raise AssertionError(
                    f"layer_{i}/{name}: sharding {got} differs from the target {target}"
                )
