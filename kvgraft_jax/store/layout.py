"""How a KV state is stored: its per-layer arrays, their canonical blocks, and how `state/` packs them.

A state is digested as one array per layer and field (`layer_3/k`), whatever the storage: the block
shapes decide the canonical digest (`digest.py`), so the same state has the same array digests and
root on every mesh and a restore onto another mesh is checked against the deposit.

`state/` (format 2) stacks the layers whose arrays of a field have one shape on a new leading axis,
in runs of at most `STACK_BYTES`: Gemma 3 270M's 8,192-token compacted artifact stores 8 arrays,
not 72 (`k.stack_0`: the 15 local layers' bf16[15, 1, 512, 1, 256]; `k.stack_1` and `k.stack_2`:
the 3 global layers' [2, 1, 8192, 1, 256] and [1, ...]; the same for v; one for every layer's
positions, one for their end_index). Each stored array costs TensorStore a metadata read, a
shard-index read and a data read through the OCDBT tree, whatever its size: reading the 72 took
13.6 ms where the 8 take 7.6 (one process, interleaved), and on an object store each read is a
request. Format 1 (one stored array per layer and field, named as gemma's cache) is still read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from kvgraft_jax.core import digest, kvstate
from kvgraft_jax.store.manifest import ArrayEntry, StateStorage


def _block_shape(field: str, head_dim: int) -> tuple[int, ...]:
    if field in ("k", "v"):
        return (1, digest.BLOCK_POSITIONS, 1, head_dim)
    if field == "positions":
        return (1, digest.BLOCK_POSITIONS)
    return (1,)


# The most bytes one stored array stacks. TensorStore reads and decodes a stored array's chunk
# on one thread, and glibc does not reuse freed buffers above 32 MB: a 128 MiB state stored as
# one stack per field restored in 80 to 240 ms instead of about 85. Runs of this size keep a
# restore's buffers reusable and its reads parallel, and still make 8 arrays of the 270M's
# compacted 8,192 tokens (the 15 local layers' K in one 3.9 MB stack). Part of format 2: a
# reader finds the stacks by this rule, so another value needs another format.
STACK_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class StoredArray:
    """One array of `state/`: the per-layer arrays (canonical names, in layer order) it holds,
    stacked on a new leading axis, or a single one as it is (format 1)."""

    group: str  # the Orbax tree's first level: "k" ("layer_3" in format 1)
    key: str  # its second level: "stack_0" ("k" in format 1)
    names: tuple[str, ...]  # ("layer_0/k", "layer_1/k", ...)
    stacked: bool

    @property
    def label(self) -> str:
        """How messages name it: `k.stack_0`, as Orbax names the leaf (format 1: `layer_3/k`)."""
        return f"{self.group}.{self.key}" if self.stacked else self.names[0]


def stored_arrays(
    arrays: Mapping[str, tuple[Sequence[int], Any]], storage: StateStorage
) -> tuple[StoredArray, ...]:
    """How `state/` packs per-layer arrays of these stored shapes and dtypes: per field, the
    layers whose arrays have one shape, in layer order, stacked in runs of at most
    `STACK_BYTES` (a layer larger than that is a run of its own); stacks numbered in order.
    Decided by the whole arrays' shapes alone, so a reader on any mesh finds the same stacks."""
    names = sorted(arrays, key=_layer_and_field)
    if storage is StateStorage.PER_LAYER:
        return tuple(
            StoredArray(n.split("/")[0], n.split("/")[1], (n,), stacked=False) for n in names
        )
    out = []
    for field in kvstate.LAYER_AXES:
        groups: dict[tuple[int, ...], list[str]] = {}
        for name in names:
            if name.split("/")[1] == field:
                groups.setdefault(tuple(arrays[name][0]), []).append(name)
        for shape, members in groups.items():
            layer_bytes = math.prod(shape) * np.dtype(arrays[members[0]][1]).itemsize
            run = max(1, STACK_BYTES // max(1, layer_bytes))
            for start in range(0, len(members), run):
                key = f"stack_{sum(1 for s in out if s.group == field)}"
                out.append(StoredArray(field, key, tuple(members[start : start + run]), True))
    return tuple(out)


def _layer_and_field(name: str) -> tuple[int, int]:
    layer, field = name.split("/")
    return int(layer.removeprefix("layer_")), list(kvstate.LAYER_AXES).index(field)


def _as_bits(array: jax.Array) -> jax.Array:
    """The array as unsigned integers of its width (use inside `jax.jit`)."""
    bits = jnp.dtype(f"uint{8 * array.dtype.itemsize}")
    return array if array.dtype == bits else jax.lax.bitcast_convert_type(array, bits)


def stacked_sharding(layer_sharding: NamedSharding) -> NamedSharding:
    """A stack of arrays sharded `layer_sharding`: the new leading (layer) axis unsharded."""
    return NamedSharding(layer_sharding.mesh, PartitionSpec(None, *layer_sharding.spec))


def state_arrays(state: kvstate.KVState) -> dict[str, jax.Array]:
    return {
        f"layer_{i}/{field}": getattr(layer, field)
        for i, layer in enumerate(state.layers)
        for field in kvstate.LAYER_AXES
    }


def digest_state(
    state: kvstate.KVState, *, workers: int | None = None
) -> tuple[list[digest.ArrayDigest], str]:
    """Canonical digests and root of a KV state, hashed shard by shard on every core; each array
    recorded with its values' dtype (a held bf16 cache's bits digest as bf16)."""
    arrays = state_arrays(state)
    return digest.digest_arrays(
        arrays,
        block_shapes(arrays, state.shape.head_dim),
        workers=workers,
        dtypes={name: kvstate.value_dtype(a.dtype) for name, a in arrays.items()},
    )


def block_shapes(names, head_dim: int) -> dict[str, tuple[int, ...]]:
    return {name: _block_shape(name.split("/")[1], head_dim) for name in names}


def state_tree(state: kvstate.KVState) -> dict[str, dict[str, jax.Array]]:
    """The tree an artifact stores (`stored_arrays`, format 2): every array as its values (bf16
    K/V, not the bits the cache holds), so that any Orbax reader gets the model's dtype."""
    arrays = state_arrays(state)
    stored = stored_arrays({n: (a.shape, a.dtype) for n, a in arrays.items()}, StateStorage.STACKED)
    shardings = tuple(stacked_sharding(arrays[s.names[0]].sharding) for s in stored)
    return _stack_program(stored, shardings)(arrays)


@functools.lru_cache(maxsize=64)
def _stack_program(stored: tuple[StoredArray, ...], shardings: tuple[NamedSharding, ...]):
    """The jitted stacking for one layout and sharding: compiled once, not per deposit."""

    def stack(arrays):
        # Stacked as unsigned bits, then viewed as the values: XLA:CPU widens a bf16 copy to
        # f32 and back, which rewrites NaN payloads (random bf16 bits came out changed).
        tree: dict[str, dict[str, jax.Array]] = {}
        for s in stored:
            held = [arrays[n] for n in s.names]
            stacked = jnp.stack([_as_bits(a) for a in held])
            values = kvstate.value_dtype(held[0].dtype)
            tree.setdefault(s.group, {})[s.key] = jax.lax.bitcast_convert_type(stacked, values)
        return tree

    out: dict[str, dict[str, NamedSharding]] = {}
    for s, sh in zip(stored, shardings, strict=True):
        out.setdefault(s.group, {})[s.key] = sh
    return jax.jit(stack, out_shardings=out)


def array_entries(
    state: kvstate.KVState, digests: Sequence[digest.ArrayDigest]
) -> list[ArrayEntry]:
    return [
        ArrayEntry(
            name=d.name,
            shape=list(d.shape),
            dtype=d.dtype,
            logical_axes=list(kvstate.LAYER_AXES[d.name.split("/")[1]]),
            block_shape=list(d.block_shape),
            digest=d.digest,
        )
        for d in digests
    ]
