"""How a KV state is stored: one array per layer and field, its logical axes and canonical blocks.

The block shapes decide the canonical digest (`digest.py`): the same state has the same array
digests and root on every mesh, so a restore onto another mesh is checked against the deposit.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from kvgraft_jax.core import digest, kvstate
from kvgraft_jax.store.manifest import ArrayEntry


def _block_shape(field: str, head_dim: int) -> tuple[int, ...]:
    if field in ("k", "v"):
        return (1, digest.BLOCK_POSITIONS, 1, head_dim)
    if field == "positions":
        return (1, digest.BLOCK_POSITIONS)
    return (1,)


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


# One program per state shape and sharding, compiled once (a fresh lambda would compile per call).
_to_values = jax.jit(lambda layers: jax.tree.map(kvstate.to_values, layers))


def state_tree(state: kvstate.KVState) -> dict[str, dict[str, jax.Array]]:
    """The tree an artifact stores: every array as its values (bf16 K/V, not the bits the cache
    holds), so that any Orbax reader gets the model's dtype."""
    return kvstate.layers_to_gemma(_to_values(state.layers))


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
