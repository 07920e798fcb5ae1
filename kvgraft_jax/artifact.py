"""KV artifacts on disk: write with an atomic commit, read back onto any mesh, refuse anything doubtful.

Layout of a committed artifact directory (local or any `etils.epath` path, e.g. `gs://`):

    state/          Orbax PyTree checkpoint (OCDBT, zarr3) of the KV arrays sliced to the used length
    manifest.json   what the state is (model, tokenizer, positions, schedule, digests, root, ...)
    COMMITTED       written last: the root digest and the manifest's SHA-256

On a local filesystem everything is written under a hidden staging name beside the target and
renamed into place, so nothing is visible before the commit. Where rename is not atomic (object
stores), the files are written in place and readers accept the directory only once `COMMITTED`
exists and names this manifest. Orbax keeps no checksum of array data, so restore reads the arrays
with TensorStore (`verified_read.py`), recomputes the canonical digests (`digest.py`) from the
placed shards in the same pass and refuses any mismatch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import secrets
import shutil
import stat
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh

from kvgraft_jax import digest, kvstate, multihost, signing, verified_read

FORMAT = "kvgraft-artifact/1"
STATE_DIR = "state"
MANIFEST = "manifest.json"
COMMIT_MARKER = "COMMITTED"
_STAGING_INFIX = ".kvgraft-staging-"
COMMIT_BY_MARKER_ENV = "KVGRAFT_COMMIT_BY_MARKER"
# Test hook: stop (SIGKILL-able) at a named point of the write. Never set in normal use.
_PAUSE_ENV = "KVGRAFT_TEST_PAUSE_AT"


class ArtifactError(Exception):
    """Base of every refusal; the CLI prints its one-line message and exits non-zero."""


class ArtifactNotFoundError(ArtifactError):
    pass


class UncommittedArtifactError(ArtifactError):
    pass


class ArtifactExistsError(ArtifactError):
    pass


class CorruptArtifactError(ArtifactError):
    """Missing, truncated, flipped or edited files: the bytes are not what was deposited."""


class IncompatibleArtifactError(ArtifactError):
    """A sound artifact that does not belong to this model, tokenizer, format or shape."""


class UntrustedArtifactError(ArtifactError):
    """Not signed by a key the reader trusts (`--trusted_keys`)."""


# -------------------------------------------------------------------------------------------
# The manifest


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    name: str
    config: dict[str, Any]
    fingerprint: str  # SHA-256 over the config and every parameter (model.weights_fingerprint)


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    kind: str
    vocab_size: int
    fingerprint: str


@dataclasses.dataclass(frozen=True)
class Protocol:
    """How the state was computed: what a bit-exact recompute must replay."""

    chunk_size: int
    schedule: list[list[int]]  # [start, length] per prefill chunk
    batch_size: int
    cache_dtype: str
    attention: str  # gemma's einsum attention with an explicit mask
    mesh: str  # the producing mesh (informational: restore works on any mesh)
    versions: dict[str, str]
    xla_flags: str


@dataclasses.dataclass(frozen=True)
class ArrayEntry:
    name: str  # "layer_3/k"
    shape: list[int]
    dtype: str
    logical_axes: list[str]
    block_shape: list[int]
    digest: str


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One file of `state/`: Orbax does not checksum its data files, and some it never reads."""

    path: str  # relative to the artifact directory
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Provenance:
    text_sha256: str
    created: str  # UTC, ISO 8601
    source: str = ""
    verifier: str = ""
    evidence: str = ""


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


@dataclasses.dataclass(frozen=True)
class KnowledgeItem:
    """One verified item an artifact holds (a library deposit): enough to rebuild its catalog row."""

    item_id: str
    key: str  # normalised problem
    problem: str
    answer: str
    text: str  # the item's own text inside the artifact's text
    verifier: str
    reason: str
    evidence: str  # JSON


@dataclasses.dataclass(frozen=True)
class Knowledge:
    """What a library artifact knows: its whole text and the verified items in it (a chapter holds
    several)."""

    text: str
    items: list[KnowledgeItem]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Knowledge:
        return cls(data["text"], [KnowledgeItem(**item) for item in data["items"]])


