"""One pass over an artifact's stored state: read every shard, place it, hash it while others read.

Orbax writes the state: an ordinary PyTree checkpoint (OCDBT, zarr3) that
`ocp.PyTreeCheckpointer().restore(ARTIFACT/state)` reads anywhere. Orbax's own restore, though,
spends about 80 ms per artifact here on metadata and handler setup before any array moves, several
times the whole limit of a verified restore (issue #7). So kvgraft opens each stored array with
TensorStore directly, with the spec and context Orbax itself reads it with
(`type_handlers.get_json_tspec_read`, `get_ts_context`), starts every shard's read at once into a
host buffer aligned for XLA (which then places it on a CPU device without a copy), and as each
shard lands puts it on its device(s) and hands the device's bytes to a `digest.BlockHasher`.
Every byte is read once and hashed once; where there are cores to spare, the hashing of one
array overlaps the reads of the next (`read_and_hash`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from kvgraft_jax.core import digest, kvstate
from kvgraft_jax.store import layout


class StoredStateError(Exception):
    """A stored array is missing, unreadable, or not the shape and dtype the manifest records."""


@dataclasses.dataclass(frozen=True)
class Part:
    """One per-layer array a stored array holds, and where it must land."""

    name: str  # canonical-digest name, "layer_3/k"
    abstract: jax.ShapeDtypeStruct  # shape and the dtype it is held in; the target sharding
    block_shape: tuple[int, ...]

    @property
    def stored_dtype(self) -> np.dtype:
        """The dtype stored and recorded (bf16 for K/V that the cache holds as uint16 bits)."""
        return kvstate.value_dtype(self.abstract.dtype)


@dataclasses.dataclass(frozen=True)
class Target:
    """One stored array: where Orbax put it and the per-layer arrays it holds (`layout`)."""

    label: str  # how messages name it: "k.stack_0" (format 1: "layer_3/k")
    param: str  # Orbax's parameter name of the leaf, "k.stack_0" (format 1: "layer_3.k")
    parts: tuple[Part, ...]  # in stored order; all of one shape, dtype and sharding
    stacked: bool  # parts stacked on a leading axis, else the one part as it is

    @property
    def stored_shape(self) -> tuple[int, ...]:
        shape = tuple(self.parts[0].abstract.shape)
        return (len(self.parts), *shape) if self.stacked else shape


def targets(
    stored: Sequence[layout.StoredArray],
    abstract: Mapping[str, jax.ShapeDtypeStruct],
    block_shapes: Mapping[str, Sequence[int]],
) -> list[Target]:
    """A target per stored array, its parts' targets from `abstract` (by canonical name), named
    the way Orbax names the stored tree's leaves. A stack's parts share one shape, so one
    dtype and sharding: `layout.stored_arrays` stacks by shape, the rules shard by shape."""
    tree: dict[str, dict[str, int]] = {}
    for s in stored:
        tree.setdefault(s.group, {})[s.key] = 0
    params = ocp.tree.get_param_names(tree)
    return [
        Target(
            s.label,
            params[s.group][s.key],
            tuple(Part(n, abstract[n], tuple(block_shapes[n])) for n in s.names),
            s.stacked,
        )
        for s in stored
    ]


def read_and_hash(
    state_dir: epath.Path,
    wanted: Sequence[Target],
    hasher: digest.BlockHasher,
    *,
    overlap: bool | None = None,
) -> dict[str, jax.Array]:
    """Every target read onto its sharding (each process reads only its own devices' shards) and
    added to `hasher`: the moment it is placed with `overlap`, else once all are placed.

    `overlap=None` overlaps when the machine has more than two cores. On two, a page-cache read
    and the hashing each want both cores, and overlapping them measured ~10% slower than one
    after the other (threads contending, 45 vs 40 ms for 26 MiB); with cores to spare, or reads
    that wait on a network, hashing hides behind the reads.
    """
    if overlap is None:
        overlap = (os.cpu_count() or 1) > 2
    in_flight = _start_all(state_dir, wanted)
    placed = {}

    # With overlap, one device_put per group (a field's stacks; in format 1 a layer's k, v,
    # positions, end_index), small enough for hashing to start while later ones read; else one
    # for all (the 270M's 72 arrays at 8,192 tokens: 3.3 ms in one call against 4.6 in 18).
    def group_of(read: tuple[Target, list]) -> str:
        return read[0].param.split(".")[0] if overlap else ""

    for _, group in itertools.groupby(in_flight, key=group_of):
        group = list(group)
        parts = [part for target, _ in group for part in target.parts]
        for part, array in zip(parts, _place(group), strict=True):
            placed[part.name] = array
            if overlap:
                hasher.add(part.name, array, part.block_shape, dtype=part.stored_dtype)
        if overlap:
            hasher.flush()
    if not overlap:
        for part in (part for target in wanted for part in target.parts):
            hasher.add(part.name, placed[part.name], part.block_shape, dtype=part.stored_dtype)
        hasher.flush()
    return placed


def read_only(state_dir: epath.Path, wanted: Sequence[Target]) -> int:
    """Every target's shards read onto the host as `read_and_hash` reads them (same context,
    specs and shard boxes), nothing placed or hashed; returns the bytes read. A benchmark's
    yardstick: what reading the format costs before a verified restore does anything else."""
    reads = [read for _, shards in _start_all(state_dir, wanted) for read in shards]
    for read in reads:
        read.future.result()
    return sum(read.host.nbytes for read in reads)


def _start_all(state_dir: epath.Path, wanted: Sequence[Target]) -> list[tuple[Target, list]]:
    """Opens every target and starts every shard's read: each target with its reads in flight."""
    context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
    stores = _open(state_dir, wanted, context)
    return [(t, _start_reads(t, stores[t.label])) for t in wanted]


