"""Prefix chains: a child artifact stores only the positions it adds on top of its parent.

`resolve_chain` reads an artifact's manifest and its ancestors', root first; a parent is accepted by
its root digest, never by its path, and the links must be contiguous and computed alike.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence

from etils import epath

from kvgraft_jax.store.errors import (
    ArtifactNotFoundError,
    CorruptArtifactError,
    IncompatibleArtifactError,
)
from kvgraft_jax.store.files import as_path
from kvgraft_jax.store.manifest import Manifest, read_manifest

MAX_CHAIN = 1024


@dataclasses.dataclass(frozen=True)
class Link:
    """One artifact of a chain. `manifest` is what `read_manifest` returned for `path` (checked
    against its commit marker): a restore from a link trusts it and does not read it again, and
    still refuses any state byte that differs from its digests."""

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
    chain = [Link(as_path(path), read_manifest(path))]
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


def as_links(source: Sequence[Link] | str | os.PathLike) -> tuple[Link, ...]:
    """A chain already resolved, as is; a path, resolved (each manifest read and checked once)."""
    if isinstance(source, str | os.PathLike):
        return tuple(resolve_chain(source))
    links = tuple(source)
    if not links or not all(isinstance(link, Link) for link in links):
        raise TypeError("expected an artifact path or the links resolve_chain returned")
    return links