def _plain(value: Any) -> Any:
    """`dataclasses.asdict` without its deep copy of every leaf, which made hashing a long
    manifest (8,192 token ids) cost milliseconds on every restore. Same output for JSON values."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclasses.dataclass(frozen=True)
class Manifest:
    format: str
    model: ModelInfo
    tokenizer: TokenizerInfo | None
    token_ids: list[list[int]]  # per batch row
    first_position: int
    last_position: int
    length: int
    parent: str | None
    protocol: Protocol
    arrays: list[ArrayEntry]
    root: str
    files: list[FileEntry]
    provenance: Provenance
    # Where the parent artifact was, relative to this one (or absolute for object stores): a hint
    # only; the parent is accepted by its root digest (`parent`), never by its path.
    parent_path: str | None = None
    compaction: Compaction | None = None  # None: every layer stores every position
    knowledge: Knowledge | None = None  # library deposits: the verified items (omitted otherwise)

    @property
    def end_position(self) -> int:
        """One past the last position: the length of the whole chain up to this artifact."""
        return self.last_position + 1

    def to_json(self) -> dict[str, Any]:
        out = _plain(self)
        if out["knowledge"] is None:
            del out["knowledge"]  # manifests written before the library keep their SHA-256
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        try:
            data = dict(data)
            tok = data.get("tokenizer")
            return cls(
                **{
                    **data,
                    "model": ModelInfo(**data["model"]),
                    "tokenizer": TokenizerInfo(**tok) if tok else None,
                    "protocol": Protocol(**data["protocol"]),
                    "arrays": [ArrayEntry(**a) for a in data["arrays"]],
                    "files": [FileEntry(**f) for f in data["files"]],
                    "provenance": Provenance(**data["provenance"]),
                    "compaction": Compaction(**data["compaction"])
                    if data.get("compaction")
                    else None,
                    "knowledge": Knowledge.from_json(data["knowledge"])
                    if data.get("knowledge")
                    else None,
                }
            )
        except (KeyError, TypeError) as e:
            raise CorruptArtifactError(f"manifest does not have the {FORMAT} fields: {e}") from None

    def canonical_bytes(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    def sha256(self) -> str:
        return hashlib.sha256(self.canonical_bytes()).hexdigest()


# -------------------------------------------------------------------------------------------
# Arrays: names, logical axes and canonical blocks of a KV state


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
    """Canonical digests and root of a KV state, hashed shard by shard on every core."""
    arrays = state_arrays(state)
    return digest.digest_arrays(
        arrays, _block_shapes(arrays, state.shape.head_dim), workers=workers
    )


def _block_shapes(names, head_dim: int) -> dict[str, tuple[int, ...]]:
    return {name: _block_shape(name.split("/")[1], head_dim) for name in names}


def _state_tree(state: kvstate.KVState) -> dict[str, dict[str, jax.Array]]:
    return kvstate.layers_to_gemma(state.layers)


def used_slice(state: kvstate.KVState, mesh: Mesh, *, start: int = 0) -> kvstate.KVState:
    """Slots `start..length-1` of the state, in the rules' sharding for that shorter shape.

    `start > 0` cuts the new positions of a prefix-chain child off its parent's; the result's
    `length` is the number of slots kept.
    """
    length = state.length - start
    if length < 1 or start < 0:
        raise ArtifactError(
            f"nothing to deposit: slots {start}..{state.length - 1} of a state of {state.length}"
        )
    shape = dataclasses.replace(state.shape, cache_length=length)
    out = shape.shardings(mesh)

    def cut(layers):
        return tuple(
            kvstate.LayerKV(
                k=layer.k[:, start : start + length],
                v=layer.v[:, start : start + length],
                positions=layer.positions[:, start : start + length],
                end_index=layer.end_index,
            )
            for layer in layers
        )

    return kvstate.KVState(jax.jit(cut, out_shardings=out)(state.layers), length)


def compact(state: kvstate.KVState, compaction: Compaction, mesh: Mesh) -> kvstate.KVState:
    """The arrays an artifact stores: local layers' k/v cut to `kept_from..` (ragged layers)."""
    if not compaction.kept_from:
        return state
    full = state.shape
    short = dataclasses.replace(full, cache_length=state.length - compaction.kept_from)
    short_shardings = short.shardings(mesh)[0]
    local = set(compaction.local_layers)

    def cut(layers):
        return tuple(
            dataclasses.replace(
                layer,
                k=layer.k[:, compaction.kept_from :],
                v=layer.v[:, compaction.kept_from :],
            )
            if i in local
            else layer
            for i, layer in enumerate(layers)
        )

    out = tuple(
        dataclasses.replace(s, k=short_shardings.k, v=short_shardings.v) if i in local else s
        for i, s in enumerate(full.shardings(mesh))
    )
    return kvstate.KVState(jax.jit(cut, out_shardings=out)(state.layers), state.length)


