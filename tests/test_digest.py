"""Canonical digests: mesh-independent, equal to hashing the gathered array, sensitive to every bit."""

import hashlib
import itertools

import jax
import numpy as np
import pytest

from kvgraft_jax.core import digest, kvstate, sharding
from kvgraft_jax.store.layout import digest_state

MESH_NAMES = {"1": (1, 1), "8": (1, 8), "2x4": (2, 4), "4x2": (4, 2)}
BLOCK = (1, digest.BLOCK_POSITIONS, 1, 8)


def _kv(rng, shape=(2, 600, 4, 8)):
    return rng.standard_normal(shape).astype(jax.numpy.bfloat16)


def _put(
    array,
    mesh_name,
    spec_axes=(sharding.BATCH, sharding.CACHE_SEQ, sharding.KV_HEADS, sharding.HEAD_DIM),
):
    mesh = sharding.make_mesh(sharding.MeshSpec(*MESH_NAMES[mesh_name]))
    return jax.device_put(array, sharding.named_sharding(mesh, spec_axes, array.shape))


def _reference(array: np.ndarray, block_shape) -> str:
    """The definition, written out on the gathered numpy array."""
    grid = [-(-d // b) for d, b in zip(array.shape, block_shape, strict=True)]
    blocks = {}
    for coord in itertools.product(*(range(g) for g in grid)):
        sl = tuple(slice(c * b, (c + 1) * b) for c, b in zip(coord, block_shape, strict=True))
        blocks[coord] = hashlib.sha256(np.ascontiguousarray(array[sl]).tobytes()).digest()
    return digest.combine("x", str(array.dtype), array.shape, block_shape, blocks).digest


def test_sharded_digest_equals_gathered_numpy_digest_on_every_mesh():
    host = _kv(np.random.default_rng(0))
    want = _reference(host, BLOCK)
    assert digest.array_digest(host, BLOCK, name="x").digest == want
    for mesh_name in MESH_NAMES:
        assert digest.array_digest(_put(host, mesh_name), BLOCK, name="x").digest == want, mesh_name


@pytest.mark.parametrize(
    "shape", [(1, 600, 1, 8), (1, 256, 1, 8), (1, 100, 1, 8), (2, 600, 1, 8), (1, 600, 4, 8)]
)
def test_blocks_hashed_in_place_equal_the_definition(shape):
    """A shard of one batch row and one KV head is hashed as runs of its bytes, with no slicing
    (`digest.block_runs`); every other shard block by block as sliced copies. Both must give the
    definition's digest on every mesh, last partial block included."""
    host = _kv(np.random.default_rng(5), shape)
    want = _reference(host, BLOCK)
    for mesh_name in MESH_NAMES:
        arr = _put(host, mesh_name)
        assert digest.array_digest(arr, BLOCK, name="x", workers=3).digest == want, mesh_name
        for shard in arr.addressable_shards:
            one_run_each = shard.data.shape[0] == 1 and shard.data.shape[2] == 1
            runs = digest.block_runs(np.asarray(shard.data), BLOCK)
            assert (runs is not None) == one_run_each, (mesh_name, shard.data.shape)


def test_replicated_shards_are_hashed_once():
    host = _kv(np.random.default_rng(1), (1, 300, 1, 8))
    arr = _put(host, "8")  # batch 1 and one KV head: every device holds the whole array
    assert len(arr.addressable_shards) == 8
    blocks = digest.block_digests(arr, BLOCK)
    assert len(blocks) == 2  # 300 positions = 2 blocks of 256, not 16


def test_every_single_bit_changes_the_digest():
    host = _kv(np.random.default_rng(2), (1, 40, 2, 4))
    block = (1, digest.BLOCK_POSITIONS, 1, 4)
    base = digest.array_digest(host, block).digest
    raw = host.view(np.uint16)
    rng = np.random.default_rng(3)
    positions = [np.unravel_index(i, raw.shape) for i in rng.choice(raw.size, 24, replace=False)]
    for pos in positions:
        for bit in (0, 7, 15):
            flipped = raw.copy()
            flipped[pos] ^= np.uint16(1 << bit)
            assert digest.array_digest(flipped.view(host.dtype), block).digest != base, (pos, bit)


def test_digest_includes_dtype_and_shape():
    a = np.zeros((1, 8), np.int32)
    assert (
        digest.array_digest(a, (1, 8)).digest
        != digest.array_digest(a.view(np.float32), (1, 8)).digest
    )
    assert (
        digest.array_digest(a, (1, 8)).digest != digest.array_digest(a.reshape(2, 4), (1, 8)).digest
    )


def test_shard_cutting_a_block_is_refused():
    mesh = sharding.make_mesh(sharding.MeshSpec(1, 8))
    from jax.sharding import NamedSharding, PartitionSpec

    arr = jax.device_put(
        np.zeros((1, 64), np.int32), NamedSharding(mesh, PartitionSpec(None, "model"))
    )
    with pytest.raises(digest.DigestError, match="cuts through"):
        digest.block_digests(arr, (1, 256))


def test_root_is_order_independent_and_name_sensitive():
    a = digest.ArrayDigest("a", "int32", (1,), (1,), "00" * 32)
    b = digest.ArrayDigest("b", "int32", (1,), (1,), "11" * 32)
    assert digest.root([a, b]) == digest.root([b, a])
    renamed = digest.ArrayDigest("c", "int32", (1,), (1,), "00" * 32)
    assert digest.root([renamed, b]) != digest.root([a, b])
    with pytest.raises(digest.DigestError, match="duplicate"):
        digest.root([a, a])


def test_state_root_is_the_same_on_every_mesh():
    rng = np.random.default_rng(4)
    shape = kvstate.KVShape(
        num_layers=2, batch_size=2, cache_length=300, num_kv_heads=4, head_dim=8
    )
    host = [
        {
            "k": _kv(rng, (2, 300, 4, 8)),
            "v": _kv(rng, (2, 300, 4, 8)),
            "positions": np.tile(np.arange(300, dtype=np.int32), (2, 1)),
            "end_index": np.full((2,), 300, np.int32),
        }
        for _ in range(2)
    ]
    roots = set()
    for dims in MESH_NAMES.values():
        mesh = sharding.make_mesh(sharding.MeshSpec(*dims))
        targets = shape.shardings(mesh)
        layers = tuple(
            kvstate.LayerKV(**{n: jax.device_put(h[n], getattr(t, n)) for n in h})
            for h, t in zip(host, targets, strict=True)
        )
        roots.add(digest_state(kvstate.KVState(layers, 300))[1])
    assert len(roots) == 1


def test_state_root_changes_when_one_bit_of_any_array_changes():
    rng = np.random.default_rng(5)
    mesh = sharding.make_mesh(sharding.MeshSpec(2, 4))
    shape = kvstate.KVShape(num_layers=2, batch_size=2, cache_length=20, num_kv_heads=4, head_dim=8)
    host = [
        {
            "k": _kv(rng, (2, 20, 4, 8)),
            "v": _kv(rng, (2, 20, 4, 8)),
            "positions": np.tile(np.arange(20, dtype=np.int32), (2, 1)),
            "end_index": np.full((2,), 20, np.int32),
        }
        for _ in range(2)
    ]

    def root_of(arrays):
        targets = shape.shardings(mesh)
        layers = tuple(
            kvstate.LayerKV(**{n: jax.device_put(h[n], getattr(t, n)) for n in h})
            for h, t in zip(arrays, targets, strict=True)
        )
        return digest_state(kvstate.KVState(layers, 20))[1]

    base = root_of(host)
    for layer in range(2):
        for name in ("k", "v", "positions", "end_index"):
            changed = [dict(h) for h in host]
            raw = changed[layer][name].copy()
            bits_view = raw.view(np.uint16 if raw.dtype.itemsize == 2 else np.uint32)
            bits_view.flat[rng.integers(bits_view.size)] ^= 1 << int(
                rng.integers(8 * raw.dtype.itemsize)
            )
            changed[layer][name] = raw
            assert root_of(changed) != base, (layer, name)