def _specs(
    state_dir: epath.Path, params: Sequence[str], context: ts.Context
) -> list[dict[str, Any]]:
    """Orbax's read spec of every array. Building one costs ~0.1 ms of Python, and they differ
    only in `kvstore.path`, so the rest are copies of the first; should an Orbax version ever
    make them differ otherwise (checked on the last one), every spec comes from Orbax."""

    def with_path(param: str) -> dict[str, Any]:
        return {**first, "kvstore": {**first["kvstore"], "path": param}}

    first = orbax_spec(state_dir, params[0], context)
    if with_path(params[-1]) != orbax_spec(state_dir, params[-1], context):
        return [orbax_spec(state_dir, p, context) for p in params]
    return [with_path(p) for p in params]


def orbax_spec(state_dir: epath.Path, param: str, context: ts.Context) -> dict[str, Any]:
    info = ocp.type_handlers.ParamInfo(
        name=param,
        parent_dir=state_dir,
        is_ocdbt_checkpoint=True,
        use_zarr3=True,
        ts_context=context,
    )
    return ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True)


def _open(
    state_dir: epath.Path, wanted: Sequence[Target], context: ts.Context
) -> dict[str, ts.TensorStore]:
    """Opens every array at once; refuses one whose stored shape or dtype differs from the
    manifest's before reading (a plain read would cast or fail later, less clearly)."""
    specs = _specs(state_dir, [t.param for t in wanted], context)
    pending = [ts.open(spec, context=context, open=True, read=True) for spec in specs]
    stores = {}
    for t, opening in zip(wanted, pending, strict=True):
        try:
            store = opening.result()
        except Exception as e:
            raise StoredStateError(
                f"stored state lacks a readable {t.label}: {_first_line(e)}"
            ) from None
        have_shape, have_dtype = tuple(store.shape), np.dtype(store.dtype.numpy_dtype)
        want_shape, want_dtype = t.stored_shape, t.parts[0].stored_dtype
        if have_shape != want_shape or have_dtype != want_dtype:
            raise StoredStateError(
                f"stored {t.label} is {have_dtype}{list(have_shape)}, the manifest says "
                f"{want_dtype}{list(want_shape)}"
            )
        stores[t.label] = store
    return stores


# XLA:CPU takes a host buffer aligned to this many bytes as it is (`jax.device_put` places it
# without a copy); TensorStore's own read results are aligned to 16 and were copied once more.
HOST_ALIGNMENT = 64


def aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-order array whose data starts on a `HOST_ALIGNMENT`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + HOST_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % HOST_ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(tuple(shape))


class _Read(NamedTuple):
    """One shard of one part being read into `host` (a view of its stack's buffer)."""

    part: int  # index into the target's parts
    future: ts.WriteFutures
    host: np.ndarray
    devices: list


def _start_reads(target: Target, store: ts.TensorStore) -> list[_Read]:
    """One read per distinct shard on this process's devices (a replicated shard is read once),
    each into an aligned host buffer that the placement then hands to XLA without a copy (at
    128 MiB, read and place went from 46 to 30 ms: the copy and its fresh pages were a third).
    A stack's layers are contiguous views of its buffer."""
    first = target.parts[0]
    shape = first.abstract.shape
    by_box: dict[tuple, tuple[tuple[slice, ...], list]] = {}
    for device, index in first.abstract.sharding.addressable_devices_indices_map(shape).items():
        box = tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))
        by_box.setdefault(box, (tuple(slice(*b) for b in box), []))[1].append(device)
    n = len(target.parts)
    lead = [n] if target.stacked else []
    reads = []
    for box, (index, devices) in by_box.items():
        host = aligned_empty(lead + [stop - start for start, stop in box], first.stored_dtype)
        write = _write(host, store[(slice(0, n), *index) if target.stacked else index])
        reads += [_Read(j, write, host[j] if target.stacked else host, devices) for j in range(n)]
    return reads


def _write(host: np.ndarray, source: ts.TensorStore) -> ts.WriteFutures:
    """Starts reading `source` (its domain moved to the origin) into `host`."""
    if source.rank:
        source = source.translate_to[(0,) * source.rank]
    return ts.array(host, copy=False, write=True).write(source)


def _place(group: Sequence[tuple[Target, list[_Read]]]) -> list[jax.Array]:
    """Every part of the group's targets on its devices (in order), all shards in one batched
    `device_put`."""
    hosts, devices, counts = [], [], []
    for target, reads in group:
        by_part: list[list[_Read]] = [[] for _ in target.parts]
        for read in reads:
            try:
                read.future.result()
            except Exception as e:
                raise StoredStateError(
                    f"stored {target.label} cannot be read: {_first_line(e)}"
                ) from None
            by_part[read.part].append(read)
        for part, part_reads in zip(target.parts, by_part, strict=True):
            for read in part_reads:
                # The stored values viewed as the bits the cache holds: no copy.
                hosts += [read.host.view(part.abstract.dtype)] * len(read.devices)
                devices += read.devices
            counts.append((part, sum(len(read.devices) for read in part_reads)))
    shards = iter(jax.device_put(hosts, devices))
    return [
        jax.make_array_from_single_device_arrays(
            p.abstract.shape, p.abstract.sharding, list(itertools.islice(shards, n))
        )
        for p, n in counts
    ]


def _first_line(e: BaseException) -> str:
    """TensorStore's message without the full spec it appends (hundreds of characters)."""
    text = str(e).strip().split(" [tensorstore_spec=")[0]
    return text.splitlines()[0] if text else type(e).__name__