def _expand(layers, shape: kvstate.KVShape, compaction: Compaction, mesh: Mesh):
    """Zero-fills the slots a compacted artifact dropped, back to the uniform KV state."""
    program = _expand_program(shape, tuple(compaction.local_layers), compaction.kept_from, mesh)
    return program(layers)


def stored_offsets(manifest: Manifest, num_layers: int) -> tuple[int, ...]:
    """Per layer, the slot its stored K/V start at: `kept_from` for compacted local layers."""
    c = manifest.compaction
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


def _stored_abstract(shape: kvstate.KVShape, compaction: Compaction | None, mesh: Mesh):
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


# -------------------------------------------------------------------------------------------
# Paths and commit


def _path(path: str | os.PathLike) -> epath.Path:
    """Local paths made absolute (Orbax's OCDBT refuses relative ones); URLs kept as they are."""
    text = os.fspath(path)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def _atomic_rename_supported(path: epath.Path) -> bool:
    """Local filesystems rename directories atomically; object stores (gs://, s3://) do not.

    `KVGRAFT_COMMIT_BY_MARKER=1` takes the object-store path on a local path too: for mounts
    without atomic directory rename (gcsfuse, some NFS) and for testing that path here.
    """
    return "://" not in str(path) and os.environ.get(COMMIT_BY_MARKER_ENV, "") in ("", "0")


def _pause_point(name: str) -> None:
    if os.environ.get(_PAUSE_ENV) == name:
        print(f"KVGRAFT_PAUSED {name}", flush=True)
        time.sleep(3600)


def _walk_files(directory: epath.Path) -> list[epath.Path]:
    """Every file under `directory`. On local disk anything but a directory or a regular file (a
    symlink, a FIFO, a device) is refused before it is opened: reading one could hang or read
    without end."""
    out = []
    for child in sorted(directory.iterdir(), key=lambda p: p.name):
        local = "://" not in os.fspath(child)
        if local:
            mode = os.lstat(os.fspath(child)).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise CorruptArtifactError(
                    f"{child} is not a regular file or directory (a symlink, FIFO or device): refused"
                )
        out.extend(_walk_files(child) if child.is_dir() else [child])
    return out


def _hash_file(path: epath.Path) -> tuple[int, str]:
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
    base = _path(artifact_dir)
    return _inventory(base, _walk_files(base / STATE_DIR), workers)


def _inventory(base: epath.Path, files: Sequence[epath.Path], workers: int | None):
    hashed = list(digest.thread_pool(workers or os.cpu_count() or 1).map(_hash_file, files))
    return [
        FileEntry(_relative(base, f), size, sha)
        for f, (size, sha) in zip(files, hashed, strict=True)
    ]


def _relative(base: epath.Path, f: epath.Path) -> str:
    return str(f)[len(str(base)) + 1 :]


def _is_data_file(relative: str) -> bool:
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
    path = _path(path)
    files = _walk_files(path / STATE_DIR)
    found = {_relative(path, f): f for f in files}
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
        size, want = f.stat().length, recorded[name].size
        if size != want:
            raise CorruptArtifactError(
                f"{path}: {name} has {size} bytes, {want} were written (truncated or appended)"
            )
    hashed = [f for name, f in found.items() if every_file or not _is_data_file(name)]
    share = hashed[jax.process_index() :: jax.process_count()]
    for got in _inventory(path, share, workers):
        want = recorded[got.path]
        if got.sha256 != want.sha256:
            raise CorruptArtifactError(
                f"{path}: {got.path} changed since the deposit (SHA-256 {got.sha256[:16]} vs {want.sha256[:16]})"
            )


def is_committed(path: str | os.PathLike) -> bool:
    path = _path(path)
    return (path / COMMIT_MARKER).exists() and (path / MANIFEST).exists()


def _is_artifact_shaped(path: epath.Path) -> bool:
    """Holds nothing but what a deposit writes (so removing it loses nothing of the user's)."""
    return {child.name for child in path.iterdir()} <= {STATE_DIR, MANIFEST, COMMIT_MARKER}


def _remove(path: epath.Path) -> None:
    if path.exists():
        if _atomic_rename_supported(path):
            shutil.rmtree(os.fspath(path))
        else:
            path.rmtree()


