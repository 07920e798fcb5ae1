"""Canonical SHA-256 digests of sharded arrays: the same state has the same root on every mesh.

An array is cut into canonical blocks along fixed boundaries given by a *block shape* (for a K/V
array: one batch row, one run of `BLOCK_POSITIONS` positions, one KV head, all of head_dim). Each
block's C-order bytes are hashed; the array digest hashes a header (dtype, shape, block shape) and
the block digests in C order of the block grid; the root hashes the sorted (name, array digest)
pairs. Blocks are hashed from each device's own shard, so nothing is gathered; a replicated shard
is hashed once; hashlib releases the GIL, so a thread pool uses every core. On several processes
each hashes the shards it holds and the 32-byte block digests (not the data) are exchanged, so
every process computes the same root as one process would.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import itertools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

BLOCK_POSITIONS = 256
FORMAT = "kvgraft-digest/1"


class DigestError(ValueError):
    """The array's sharding cuts through a canonical block, or a block is missing."""


@dataclasses.dataclass(frozen=True)
class ArrayDigest:
    name: str
    dtype: str
    shape: tuple[int, ...]
    block_shape: tuple[int, ...]
    digest: str


def _grid(shape: Sequence[int], block_shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(-(-d // b) if d else 0 for d, b in zip(shape, block_shape, strict=True))


def _shard_bounds(index: tuple[slice, ...], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    bounds = []
    for s, d in zip(index, shape, strict=True):
        start, stop, _ = s.indices(d)
        bounds.append((start, stop))
    return tuple(bounds)


def _blocks_in_shard(bounds, shape, block_shape, name) -> list[tuple[int, ...]]:
    """Block coordinates a shard covers; refuses a shard edge that falls inside a block."""
    ranges = []
    for axis, ((start, stop), dim, block) in enumerate(
        zip(bounds, shape, block_shape, strict=True)
    ):
        if start % block or (stop % block and stop != dim):
            raise DigestError(
                f"{name}: shard [{start}:{stop}) on axis {axis} cuts through canonical blocks of "
                f"{block}; shard this axis on multiples of {block}"
            )
        ranges.append(range(start // block, -(-stop // block)))
    return list(itertools.product(*ranges))


def _hash_block(data: np.ndarray, local_start: Sequence[int], block_shape, shape, coord) -> bytes:
    sl = []
    for c, b, d, s in zip(coord, block_shape, shape, local_start, strict=True):
        lo = c * b
        sl.append(slice(lo - s, min(lo + b, d) - s))
    block = np.ascontiguousarray(data[tuple(sl)])
    return hashlib.sha256(block.reshape(-1).view(np.uint8).data).digest()


def _normalise_block_shape(shape: Sequence[int], block_shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(min(b, d) if d else b for b, d in zip(block_shape, shape, strict=True))


def _shard_jobs(
    array: jax.Array | np.ndarray, block_shape: Sequence[int], name: str
) -> list[Callable[[], dict]]:
    """One job per distinct shard this process holds; each hashes every block inside its shard."""
    shape = tuple(array.shape)
    block_shape = _normalise_block_shape(shape, block_shape)
    if isinstance(array, jax.Array):
        # Replica 0 of each distinct shard, on whichever process holds it: every block is hashed
        # exactly once across all processes.
        pieces = [
            (_shard_bounds(shard.index, shape), shard.data)
            for shard in array.addressable_shards
            if shard.replica_id == 0
        ]
    else:
        pieces = [(tuple((0, d) for d in shape), array)]

    def job(bounds, coords, data) -> dict[tuple[int, ...], bytes]:
        host = np.asarray(data)  # this device's shard only, never the whole array
        start = [b[0] for b in bounds]
        return {c: _hash_block(host, start, block_shape, shape, c) for c in coords}

    # Block coordinates are computed here, so a misaligned sharding is refused before any hashing.
    return [
        functools.partial(job, bounds, _blocks_in_shard(bounds, shape, block_shape, name), data)
        for bounds, data in pieces
    ]


def block_digests(
    array: jax.Array | np.ndarray,
    block_shape: Sequence[int],
    *,
    name: str = "array",
    pool: concurrent.futures.Executor | None = None,
) -> dict[tuple[int, ...], bytes]:
    """Digest of every canonical block this process holds (all of them on one process)."""
    jobs = _shard_jobs(array, block_shape, name)
    results = pool.map(lambda j: j(), jobs) if pool is not None else (j() for j in jobs)
    out: dict[tuple[int, ...], bytes] = {}
    for r in results:
        out.update(r)
    return out


def _exchange_blocks(
    grids: Mapping[str, tuple[int, ...]], local: Mapping[str, Mapping[tuple[int, ...], bytes]]
) -> dict[str, dict[tuple[int, ...], bytes]]:
    """Every process's block digests on every process (one all-gather of 33 bytes per block)."""
    from kvgraft_jax.core import multihost

    if not multihost.is_multiprocess():
        return {name: dict(blocks) for name, blocks in local.items()}
    names = sorted(grids)
    coords = [(n, c) for n in names for c in itertools.product(*(range(g) for g in grids[n]))]
    table = np.zeros((len(coords), 33), np.uint8)  # [present, digest...]
    for i, (name, coord) in enumerate(coords):
        found = local[name].get(coord)
        if found is not None:
            table[i, 0] = 1
            table[i, 1:] = np.frombuffer(found, np.uint8)
    gathered = multihost.allgather(table)  # [processes, blocks, 33]
    out: dict[str, dict[tuple[int, ...], bytes]] = {name: {} for name in names}
    for i, (name, coord) in enumerate(coords):
        holders = np.flatnonzero(gathered[:, i, 0])
        if holders.size:
            out[name][coord] = gathered[holders[0], i, 1:].tobytes()
    return out


def combine(
    name: str,
    dtype: str,
    shape: Sequence[int],
    block_shape: Sequence[int],
    blocks: Mapping[tuple[int, ...], bytes],
) -> ArrayDigest:
    """The array digest from all of its block digests (every block must be present)."""
    shape = tuple(int(d) for d in shape)
    block_shape = _normalise_block_shape(shape, block_shape)
    grid = _grid(shape, block_shape)
    digest = hashlib.sha256(_header(dtype, shape, block_shape))
    for coord in itertools.product(*(range(g) for g in grid)):
        if coord not in blocks:
            raise DigestError(f"{name}: block {coord} of grid {grid} was not hashed")
        digest.update(blocks[coord])
    return ArrayDigest(name, dtype, shape, block_shape, digest.hexdigest())


@functools.lru_cache(maxsize=256)
def _header(dtype: str, shape: tuple[int, ...], block_shape: tuple[int, ...]) -> bytes:
    """What an array digest hashes first; the arrays of a KV state share a few."""
    header = {
        "format": FORMAT,
        "dtype": dtype,
        "shape": list(shape),
        "block_shape": list(block_shape),
    }
    return json.dumps(header, sort_keys=True).encode()


def root(digests: Sequence[ArrayDigest]) -> str:
    """Merkle root over the arrays, sorted by name (so insertion order does not matter)."""
    names = [d.name for d in digests]
    if len(set(names)) != len(names):
        raise DigestError(f"duplicate array names in {names}")
    h = hashlib.sha256(FORMAT.encode())
    for d in sorted(digests, key=lambda d: d.name):
        h.update(d.name.encode() + b"\0" + bytes.fromhex(d.digest))
    return h.hexdigest()


@functools.lru_cache(maxsize=4)
def thread_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """One long-lived pool per size: starting threads for every restore cost milliseconds."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="digest")


class BlockHasher:
    """Hashes arrays' canonical blocks on a thread pool as they are added, so hashing overlaps
    whatever produces the next array (a restore's reads); `finish` gives the digests and root.

    On several processes `wait` (local hashing, may raise) and `finish` (one all-gather of the
    block digests) are separate, so a caller can agree on local failures before the collective.
    """

    def __init__(self, *, workers: int | None = None) -> None:
        # All shards of all arrays in one pool, so a single-device mesh still uses every core.
        self._pool = thread_pool(workers or os.cpu_count() or 1)
        self._arrays: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]] = {}
        self._pending: list[tuple[str, concurrent.futures.Future]] = []
        self._blocks: dict[str, dict[tuple[int, ...], bytes]] = {}

    def __enter__(self) -> BlockHasher:
        return self

    def __exit__(self, *exc) -> None:
        for _, future in self._pending:  # after a failure: drop what has not started
            future.cancel()
        concurrent.futures.wait([f for _, f in self._pending])

    def add(
        self,
        name: str,
        array: jax.Array | np.ndarray,
        block_shape: Sequence[int],
        *,
        dtype: Any = None,
    ) -> None:
        """`dtype` names the bytes' dtype where the array holds another of the same size (a KV
        cache holds bf16 as uint16 bits): the digest records the values' dtype."""
        if name in self._arrays:
            raise DigestError(f"duplicate array name {name}")
        shape = tuple(int(d) for d in array.shape)
        recorded = np.dtype(array.dtype if dtype is None else dtype)
        if recorded.itemsize != np.dtype(array.dtype).itemsize:
            raise DigestError(f"{name}: {array.dtype} bytes cannot be recorded as {recorded}")
        self._arrays[name] = (str(recorded), shape, tuple(block_shape))
        self._blocks[name] = {}
        # Block coordinates are computed here, so a misaligned sharding is refused at once.
        self._pending += [
            (name, self._pool.submit(job)) for job in _shard_jobs(array, block_shape, name)
        ]

    def wait(self) -> None:
        """Waits for this process's hashing; raises the first failure."""
        for name, future in self._pending:
            self._blocks[name].update(future.result())
        self._pending = []

    def finish(self) -> tuple[list[ArrayDigest], str]:
        self.wait()
        names = sorted(self._arrays)
        grids = {
            name: _grid(shape, _normalise_block_shape(shape, block))
            for name, (_, shape, block) in self._arrays.items()
        }
        blocks = _exchange_blocks(grids, self._blocks)
        digests = [combine(name, *self._arrays[name], blocks[name]) for name in names]
        return digests, root(digests)


def digest_arrays(
    arrays: Mapping[str, jax.Array | np.ndarray],
    block_shapes: Mapping[str, Sequence[int]],
    *,
    workers: int | None = None,
    dtypes: Mapping[str, Any] | None = None,
) -> tuple[list[ArrayDigest], str]:
    """Digests of named arrays (hashed in parallel on `workers` threads) and their root;
    `dtypes` (by name) as in `BlockHasher.add`."""
    with BlockHasher(workers=workers) as hasher:
        for name in sorted(arrays):
            hasher.add(name, arrays[name], block_shapes[name], dtype=(dtypes or {}).get(name))
        return hasher.finish()


def array_digest(
    array: jax.Array | np.ndarray,
    block_shape: Sequence[int],
    *,
    name: str = "array",
    workers: int | None = None,
) -> ArrayDigest:
    """One array's digest: `digest_arrays` of a single array."""
    digests, _ = digest_arrays({name: array}, {name: block_shape}, workers=workers)
    return digests[0]
