"""An artifact's files on disk: where they are, how they are listed and hashed, and checked.

Layout of a committed artifact directory (local or any `etils.epath` path, e.g. `gs://`):

    state/          Orbax PyTree checkpoint (OCDBT, zarr3) of the KV arrays sliced to the used length
    manifest.json   what the state is (`manifest.py`)
    COMMITTED       written last: the root digest and the manifest's SHA-256

Orbax keeps no checksum of its data files, so the manifest records every file's size and SHA-256
and `verify_files` checks them before a restore reads any array.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
from etils import epath

from kvgraft_jax.core import digest
from kvgraft_jax.store.errors import CorruptArtifactError

if TYPE_CHECKING:
    from kvgraft_jax.store.manifest import Manifest

STATE_DIR = "state"
MANIFEST = "manifest.json"
COMMIT_MARKER = "COMMITTED"
# A deposit stages under `.NAME` + this + a token beside its target, renamed into place at commit.
STAGING_INFIX = ".kvgraft-staging-"
COMMIT_BY_MARKER_ENV = "KVGRAFT_COMMIT_BY_MARKER"


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One file of `state/`: Orbax does not checksum its data files, and some it never reads."""

    path: str  # relative to the artifact directory
    size: int
    sha256: str


def as_path(path: str | os.PathLike) -> epath.Path:
    """Local paths made absolute (Orbax's OCDBT refuses relative ones); URLs kept as they are."""
    text = os.fspath(path)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def atomic_rename_supported(path: epath.Path) -> bool:
    """Local filesystems rename directories atomically; object stores (gs://, s3://) do not.

    `KVGRAFT_COMMIT_BY_MARKER=1` takes the object-store path on a local path too: for mounts
    without atomic directory rename (gcsfuse, some NFS) and for testing that path here.
    """
    return "://" not in str(path) and os.environ.get(COMMIT_BY_MARKER_ENV, "") in ("", "0")


def walk_files(directory: epath.Path) -> list[epath.Path]:
    """Every file under `directory`, sorted by path. On local disk anything but a directory or a
    regular file (a symlink, a FIFO, a device) is refused before it is opened: reading one could
    hang or read without end."""
    if "://" in os.fspath(directory):
        out = []
        for child in sorted(directory.iterdir(), key=lambda p: p.name):
            out.extend(walk_files(child) if child.is_dir() else [child])
        return out
    return [epath.Path(p) for p in _local_files(os.fspath(directory))]


def _local_files(directory: str) -> list[str]:
    """`walk_files` on local disk with `os.scandir`, whose entries carry their type (lstat's):
    a restore lists its state in a tenth of the time `epath` takes, one `stat` per file. With a
    stack, not recursion: a forged state nested thousands of directories deep is refused as an
    unexpected file, not a RecursionError."""
    out: list[str] = []
    pending = [directory]
    while pending:
        with os.scandir(pending.pop()) as scan:
            entries = sorted(scan, key=lambda e: e.name)
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
            elif entry.is_file(follow_symlinks=False):
                out.append(entry.path)
            else:
                raise CorruptArtifactError(
                    f"{entry.path} is not a regular file or directory (a symlink, FIFO or device): "
                    "refused"
                )
    return sorted(out, key=lambda p: p.split(os.sep))  # a directory's files at its name's place


def size_of(path: epath.Path) -> int:
    local = os.fspath(path)
    return os.stat(local).st_size if "://" not in local else path.stat().length


def hash_file(path: epath.Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def file_inventory(
    artifact_dir: str | os.PathLike, *, workers: int | None = None
) -> list[FileEntry]:
    """Size and SHA-256 of every file under `state/`, hashed on a thread pool."""
    base = as_path(artifact_dir)
    return inventory(base, walk_files(base / STATE_DIR), workers)


def inventory(base: epath.Path, files: Sequence[epath.Path], workers: int | None):
    if workers == 1:
        hashed = [hash_file(f) for f in files]
    else:
        hashed = list(digest.thread_pool(workers or os.cpu_count() or 1).map(hash_file, files))
    return [
        FileEntry(relative(base, f), size, sha)
        for f, (size, sha) in zip(files, hashed, strict=True)
    ]


def relative(base: epath.Path, f: epath.Path) -> str:
    return str(f)[len(str(base)) + 1 :]


def is_data_file(relative: str) -> bool:
    """OCDBT data files (`.../d/<hash>`) hold the array chunks and the B-tree nodes."""
    return relative.split("/")[-2:-1] == ["d"]


def verify_files(
    path: str | os.PathLike,
    manifest: Manifest,
    *,
    every_file: bool = False,
    workers: int | None = None,
) -> None:
    """Refuses a missing, extra or resized file under `state/`, or a changed metadata file.

    OCDBT data files (array chunks and B-tree nodes) are only size-checked unless `every_file`:
    a restore reads the bytes in them that it uses and verifies those in the same pass, against
    the canonical digests (chunks) and TensorStore's CRC-32C (nodes), instead of hashing them
    twice. A data file can also hold bytes that nothing reads (superseded B-tree nodes); damage
    there cannot reach a graft, and `every_file` (inspect) finds it too. On several processes
    each hashes every `process_count`-th file.
    """
    path = as_path(path)
    files = walk_files(path / STATE_DIR)
    found = {relative(path, f): f for f in files}
    recorded = {f.path: f for f in manifest.files}
    missing = sorted(set(recorded) - set(found))
    extra = sorted(set(found) - set(recorded))
    if missing:
        raise CorruptArtifactError(
            f"{path}: {len(missing)} state file(s) missing, e.g. {missing[0]}"
        )
    if extra:
        raise CorruptArtifactError(f"{path}: unexpected file(s) in the state, e.g. {extra[0]}")
    for name, f in found.items():
        size, want = size_of(f), recorded[name].size
        if size != want:
            raise CorruptArtifactError(
                f"{path}: {name} has {size} bytes, {want} were written (truncated or appended)"
            )
    hashed = [f for name, f in found.items() if every_file or not is_data_file(name)]
    share = hashed[jax.process_index() :: jax.process_count()]
    # Without `every_file` these are a handful of small metadata files: hashed here, as the
    # pool's hand-offs cost more than the hashing.
    for got in inventory(path, share, workers if every_file else 1):
        want = recorded[got.path]
        if got.sha256 != want.sha256:
            raise CorruptArtifactError(
                f"{path}: {got.path} changed since the deposit (SHA-256 {got.sha256[:16]} vs {want.sha256[:16]})"
            )


def is_committed(path: str | os.PathLike) -> bool:
    path = as_path(path)
    return (path / COMMIT_MARKER).exists() and (path / MANIFEST).exists()


def is_artifact_shaped(path: epath.Path) -> bool:
    """Holds nothing but what a deposit writes (so removing it loses nothing of the user's)."""
    return {child.name for child in path.iterdir()} <= {STATE_DIR, MANIFEST, COMMIT_MARKER}


def remove_tree(path: epath.Path) -> None:
    if path.exists():
        if atomic_rename_supported(path):
            shutil.rmtree(os.fspath(path))
        else:
            path.rmtree()