def write(
    path: str | os.PathLike,
    state: kvstate.KVState,
    manifest: Manifest,
    *,
    overwrite: bool = False,
    compression: bool = False,
    signer: signing.Signer | None = None,
) -> epath.Path:
    """Writes `state` (already sliced to its used length) with its manifest, committed atomically.
    A `signer` signs the manifest's SHA-256 in the commit marker (`signing`).

    The same content at the same path is a no-op; different content is refused unless `overwrite`.
    Chunks are stored uncompressed unless `compression` (Orbax's zstd): Gemma 3 270M K/V shrank
    by about a fifth with zstd, but decoding it doubled a verified restore's time here, and a
    restore is the operation kvgraft exists to make cheap. Either kind restores the same way.
    """
    path = _path(path)
    if is_committed(path):
        existing = read_manifest(path)
        if (
            existing.root == manifest.root
            and existing.model.fingerprint == manifest.model.fingerprint
        ):
            return path
        if not overwrite:
            raise ArtifactExistsError(
                f"{path} already holds a different artifact (root {existing.root[:16]}, this one "
                f"{manifest.root[:16]}); pass --overwrite to replace it"
            )
    elif path.exists() and any(path.iterdir()):
        leftover = not _atomic_rename_supported(path) and _is_artifact_shaped(path)
        if not (overwrite or leftover):  # an interrupted in-place deposit may be replaced
            raise ArtifactExistsError(
                f"{path} exists and is not an artifact; refusing to write there"
            )

    atomic = _atomic_rename_supported(path)
    # Every process must stage under the same name: process 0's random token, broadcast.
    token = multihost.broadcast_int(secrets.randbits(32))
    staging = path.parent / f".{path.name}{_STAGING_INFIX}{token:08x}" if atomic else path

    def stage() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not atomic:
            # No rename: the files go in place, so first clear an uncommitted leftover (or, with
            # overwrite, the old artifact); its COMMITTED marker goes first, so no reader ever
            # takes a half-removed directory for an artifact.
            (path / COMMIT_MARKER).unlink(missing_ok=True)
            _remove(path)
        staging.mkdir(parents=True, exist_ok=False)

    try:
        multihost.on_primary(f"staging {staging}", stage, error=ArtifactError)
        checkpointer = ocp.PyTreeCheckpointer(
            use_ocdbt=True, use_zarr3=True, use_compression=compression
        )
        # Each process writes only its own shards; Orbax joins them.
        checkpointer.save(staging / STATE_DIR, args=ocp.args.PyTreeSave(_state_tree(state)))
        _pause_point("after_state")
        multihost.on_primary(
            f"committing {path}",
            lambda: _commit(staging, path, manifest, atomic=atomic, signer=signer),
            error=ArtifactError,
        )
    except BaseException:
        if atomic and multihost.is_primary():
            shutil.rmtree(os.fspath(staging), ignore_errors=True)
        raise
    return path


def _commit(
    staging: epath.Path,
    path: epath.Path,
    manifest: Manifest,
    *,
    atomic: bool,
    signer: signing.Signer | None,
) -> None:
    """Process 0: the file inventory, the manifest, the commit marker, then the rename."""
    manifest = dataclasses.replace(manifest, files=file_inventory(staging))
    (staging / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1, sort_keys=True))
    _pause_point("after_manifest")
    marker: dict[str, Any] = {"root": manifest.root, "manifest_sha256": manifest.sha256()}
    if signer is not None:
        marker["signature"] = signer.sign(manifest.sha256())
    (staging / COMMIT_MARKER).write_text(json.dumps(marker, sort_keys=True))
    _pause_point("before_rename")
    if not atomic:
        return  # the marker, written last, is the commit
    if path.exists():
        trash = path.parent / f".{path.name}{_STAGING_INFIX}old-{uuid.uuid4().hex[:12]}"
        os.rename(os.fspath(path), os.fspath(trash))
        os.rename(os.fspath(staging), os.fspath(path))
        shutil.rmtree(os.fspath(trash), ignore_errors=True)
        return
    try:
        os.rename(os.fspath(staging), os.fspath(path))
    except OSError:
        # Another depositor committed here first. Same content: a no-op; else refuse.
        if not is_committed(path):
            raise
        winner = read_manifest(path)
        if winner.root != manifest.root:
            raise ArtifactExistsError(
                f"{path}: a concurrent deposit committed a different artifact "
                f"(root {winner.root[:16]}) first"
            ) from None
        shutil.rmtree(os.fspath(staging), ignore_errors=True)


