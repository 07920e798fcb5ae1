"""The manifest: what an artifact's state is, read back only when it matches its commit marker.

A manifest records the model, tokenizer, token ids, positions, the chunk schedule and program that
computed the state (the exactness contract, `exact/contract.py`), every array's canonical digest,
the Merkle root and every state file's SHA-256. `read_manifest` checks all of it adds up before
anything is sized from it; `check_compatible` refuses a manifest for another model or tokenizer.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import stat
from collections.abc import Mapping
from typing import Any

from etils import epath

from kvgraft_jax.core import digest, kvstate
from kvgraft_jax.core.compaction import Compaction
from kvgraft_jax.core.model import ModelInfo
from kvgraft_jax.core.tokenizer import TokenizerInfo
from kvgraft_jax.store import signing
from kvgraft_jax.store.errors import (
    ArtifactNotFoundError,
    CorruptArtifactError,
    IncompatibleArtifactError,
    UncommittedArtifactError,
    UntrustedArtifactError,
)
from kvgraft_jax.store.files import (
    COMMIT_MARKER,
    MANIFEST,
    STAGING_INFIX,
    FileEntry,
    as_path,
)


class StateStorage(enum.Enum):
    """How `state/` packs the per-layer arrays (`layout.stored_arrays`); the format says which."""

    PER_LAYER = "per_layer"  # one stored array per layer and field, as gemma's cache names them
    STACKED = "stacked"  # per field, the layers of one shape stacked on a leading axis


FORMAT = "kvgraft-artifact/2"  # what a deposit writes
# Every format this build reads; the manifest is the same, only `state/`'s packing differs.
READABLE_FORMATS: Mapping[str, StateStorage] = {
    "kvgraft-artifact/1": StateStorage.PER_LAYER,
    FORMAT: StateStorage.STACKED,
}
MAX_MANIFEST_BYTES = 64 << 20  # a manifest of a million token ids is ~8 MB
_DTYPES = {"bfloat16", "float16", "float32", "int32"}


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
class Provenance:
    text_sha256: str
    created: str  # UTC, ISO 8601
    source: str = ""
    verifier: str = ""
    evidence: str = ""


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


_JSON_LEAVES = frozenset({int, float, str, bool, type(None)})


def _plain(value: Any) -> Any:
    """`dataclasses.asdict` without its deep copy of every leaf, which made hashing a long
    manifest (8,192 token ids) cost milliseconds on every restore. Same output for JSON values.
    A leaf in a list is taken as it is without a call (4 of a restore's 5 ms were this walk)."""
    if type(value) in _JSON_LEAVES:
        return value
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [v if type(v) in _JSON_LEAVES else _plain(v) for v in value]
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
    def storage(self) -> StateStorage:
        """How `state/` packs the arrays (`read_manifest` accepts only a readable format)."""
        return READABLE_FORMATS[self.format]

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


# The commit marker's key for the SHA-256 of the manifest file's bytes.
MANIFEST_FILE_SHA256 = "manifest_file_sha256"


def _canonical_sha256(data: Any) -> str:
    return hashlib.sha256(
        json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def read_manifest(path: str | os.PathLike) -> Manifest:
    """The manifest of a committed artifact, checked against its commit marker."""
    path = as_path(path)
    if not path.exists():
        raise ArtifactNotFoundError(f"no artifact at {path}")
    if not path.is_dir():
        raise ArtifactNotFoundError(f"{path} is a file, not an artifact directory")
    if STAGING_INFIX in path.name:
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
        raw = (path / MANIFEST).read_bytes()
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, OSError) as e:
        raise CorruptArtifactError(
            f"{path}: unreadable {MANIFEST} or {COMMIT_MARKER}: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(marker, dict):
        raise CorruptArtifactError(f"{path}: {COMMIT_MARKER} is not a commit record")
    found = data.get("format") if isinstance(data, dict) else type(data).__name__
    if not isinstance(found, str) or found not in READABLE_FORMATS:
        raise IncompatibleArtifactError(
            f"{path}: format {found!r:.80}, this build reads {' and '.join(map(repr, READABLE_FORMATS))}"
        )
    manifest = Manifest.from_json(data)
    _check_types(path, manifest)
    _check_positions(path, manifest)
    committed = marker.get("manifest_sha256")
    # The committed SHA-256 is of the dataclasses' canonical JSON; the marker also records the
    # file's bytes as written. Where they hash to that, the file is the one committed and nothing
    # is serialised again (0.5 ms at 8,192 tokens). Else (an artifact from before, or a manifest
    # rewritten) the file's canonical JSON, then the dataclasses', must hash to the committed
    # SHA-256 (a key they drop, like a null `knowledge`, passes).
    same = (
        marker.get(MANIFEST_FILE_SHA256) == hashlib.sha256(raw).hexdigest()
        or committed == _canonical_sha256(data)
        or committed == manifest.sha256()
    )
    if not same or marker.get("root") != manifest.root:
        raise CorruptArtifactError(
            f"{path}: {MANIFEST} does not match the one committed (SHA-256 "
            f"{manifest.sha256()[:16]} vs {str(committed)[:16]}): it was edited "
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


@dataclasses.dataclass(frozen=True)
class Expected:
    """What the reading side runs; any difference is refused before a byte of state is read."""

    model_name: str | None = None
    model_config: Mapping[str, Any] | None = None
    model_fingerprint: str | None = None
    tokenizer_fingerprint: str | None = None
    cache_dtype: str | None = None
    trusted_keys: signing.TrustedKeys | None = None  # require a signature by one of them

    @classmethod
    def of(
        cls,
        model: ModelInfo,
        tokenizer: TokenizerInfo | None,
        *,
        cache_dtype: str | None = None,
        trusted_keys: signing.TrustedKeys | None = None,
    ) -> Expected:
        """What a run with this model and tokenizer accepts: the same model, config, weights and
        tokenizer (no tokenizer: only artifacts deposited without one)."""
        return cls(
            model_name=model.name,
            model_config=model.config,
            model_fingerprint=model.fingerprint,
            tokenizer_fingerprint=tokenizer.fingerprint if tokenizer else None,
            cache_dtype=cache_dtype,
            trusted_keys=trusted_keys,
        )


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


def signature_of(path: str | os.PathLike) -> dict[str, str] | None:
    """The signature record in a committed artifact's marker, if it has one."""
    marker = json.loads((as_path(path) / COMMIT_MARKER).read_text())
    return marker.get("signature") if isinstance(marker, dict) else None


def check_signature(
    path: str | os.PathLike, manifest: Manifest, trusted: signing.TrustedKeys
) -> None:
    """Refuses an artifact not signed by a trusted key, before any array is read."""
    problem = trusted.problem(manifest.sha256(), signature_of(path))
    if problem is not None:
        raise UntrustedArtifactError(f"{as_path(path)}: refused: {problem}")


def _check_types(path: epath.Path, manifest: Manifest) -> None:
    """Every number a restore sizes anything from is an int, every dtype one a KV state has."""

    def is_int(x) -> bool:
        return type(x) is int  # JSON gives no subclass of int but bool, which is not a number

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
    # Types collected in C (`map`), not tested per id in Python: 8,192 ids took 0.3 ms.
    if not isinstance(m.token_ids, list) or not all(
        isinstance(row, list) and set(map(type, row)) <= {int} for row in m.token_ids
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


def check_shape_against_model(shape: kvstate.KVShape, config: Mapping[str, Any], where) -> None:
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


def shape_from_manifest(manifest: Manifest) -> kvstate.KVShape:
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
        (f"layer_{i}/{f}", sd)
        for i in range(num_layers)
        for f, sd in shape.array_shapes(values=True).items()
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
