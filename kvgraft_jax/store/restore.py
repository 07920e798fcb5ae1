"""Restore: an artifact's state read onto any mesh, every digest recomputed, anything doubtful refused.

Orbax keeps no checksum of array data, so restore reads the arrays with TensorStore
(`verified_read.py`), recomputes the canonical digests (`digest.py`) from the placed shards in the
same pass and refuses any mismatch.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
from etils import epath
from jax.sharding import Mesh

from kvgraft_jax.core import compaction, digest, kvstate, multihost
from kvgraft_jax.store import verified_read
from kvgraft_jax.store.chain import Link
from kvgraft_jax.store.errors import ArtifactError, CorruptArtifactError
from kvgraft_jax.store.files import STATE_DIR, as_path, verify_files
from kvgraft_jax.store.layout import block_shapes, stored_arrays
from kvgraft_jax.store.manifest import (
    Expected,
    Manifest,
    check_compatible,
    check_shape_against_model,
    check_signature,
    read_manifest,
    shape_from_manifest,
)


@dataclasses.dataclass(frozen=True)
class Restored:
    manifest: Manifest
    # cache_length == manifest.length, in the target mesh's sharding; a compacted artifact's
    # dropped slots are zeros (with expand=False: its local layers as stored).
    state: kvstate.KVState
    restore_s: float  # reading and placing every array (and hashing, where overlapped)
    verify_s: float  # the file check, plus the hashing still running after the last array landed
    root: str  # recomputed from the restored shards (equals manifest.root, or restore raised)
    # The whole call as a caller waits for it: manifest read and checks (for a path), the file
    # check, reads, hashing and any zero-fill. restore_s + verify_s leave the manifest out.
    total_s: float = 0.0


def restore(
    source: Link | str | os.PathLike,
    mesh: Mesh,
    *,
    expected: Expected | None = None,
    workers: int | None = None,
    expand: bool = True,
    every_file: bool = False,
    overlap: bool | None = None,
) -> Restored:
    """Restores onto `mesh` and re-verifies every digest; raises an `ArtifactError` on any doubt.

    `source` is a resolved chain link (`chain.resolve_chain`), whose manifest was read and checked
    when it was resolved and is not read again, or a path, whose manifest is read here.

    Each array is hashed from its placed device shards (`verified_read`; overlapping the reads
    of the next arrays where there are cores to spare). `expand=False` leaves a compacted artifact's local layers as
    stored (their last `window` positions, from slot `compaction.kept_from`), for a caller that
    places them itself: a graft writes them straight into its zero cache, with no zero-filled
    copy in between. `every_file` also hashes every byte of every state file, read or not (see
    `verify_files`): inspect's full check. `overlap`: see `verified_read.read_and_hash`.
    """
    called = time.perf_counter()
    if isinstance(source, Link):
        path, manifest = source.path, source.manifest
    else:
        path = as_path(source)
        manifest = read_manifest(path)
    if expected is not None:
        check_compatible(manifest, expected, where=str(path))
        if expected.trusted_keys is not None:
            check_signature(path, manifest, expected.trusted_keys)
    shape = shape_from_manifest(manifest)
    if expected is not None and expected.model_config is not None:
        check_shape_against_model(shape, expected.model_config, str(path))
    started = time.perf_counter()
    multihost.agree(
        f"checking {path}'s files",
        lambda: verify_files(path, manifest, every_file=every_file, workers=workers),
        error=CorruptArtifactError,
    )
    files_s = time.perf_counter() - started

    abstract, wanted = stored_targets(manifest, shape, mesh)
    with digest.BlockHasher(workers=workers) as hasher:
        started = time.perf_counter()
        # Each process reads only the shards its devices hold, and hashes them as they land.
        placed = multihost.agree(
            f"restoring {path}",
            lambda: _read(path, wanted, hasher, overlap),
            error=CorruptArtifactError,
        )
        restore_s = time.perf_counter() - started
        started = time.perf_counter()
        multihost.agree(f"hashing {path}", hasher.wait, error=CorruptArtifactError)
        digests, root = hasher.finish()
    verify_s = time.perf_counter() - started + files_s
    layers = kvstate.layers_from_gemma(
        {
            group: {field: placed[f"{group}/{field}"] for field in fields}
            for group, fields in abstract.items()
        }
    )
    state = kvstate.KVState(layers, manifest.length)
    try:
        kvstate.assert_shardings(state, mesh)
    except AssertionError as e:
        raise ArtifactError(f"{path}: restored layout differs from the target: {e}") from None

    recorded = {a.name: a.digest for a in manifest.arrays}
    for d in digests:
        if recorded.get(d.name) != d.digest:
            raise CorruptArtifactError(
                f"{path}: {d.name} restored with SHA-256 {d.digest[:16]}, the manifest records "
                f"{str(recorded.get(d.name))[:16]}: the stored bytes changed since the deposit"
            )
    if root != manifest.root:
        raise CorruptArtifactError(
            f"{path}: restored root {root[:16]} != manifest root {manifest.root[:16]}"
        )
    if expand and manifest.compaction is not None and manifest.compaction.kept_from:
        started = time.perf_counter()
        layers = compaction.expand(state.layers, shape, manifest.compaction, mesh)
        state = kvstate.KVState(jax.block_until_ready(layers), manifest.length)
        restore_s += time.perf_counter() - started
    return Restored(manifest, state, restore_s, verify_s, root, time.perf_counter() - called)


def stored_targets(
    manifest: Manifest, shape: kvstate.KVShape, mesh: Mesh
) -> tuple[dict[str, dict[str, jax.ShapeDtypeStruct]], list[verified_read.Target]]:
    """The per-layer arrays as gemma's cache tree (`{"layer_3": {"k": ...}}`), each in `mesh`'s
    sharding, and the stored arrays holding them as read targets (`layout.stored_arrays`, by the
    manifest's format): what a restore reads, and a benchmark reads the same way."""
    abstract = kvstate.layers_to_gemma(compaction.stored_abstract(shape, manifest.compaction, mesh))
    by_name = {
        f"{group}/{field}": a for group, fields in abstract.items() for field, a in fields.items()
    }
    blocks = block_shapes(by_name, shape.head_dim)
    stored = stored_arrays({n: (a.shape, a.dtype) for n, a in by_name.items()}, manifest.storage)
    return abstract, verified_read.targets(stored, by_name, blocks)


def _read(path: epath.Path, wanted, hasher: digest.BlockHasher, overlap) -> dict[str, jax.Array]:
    try:
        placed = verified_read.read_and_hash(path / STATE_DIR, wanted, hasher, overlap=overlap)
        return jax.block_until_ready(placed)
    except verified_read.StoredStateError as e:
        raise CorruptArtifactError(f"{path}: {e}") from None