def read_manifest(path: str | os.PathLike) -> Manifest:
    """The manifest of a committed artifact, checked against its commit marker."""
    path = _path(path)
    if not path.exists():
        raise ArtifactNotFoundError(f"no artifact at {path}")
    if not path.is_dir():
        raise ArtifactNotFoundError(f"{path} is a file, not an artifact directory")
    if _STAGING_INFIX in path.name:
        raise UncommittedArtifactError(
            f"{path} is the staging directory of a deposit that never committed; deposit again "
            "(it is safe to delete)"
        )
    if not (path / COMMIT_MARKER).exists():
        raise UncommittedArtifactError(
            f"{path} has no {COMMIT_MARKER} marker: an interrupted or in-progress deposit; deposit again"
        )
    if not (path / MANIFEST).exists():
        raise CorruptArtifactError(f"{path}: {MANIFEST} is missing")
    try:
        for name in (COMMIT_MARKER, MANIFEST):
            local = os.fspath(path / name)
            if "://" not in local and not stat.S_ISREG(os.lstat(local).st_mode):
                raise CorruptArtifactError(f"{path}: {name} is not a regular file: refused")
            size = (path / name).stat().length
            if size > MAX_MANIFEST_BYTES:
                raise CorruptArtifactError(
                    f"{path}: {name} has {size} bytes, more than any manifest ({MAX_MANIFEST_BYTES})"
                )
        marker = json.loads((path / COMMIT_MARKER).read_text())
        data = json.loads((path / MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, OSError) as e:
        raise CorruptArtifactError(
            f"{path}: unreadable {MANIFEST} or {COMMIT_MARKER}: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(marker, dict):
        raise CorruptArtifactError(f"{path}: {COMMIT_MARKER} is not a commit record")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise IncompatibleArtifactError(f"{path}: format {found!r}, this build reads {FORMAT!r}")
    manifest = Manifest.from_json(data)
    _check_types(path, manifest)
    _check_positions(path, manifest)
    if marker.get("manifest_sha256") != manifest.sha256() or marker.get("root") != manifest.root:
        raise CorruptArtifactError(
            f"{path}: {MANIFEST} does not match the one committed (SHA-256 "
            f"{manifest.sha256()[:16]} vs {str(marker.get('manifest_sha256'))[:16]}): it was edited "
            "or damaged after the deposit"
        )
    entries_root = digest.root(
        [
            digest.ArrayDigest(a.name, a.dtype, tuple(a.shape), tuple(a.block_shape), a.digest)
            for a in manifest.arrays
        ]
    )
    if entries_root != manifest.root:
        raise CorruptArtifactError(f"{path}: the array digests do not give the manifest's root")
    return manifest


# -------------------------------------------------------------------------------------------
# Prefix chains: a child stores only the positions it adds on top of its parent

MAX_CHAIN = 1024


@dataclasses.dataclass(frozen=True)
class Link:
    path: epath.Path
    manifest: Manifest


def parent_hint(child: str | os.PathLike, parent: str | os.PathLike) -> str:
    """How a child's manifest points at its parent: a relative path on local disk, else absolute."""
    child_s, parent_s = os.fspath(child), os.fspath(parent)
    if "://" in child_s or "://" in parent_s:
        return parent_s
    return os.path.relpath(os.path.abspath(parent_s), os.path.abspath(child_s))


def _scheme(location: str) -> str:
    return location.split("://", 1)[0] if "://" in location else "file"


def _parent_location(path: epath.Path, hint: str) -> epath.Path:
    """Where a child's manifest says its parent is. A parent on another scheme than its child (a
    local artifact naming gs://...) is refused before anything is opened there."""
    if _scheme(hint) != _scheme(os.fspath(path)):
        raise CorruptArtifactError(
            f"{path}: its parent is recorded at {hint!r:.120}, on another storage scheme than the "
            "artifact itself: refused (parent and child move together)"
        )
    if "://" in hint or os.path.isabs(hint):
        return epath.Path(hint)
    return epath.Path(os.path.normpath(os.path.join(os.fspath(path), hint)))


def resolve_chain(path: str | os.PathLike) -> list[Link]:
    """The artifact and its ancestors, root first; each parent accepted only by its root digest.

    Checks that the links are contiguous (each child starts one past its parent's last position)
    and were computed alike (model, tokenizer, batch size, cache dtype).
    """
    chain = [Link(_path(path), read_manifest(path))]
    while chain[-1].manifest.parent is not None:
        child = chain[-1]
        if len(chain) >= MAX_CHAIN:
            raise CorruptArtifactError(f"{path}: prefix chain longer than {MAX_CHAIN} links")
        if not child.manifest.parent_path:
            raise ArtifactNotFoundError(
                f"{child.path} extends parent root {child.manifest.parent[:16]} but does not say "
                "where it is"
            )
        where = _parent_location(child.path, child.manifest.parent_path)
        try:
            parent = read_manifest(where)
        except ArtifactNotFoundError:
            raise ArtifactNotFoundError(
                f"{child.path} extends parent root {child.manifest.parent[:16]}, expected at "
                f"{where}: not found (move parent and child together, or deposit again)"
            ) from None
        if parent.root != child.manifest.parent:
            raise IncompatibleArtifactError(
                f"{child.path} extends parent root {child.manifest.parent[:16]}, but {where} holds "
                f"root {parent.root[:16]}: the parent was replaced after the child was deposited"
            )
        chain.append(Link(where, parent))
    chain.reverse()
    _check_chain(chain)
    return chain


def _check_chain(chain: Sequence[Link]) -> None:
    first = chain[0]
    if first.manifest.first_position != 0:
        raise CorruptArtifactError(
            f"{first.path}: the root of a chain must start at position 0, it starts at "
            f"{first.manifest.first_position}"
        )
    for parent, child in itertools.pairwise(chain):
        p, c = parent.manifest, child.manifest
        if c.first_position != p.end_position:
            raise CorruptArtifactError(
                f"{child.path} starts at position {c.first_position}, its parent {parent.path} "
                f"ends at {p.last_position}: not contiguous"
            )
        for what, have, want in (
            ("model weights", c.model.fingerprint, p.model.fingerprint),
            ("model", c.model.name, p.model.name),
            ("tokenizer", c.tokenizer, p.tokenizer),
            ("batch size", c.protocol.batch_size, p.protocol.batch_size),
            ("cache dtype", c.protocol.cache_dtype, p.protocol.cache_dtype),
        ):
            if have != want:
                raise IncompatibleArtifactError(
                    f"{child.path}: {what} differs from its parent {parent.path}: {have} vs {want}"
                )


# -------------------------------------------------------------------------------------------
# Compatibility and restore


@dataclasses.dataclass(frozen=True)
class Expected:
    """What the reading side runs; any difference is refused before a byte of state is read."""

    model_name: str | None = None
    model_config: Mapping[str, Any] | None = None
    model_fingerprint: str | None = None
    tokenizer_fingerprint: str | None = None
    cache_dtype: str | None = None
    trusted_keys: signing.TrustedKeys | None = None  # require a signature by one of them


def check_compatible(manifest: Manifest, expected: Expected, *, where: str = "artifact") -> None:
    def refuse(what: str, have: Any, want: Any) -> None:
        raise IncompatibleArtifactError(
            f"{where}: {what} differs: artifact has {have}, this run has {want}"
        )

    if expected.model_name is not None and manifest.model.name != expected.model_name:
        refuse("model", manifest.model.name, expected.model_name)
    if expected.model_config is not None and manifest.model.config != dict(expected.model_config):
        diff = sorted(
            k
            for k in set(manifest.model.config) | set(expected.model_config)
            if manifest.model.config.get(k) != expected.model_config.get(k)
        )
        refuse(
            f"model config ({', '.join(diff)})",
            {k: manifest.model.config.get(k) for k in diff},
            {k: expected.model_config.get(k) for k in diff},
        )
    if (
        expected.model_fingerprint is not None
        and manifest.model.fingerprint != expected.model_fingerprint
    ):
        refuse(
            "weights fingerprint", manifest.model.fingerprint[:16], expected.model_fingerprint[:16]
        )
    if expected.tokenizer_fingerprint is not None:
        have = manifest.tokenizer.fingerprint if manifest.tokenizer else None
        if have != expected.tokenizer_fingerprint:
            refuse(
                "tokenizer fingerprint", (have or "none")[:16], expected.tokenizer_fingerprint[:16]
            )
    if expected.cache_dtype is not None and manifest.protocol.cache_dtype != expected.cache_dtype:
        refuse("cache dtype", manifest.protocol.cache_dtype, expected.cache_dtype)


MAX_MANIFEST_BYTES = 64 << 20  # a manifest of a million token ids is ~8 MB
_DTYPES = {"bfloat16", "float16", "float32", "int32"}


def signature_of(path: str | os.PathLike) -> dict[str, str] | None:
    """The signature record in a committed artifact's marker, if it has one."""
    marker = json.loads((_path(path) / COMMIT_MARKER).read_text())
    return marker.get("signature") if isinstance(marker, dict) else None


def check_signature(
    path: str | os.PathLike, manifest: Manifest, trusted: signing.TrustedKeys
) -> None:
    """Refuses an artifact not signed by a trusted key, before any array is read."""
    problem = trusted.problem(manifest.sha256(), signature_of(path))
    if problem is not None:
        raise UntrustedArtifactError(f"{_path(path)}: refused: {problem}")


def _check_types(path: epath.Path, manifest: Manifest) -> None:
    """Every number a restore sizes anything from is an int, every dtype one a KV state has."""

    def is_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    m, p = manifest, manifest.protocol
    bad = [
        name
        for name, value in (
            ("first_position", m.first_position),
            ("last_position", m.last_position),
            ("length", m.length),
            ("protocol.chunk_size", p.chunk_size),
            ("protocol.batch_size", p.batch_size),
        )
        if not is_int(value)
    ]
    if not isinstance(m.token_ids, list) or not all(
        isinstance(row, list) and all(is_int(t) for t in row) for row in m.token_ids
    ):
        bad.append("token_ids")
    if not isinstance(p.schedule, list):
        bad.append("protocol.schedule")
    for a in m.arrays:
        if not (isinstance(a.shape, list) and all(is_int(x) and x >= 0 for x in a.shape)):
            bad.append(f"arrays[{a.name!r:.40}].shape")
        if a.dtype not in _DTYPES:
            bad.append(f"arrays[{a.name!r:.40}].dtype {a.dtype!r:.40}")
    for f in m.files:
        if not (is_int(f.size) and f.size >= 0 and isinstance(f.path, str)):
            bad.append(f"files[{f.path!r:.40}]")
    if bad:
        raise CorruptArtifactError(
            f"{path}: manifest fields of the wrong type: {', '.join(bad[:5])}"
        )


def _check_positions(path: epath.Path, manifest: Manifest) -> None:
    """The positions, the tokens and the schedule a manifest states must agree, before anything is
    sized from them (a forged `last_position` must not size a cache)."""
    m, p = manifest, manifest.protocol
    problems = []
    if m.length < 1 or m.first_position < 0 or p.chunk_size < 1:
        problems.append(
            f"length {m.length}, first position {m.first_position}, chunk size {p.chunk_size}"
        )
    elif m.last_position != m.first_position + m.length - 1:
        problems.append(
            f"last position {m.last_position} != first {m.first_position} + length {m.length} - 1"
        )
    else:
        if len(m.token_ids) != p.batch_size or any(len(row) != m.length for row in m.token_ids):
            problems.append(f"token ids are not {p.batch_size} rows of {m.length}")
        expected_schedule = [
            [start, min(p.chunk_size, m.end_position - start)]
            for start in range(m.first_position, m.end_position, p.chunk_size)
        ]
        if p.schedule != expected_schedule:
            problems.append(f"schedule {str(p.schedule)[:80]} is not chunks of {p.chunk_size}")
    if problems:
        raise CorruptArtifactError(f"{path}: manifest does not add up: {'; '.join(problems)}")


def _check_shape_against_model(shape: kvstate.KVShape, config: Mapping[str, Any], where) -> None:
    """The stored arrays must be this model's KV state (layers, KV heads, head size)."""
    model_has = {
        "layers": len(config.get("attention_types") or ()) or None,
        "KV heads": config.get("num_kv_heads"),
        "head size": config.get("head_dim"),
    }
    stored = {
        "layers": shape.num_layers,
        "KV heads": shape.num_kv_heads,
        "head size": shape.head_dim,
    }
    for what, want in model_has.items():
        if want is not None and stored[what] != want:
            raise IncompatibleArtifactError(
                f"{where}: stored {what} {stored[what]}, the model has {want}"
            )


def _shape_from_manifest(manifest: Manifest) -> kvstate.KVShape:
    by_name = {a.name: a for a in manifest.arrays}
    num_layers = len({a.name.split("/")[0] for a in manifest.arrays})
    expected = {f"layer_{i}/{f}" for i in range(num_layers) for f in kvstate.LAYER_AXES}
    if set(by_name) != expected:
        raise CorruptArtifactError(
            f"manifest arrays {sorted(set(by_name) ^ expected)[:4]} do not form a {num_layers}-layer KV state"
        )
    k = by_name["layer_0/k"]
    shape = kvstate.KVShape(
        num_layers=num_layers,
        batch_size=k.shape[0],
        cache_length=by_name["layer_0/positions"].shape[1],  # never compacted
        num_kv_heads=k.shape[2],
        head_dim=k.shape[3],
        dtype=k.dtype,
    )
    compaction = manifest.compaction
    if compaction is not None and (
        compaction.kept_from != max(0, shape.cache_length - compaction.window)
        or not set(compaction.local_layers) <= set(range(num_layers))
    ):
        raise CorruptArtifactError(f"manifest compaction {compaction} does not fit the state")
    for name, (want_shape, want_dtype) in (
        (f"layer_{i}/{f}", sd) for i in range(num_layers) for f, sd in shape.array_shapes().items()
    ):
        entry = by_name[name]
        if compaction is not None and len(want_shape) == 4:
            want_shape = (
                want_shape[0],
                compaction.stored_length(name, shape.cache_length),
                *want_shape[2:],
            )
        if tuple(entry.shape) != tuple(want_shape) or entry.dtype != str(want_dtype):
            raise CorruptArtifactError(
                f"manifest entry {name}: {entry.dtype}{entry.shape} does not fit the KV state "
                f"{want_dtype}{list(want_shape)}"
            )
    if shape.cache_length != manifest.length:
        raise CorruptArtifactError(
            f"manifest length {manifest.length} differs from the stored arrays' {shape.cache_length}"
        )
    return shape


@dataclasses.dataclass(frozen=True)
class Restored:
    manifest: Manifest
    # cache_length == manifest.length, in the target mesh's sharding; a compacted artifact's
    # dropped slots are zeros (with expand=False: its local layers as stored).
    state: kvstate.KVState
    restore_s: float  # reading and placing every array (and hashing, where overlapped)
    verify_s: float  # the file check, plus the hashing still running after the last array landed
    root: str  # recomputed from the restored shards (equals manifest.root, or restore raised)


def restore(
    path: str | os.PathLike,
    mesh: Mesh,
    *,
    expected: Expected | None = None,
    workers: int | None = None,
    expand: bool = True,
    every_file: bool = False,
    overlap: bool | None = None,
) -> Restored:
    """Restores onto `mesh` and re-verifies every digest; raises an `ArtifactError` on any doubt.

    Each array is hashed from its placed device shards (`verified_read`; overlapping the reads
    of the next arrays where there are cores to spare). `expand=False` leaves a compacted artifact's local layers as
    stored (their last `window` positions, from slot `compaction.kept_from`), for a caller that
    places them itself: a graft writes them straight into its zero cache, with no zero-filled
    copy in between. `every_file` also hashes every byte of every state file, read or not (see
    `verify_files`): inspect's full check. `overlap`: see `verified_read.read_and_hash`.
    """
    path = _path(path)
    manifest = read_manifest(path)
    if expected is not None:
        check_compatible(manifest, expected, where=str(path))
        if expected.trusted_keys is not None:
            check_signature(path, manifest, expected.trusted_keys)
    shape = _shape_from_manifest(manifest)
    if expected is not None and expected.model_config is not None:
        _check_shape_against_model(shape, expected.model_config, str(path))
    started = time.perf_counter()
    multihost.agree(
        f"checking {path}'s files",
        lambda: verify_files(path, manifest, every_file=every_file, workers=workers),
        error=CorruptArtifactError,
    )
    files_s = time.perf_counter() - started

    abstract = kvstate.layers_to_gemma(_stored_abstract(shape, manifest.compaction, mesh))
    blocks = _block_shapes([a.name for a in manifest.arrays], shape.head_dim)
    wanted = verified_read.targets(abstract, blocks)
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
        layers = _expand(state.layers, shape, manifest.compaction, mesh)
        state = kvstate.KVState(jax.block_until_ready(layers), manifest.length)
        restore_s += time.perf_counter() - started
    return Restored(manifest, state, restore_s, verify_s, root)


def _read(path: epath.Path, wanted, hasher: digest.BlockHasher, overlap) -> dict[str, jax.Array]:
    try:
        placed = verified_read.read_and_hash(path / STATE_DIR, wanted, hasher, overlap=overlap)
        return jax.block_until_ready(placed)
    except verified_read.StoredStateError as e:
        raise CorruptArtifactError(f"{path}: {e}") from None


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
