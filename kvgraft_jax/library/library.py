"""A library of verified knowledge: immutable artifacts named by root digest, plus a catalog.

    DIR/artifacts/<root>/   one committed artifact per deposit (`store/writer.py`), never changed
                            (or ARTIFACTS/<root>/ on a bucket: `--library_artifacts=gs://...`)
    DIR/catalog.sqlite      the catalog (`catalog.py`): keys, texts, verifiers, roots
    DIR/library.json        where the artifacts live, fixed when the library is created

A deposit commits the artifact first, then adds its items to the catalog in one transaction. A
crash between the two leaves an artifact without rows, which `reindex` picks up; a row without
its artifact cannot happen. `reindex` rebuilds every row from the manifests alone.

    lib = library.Library("runs/library")
    outcome = lib.deposit(engine_for, tok, [item], model=..., versions=..., chunk_size=64)
                                         # engine_for(tokens) -> an engine with room for them
    match = lib.route("What is 17 * 23?", model_fingerprint, threshold=0.8)
    lib.artifact_path(match.item.root)   # graft this, at its own positions
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging
from etils import epath

from kvgraft_jax.core import atomic, faults
from kvgraft_jax.core import model as model_lib
from kvgraft_jax.library import catalog, verifiers
from kvgraft_jax.store import chain as chain_lib
from kvgraft_jax.store import errors, files, signing
from kvgraft_jax.store import manifest as manifest_lib

ARTIFACTS = "artifacts"
CATALOG = "catalog.sqlite"
SETTINGS = "library.json"
FORMAT = "kvgraft-library/1"


class LibraryError(RuntimeError):
    pass


_ROOT = re.compile(r"[0-9a-f]{64}")


def _same_place(a, b) -> bool:
    a, b = os.fspath(a), os.fspath(b)
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.abspath(a) == os.path.abspath(b)


def _artifacts_location(directory: Path, requested: str) -> epath.Path:
    """Where this library's artifacts live: recorded at creation, then fixed."""
    record = directory / SETTINGS
    wanted = str(files.as_path(requested)) if requested else ""
    if record.exists():
        try:
            recorded = json.loads(record.read_text())["artifacts"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise LibraryError(f"{record} is unreadable ({e}); restore or delete it") from None
        if wanted and wanted != str(_resolve(directory, recorded)):
            raise LibraryError(
                f"library {directory} keeps its artifacts at {recorded}, not {wanted}; drop "
                "--library_artifacts or use another --library"
            )
    else:
        recorded = wanted or ARTIFACTS  # the default is relative: the library can move
        text = json.dumps({"format": FORMAT, "artifacts": recorded}, indent=1) + "\n"
        if not atomic.create_file(record, text):  # a concurrent creator won: read its record
            return _artifacts_location(directory, requested)
    return _resolve(directory, recorded)


def _resolve(directory: Path, recorded: str) -> epath.Path:
    if "://" in recorded or os.path.isabs(recorded):
        return files.as_path(recorded)
    return files.as_path(directory / recorded)


def item_text(problem: str, solution: str, answer: str) -> str:
    """How one verified item reads inside an artifact: problem, solution, then the answer line.

    (Measured on Gemma 3 270M: with this order a grafted "Problem: ...\nAnswer:" query copied the
    verified answer for 9 of 10 seeded items; with the answer placed before the solution, 3.)
    """
    return f"Problem: {problem.strip()}\nSolution: {solution.strip()}\nAnswer: {answer.strip()}\n"


@dataclasses.dataclass(frozen=True)
class VerifiedItem:
    """A problem, its verified solution text and the verifier's verdict; ready to deposit."""

    item_id: str
    problem: str
    answer: str
    text: str  # `item_text(...)`
    verdict: verifiers.Verdict

    def knowledge(self) -> manifest_lib.KnowledgeItem:
        return manifest_lib.KnowledgeItem(
            item_id=self.item_id,
            key=catalog.normalize_key(self.problem),
            problem=self.problem,
            answer=self.answer,
            text=self.text,
            verifier=self.verdict.verifier,
            reason=self.verdict.reason,
            evidence=self.verdict.evidence_json(),
        )


@dataclasses.dataclass(frozen=True)
class DepositOutcome:
    root: str | None  # None when every item was already in the catalog (nothing deposited)
    path: str | None
    added: list[str]  # item ids newly in the catalog
    duplicates: list[str]  # item ids whose key the catalog already held
    tokens: int
    prefill_s: float
    write_s: float


@dataclasses.dataclass(frozen=True)
class LibraryStats:
    """What the library holds for one model, and how that compares with what one query attends."""

    items: int
    artifacts: int
    tokens_stored: int  # positions over all artifacts
    largest_artifact_tokens: int


@dataclasses.dataclass(frozen=True)
class ReindexReport:
    artifacts: int  # committed artifacts found
    items: int  # catalog rows after the rebuild
    skipped: list[str]  # directories not taken, each with why (uncommitted, corrupt, no knowledge)


class Library(contextlib.AbstractContextManager):
    """A catalog on the local filesystem (SQLite needs one for its locks) and its artifacts.

    The artifacts live in `DIR/artifacts` or at any location `--library_artifacts` names (a
    `gs://` bucket, another disk); the first open records that location in `DIR/library.json`,
    so later runs find it without the flag and a different one is refused.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        artifacts: str | os.PathLike = "",
        rebuild_unusable_catalog: bool = False,
        signer: signing.Signer | None = None,
        trusted_keys: signing.TrustedKeys | None = None,
    ):
        text = os.fspath(directory)
        if "://" in text:
            raise LibraryError(
                f"--library={text}: the catalog is an SQLite file and needs a local directory; "
                "keep it local and put the artifacts on object storage with "
                "--library_artifacts=gs://..."
            )
        self.directory = Path(text).absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.artifacts = _artifacts_location(self.directory, os.fspath(artifacts))
        self.artifacts.mkdir(parents=True, exist_ok=True)
        self.signer = signer  # signs every artifact this library deposits
        self.trusted_keys = trusted_keys  # grafts from this library require their signature
        try:
            self.catalog = catalog.Catalog(self.directory / CATALOG)
        except catalog.CatalogError:
            if not rebuild_unusable_catalog:
                raise
            # Reindex only: the artifacts are the source of truth; keep the damaged file aside.
            aside = self.directory / f"{CATALOG}.unusable-{int(time.time())}"
            for suffix in ("", "-wal", "-shm"):
                old = self.directory / (CATALOG + suffix)
                if old.exists():
                    old.rename(aside.with_name(aside.name + suffix))
            logging.warning("catalog %s was unusable; moved aside to %s", CATALOG, aside)
            self.catalog = catalog.Catalog(self.directory / CATALOG)

    def close(self) -> None:
        self.catalog.close()

    def __exit__(self, *exc) -> None:
        self.close()

    def artifact_path(self, root: str) -> epath.Path:
        """Where the artifact of `root` lives. A catalog value is untrusted: only a 64-hex root
        names an artifact, so no row can point outside the library."""
        if not isinstance(root, str) or not _ROOT.fullmatch(root):
            raise LibraryError(f"catalog root {root!r:.80} is not a 64-hex digest: refused")
        return self.artifacts / root

    def chain(self, root: str) -> list[chain_lib.Link]:
        """The prefix chain of the artifact `root`, checked to be what the catalog promised: its
        last link's root is `root`, and every link is an artifact of this library named by its
        own root (a parent path in a manifest cannot lead outside the library's store)."""
        links = chain_lib.resolve_chain(self.artifact_path(root))
        if links[-1].manifest.root != root:
            raise errors.CorruptArtifactError(
                f"{self.artifact_path(root)} holds root {links[-1].manifest.root[:16]}, the catalog "
                f"row names {root[:16]}: refused"
            )
        for link in links:
            if not _same_place(link.path, self.artifact_path(link.manifest.root)):
                raise errors.CorruptArtifactError(
                    f"{self.artifact_path(root)}: chain link {link.path} is not this library's "
                    f"artifact {link.manifest.root[:16]}: refused"
                )
        return links

    # -- deposit ---------------------------------------------------------------------------

    def deposit(
        self,
        engine_for: Callable[[int], Any],
        tok,
        items: Sequence[VerifiedItem],
        *,
        model: model_lib.ModelInfo,
        versions: dict[str, str],
        chunk_size: int,
        compact: bool = True,
        source: str = "",
    ) -> DepositOutcome:
        """Deposits verified items as one artifact (a chapter when several), then catalogs them.

        `engine_for(n)` gives an engine (position offset 0) with at least n cache slots. Items
        whose key the catalog already holds for this model are not deposited again, unless that
        row was recorded as a wrong route for the key.
        """
        from kvgraft_jax.exact import deposit

        fresh, duplicates = [], []
        for item in items:
            key = catalog.normalize_key(item.problem)
            held = self.catalog.get(key, model.fingerprint)
            # A key whose item was found to be a wrong route takes a newly verified item.
            if held is not None and held.root not in self.catalog.wrong_routes(
                key, model.fingerprint
            ):
                duplicates.append(item.item_id)
            else:
                fresh.append(item)
        if not fresh:
            return DepositOutcome(None, None, [], duplicates, 0, 0.0, 0.0)
        text = "".join(item.text for item in fresh)
        encoded = tok.encode(text, add_bos=True)  # an artifact starts at position 0
        eng = engine_for(len(encoded))
        ids = np.asarray([encoded] * eng.kv_shape.batch_size, np.int32)
        started = time.perf_counter()
        result = deposit.deposit(
            eng,
            ids,
            chunk_size=chunk_size,
            path=self.artifact_path,
            model=model,
            tokenizer=tok.info(),
            versions=versions,
            text=text,
            source=source,
            compact=compact,
            knowledge=manifest_lib.Knowledge(text, [item.knowledge() for item in fresh]),
            signer=self.signer,
        )
        deposit_s = time.perf_counter() - started
        faults.pause_point("library_before_catalog")
        rows = _catalog_items(self.directory, result.path, result.manifest)
        added_flags = self.catalog.add(rows)
        added = [row.item_id for row, ok in zip(rows, added_flags, strict=True) if ok]
        # A concurrent depositor may have cataloged the same key first: the first one wins.
        duplicates += [row.item_id for row, ok in zip(rows, added_flags, strict=True) if not ok]
        return DepositOutcome(
            result.root,
            str(result.path),
            added,
            duplicates,
            int(ids.shape[1]),
            result.prefill_s,
            deposit_s - result.prefill_s,
        )

    def reject(self, item_id: str, problem: str, verdict: verifiers.Verdict, source: str) -> None:
        logging.info("rejected %s (%s): %s", item_id, verdict.verifier, verdict.reason)
        self.catalog.reject(
            catalog.Rejection(
                item_id, problem, verdict.verifier, verdict.reason, verdict.evidence_json(), source
            )
        )

    # -- read ------------------------------------------------------------------------------

    def route(self, problem: str, model_fingerprint: str, *, threshold: float):
        return self.catalog.route(problem, model_fingerprint, threshold=threshold)

    def stats(self, model_fingerprint: str) -> LibraryStats:
        items = self.catalog.items(model_fingerprint)
        per_root = {item.root: item.artifact_tokens for item in items}
        stored = 0
        for root in per_root:
            manifest = manifest_lib.read_manifest(self.artifact_path(root))
            stored += manifest.length
        return LibraryStats(
            items=len(items),
            artifacts=len(per_root),
            tokens_stored=stored,
            largest_artifact_tokens=max(per_root.values(), default=0),
        )

    def reindex(self) -> ReindexReport:
        """Rebuilds the catalog's item rows from the committed manifests alone."""
        rows, skipped, found = [], [], 0
        quarantined = self.catalog.quarantined()
        for path in sorted(self.artifacts.iterdir(), key=lambda p: p.name):
            if not path.is_dir():
                continue
            try:
                manifest = manifest_lib.read_manifest(path)
            except errors.ArtifactError as e:
                skipped.append(f"{path.name}: {type(e).__name__}: {e}")
                continue
            found += 1
            if manifest.knowledge is None:
                skipped.append(f"{path.name}: no knowledge items in its manifest")
                continue
            if path.name != manifest.root:
                skipped.append(f"{path.name}: named differently from its root {manifest.root}")
                continue
            if manifest.root in quarantined:
                # Back in the catalog only once every byte of every file verifies again.
                try:
                    files.verify_files(path, manifest, every_file=True)
                except errors.ArtifactError as e:
                    skipped.append(f"{path.name}: quarantined ({quarantined[manifest.root]}): {e}")
                    continue
                self.catalog.release(manifest.root)
            rows.extend(_catalog_items(self.directory, path, manifest))
        count = self.catalog.replace_all(rows)
        return ReindexReport(found, count, skipped)


def _catalog_items(
    directory: Path, path, manifest: manifest_lib.Manifest
) -> list[catalog.CatalogItem]:
    where = os.fspath(path)
    # Relative to the library where it lies inside it (the library can move), else as given.
    inside = "://" not in where and Path(where).is_relative_to(directory)
    relative = os.path.relpath(where, directory) if inside else where
    return [
        catalog.CatalogItem(
            key=k.key,
            item_id=k.item_id,
            problem=k.problem,
            answer=k.answer,
            text=k.text,
            verifier=k.verifier,
            evidence=k.evidence,
            root=manifest.root,
            artifact=relative,
            model_fingerprint=manifest.model.fingerprint,
            tokenizer_fingerprint=manifest.tokenizer.fingerprint if manifest.tokenizer else None,
            artifact_tokens=manifest.end_position,
            parent=manifest.parent,
            created=manifest.provenance.created,
        )
        for k in manifest.knowledge.items
    ]
