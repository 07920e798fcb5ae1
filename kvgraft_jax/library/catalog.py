"""The library's catalog: an SQLite database (FTS5 for text search) mapping knowledge to artifacts.

One row per verified item: its normalised key, problem, answer, text, verifier and evidence, token
counts, the root digest of the artifact that holds it (several items share one artifact when it
is a chapter), the parent root and the created time. Rejections are kept in their own table. The
artifacts stay the source of truth: every item row is also in its artifact's manifest, so
`Library.reindex` (`--mode=reindex`) recreates the rows from them alone (`replace_all`).

Writers use `BEGIN IMMEDIATE` transactions on a WAL database with a busy timeout, so several
depositing processes serialise their inserts and lose nothing; a key already present is left as
it is (the first verified item wins).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import random
import re
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from kvgraft_jax.library import verifiers

SCHEMA_VERSION = "1"
_TERM = re.compile(r"\w+")
# What makes two problems the same problem beyond their words: numbers in order, the operators and
# signs between them, and the unit after a number ("3 km" is not "3 miles").
_IDENTITY = re.compile(
    r"(\d+(?:[.,]\d+)*)|([^\W\d_]+)|([-+*/\u00d7\u00f7^%=<>\u221a!$\u20ac\u00a3])"
)
_OPERATOR_WORDS = frozenset(
    {
        "plus",
        "minus",
        "times",
        "multiplied",
        "divided",
        "over",
        "product",
        "sum",
        "difference",
        "quotient",
        "squared",
        "cubed",
        "power",
        "root",
        "percent",
        "more",
        "less",
        "fewer",
        "half",
        "double",
        "twice",
        "triple",
        "negative",
        "remainder",
        "modulo",
    }
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS items(
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL,
    item_id TEXT NOT NULL,
    problem TEXT NOT NULL,
    answer TEXT NOT NULL,
    text TEXT NOT NULL,
    verifier TEXT NOT NULL,
    evidence TEXT NOT NULL,
    root TEXT NOT NULL,
    artifact TEXT NOT NULL,
    model_fingerprint TEXT NOT NULL,
    tokenizer_fingerprint TEXT,
    artifact_tokens INTEGER NOT NULL,
    parent TEXT,
    created TEXT NOT NULL,
    UNIQUE(key, model_fingerprint)
);
CREATE INDEX IF NOT EXISTS items_root ON items(root);
CREATE VIRTUAL TABLE IF NOT EXISTS items_fts USING fts5(
    key, text, content='items', content_rowid='id'
);
CREATE TRIGGER IF NOT EXISTS items_ai AFTER INSERT ON items BEGIN
    INSERT INTO items_fts(rowid, key, text) VALUES (new.id, new.key, new.text);
END;
CREATE TRIGGER IF NOT EXISTS items_ad AFTER DELETE ON items BEGIN
    INSERT INTO items_fts(items_fts, rowid, key, text) VALUES ('delete', old.id, old.key, old.text);
END;
CREATE TABLE IF NOT EXISTS wrong_routes(
    key TEXT NOT NULL,
    root TEXT NOT NULL,
    model_fingerprint TEXT NOT NULL,
    item_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    created TEXT NOT NULL,
    PRIMARY KEY(key, root, model_fingerprint)
);
CREATE TABLE IF NOT EXISTS quarantine(
    root TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    created TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS rejections(
    id INTEGER PRIMARY KEY,
    item_id TEXT NOT NULL,
    key TEXT NOT NULL,
    problem TEXT NOT NULL,
    verifier TEXT NOT NULL,
    reason TEXT NOT NULL,
    evidence TEXT NOT NULL,
    source TEXT NOT NULL,
    created TEXT NOT NULL
);
"""


# Removes the row holding a key when its route was found wrong for that key (the delete trigger
# keeps FTS5 in step); the item about to be inserted then takes the key.
_DROP_WRONG = (
    "DELETE FROM items WHERE key=? AND model_fingerprint=? AND root IN "
    "(SELECT root FROM wrong_routes WHERE key=? AND model_fingerprint=?)"
)


class CatalogError(RuntimeError):
    pass


def normalize_key(problem: str) -> str:
    """The catalog key of a problem: normalised text (case, Unicode form, whitespace)."""
    return verifiers.normalize_text(problem)


def _terms(text: str) -> list[str]:
    return _TERM.findall(normalize_key(text))


def identity(text: str) -> tuple[str, ...]:
    """The parts of a problem a search match must share exactly, in order: numbers (with the unit
    word after each), operators and signs, and operator words. "10 + 3" is not "10 - 3", "3 + 10",
    "10 + 4" or "10 plus 3"."""
    parts: list[str] = []
    after_number = False
    for number, word, operator in _IDENTITY.findall(normalize_key(text)):
        if number:
            parts.append(number.replace(",", ""))
        elif operator or word in _OPERATOR_WORDS or after_number:
            parts.append(operator or word)
        after_number = bool(number)
    return tuple(parts)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


@dataclasses.dataclass(frozen=True)
class CatalogItem:
    """One verified item and the artifact that holds it."""

    key: str
    item_id: str
    problem: str
    answer: str
    text: str  # the item's own text inside the artifact
    verifier: str
    evidence: str  # JSON
    root: str
    artifact: str  # path relative to the library directory
    model_fingerprint: str
    tokenizer_fingerprint: str | None
    artifact_tokens: int  # positions of the artifact's whole chain
    parent: str | None
    created: str


@dataclasses.dataclass(frozen=True)
class Rejection:
    item_id: str
    problem: str
    verifier: str
    reason: str
    evidence: str
    source: str  # "dataset" (seeding) or "solve" (an attempt of the flywheel)


@dataclasses.dataclass(frozen=True)
class Match:
    """The one item a query was routed to, and how."""

    item: CatalogItem
    how: str  # "exact" (normalised key) or "search" (FTS5, scored)
    score: float  # 1.0 for exact; Jaccard similarity of the terms for search


_ITEM_COLUMNS = [f.name for f in dataclasses.fields(CatalogItem)]


class Catalog(contextlib.AbstractContextManager):
    """An SQLite catalog file; one connection per instance (not shared across threads)."""

    def __init__(self, path: str | Path, *, timeout_s: float = 60.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None)
            _require_fts5(self._db)
            _use_wal(self._db, timeout_s)
            self._db.execute("PRAGMA synchronous=FULL")
            self._create()
        except sqlite3.Error as e:
            raise CatalogError(
                f"{self.path} cannot be used ({type(e).__name__}: {e}); --mode=reindex moves it "
                "aside and rebuilds the catalog from the artifacts"
            ) from None

    def _create(self) -> None:
        with self.transaction():
            for statement in _split_statements(_SCHEMA):
                self._db.execute(statement)
            found = self._db.execute("SELECT value FROM meta WHERE name='schema'").fetchone()
            if found is None:
                self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
            elif found[0] != SCHEMA_VERSION:
                raise CatalogError(
                    f"{self.path}: catalog schema {found[0]}, this build reads {SCHEMA_VERSION}; "
                    "--mode=reindex moves it aside and rebuilds the catalog from the artifacts"
                )

    def close(self) -> None:
        self._db.close()

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken before any read (no upgrade deadlocks between writers).
        SQLite's own errors (locked past the timeout, a file damaged under us) become one
        `CatalogError` naming the file."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise CatalogError(f"{self.path}: {type(e).__name__}: {e}") from None
        try:
            yield self._db
        except BaseException as e:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
            if isinstance(e, sqlite3.Error):
                raise CatalogError(f"{self.path}: {type(e).__name__}: {e}") from None
            raise
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error as e:
            raise CatalogError(f"{self.path}: {type(e).__name__}: {e}") from None

    # -- writes ----------------------------------------------------------------------------

    def add(self, items: Sequence[CatalogItem]) -> list[bool]:
        """Inserts items in one transaction; False for a key the catalog already holds. A row whose
        route was recorded wrong for its own key gives way to the new item (it no longer wins)."""
        placeholders = ",".join("?" * len(_ITEM_COLUMNS))
        sql = f"INSERT OR IGNORE INTO items({','.join(_ITEM_COLUMNS)}) VALUES ({placeholders})"
        added = []
        with self.transaction() as db:
            for item in items:
                db.execute(_DROP_WRONG, (item.key, item.model_fingerprint) * 2)
                cursor = db.execute(sql, dataclasses.astuple(item))
                added.append(cursor.rowcount == 1)
        return added

    def reject(self, rejection: Rejection) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO rejections(item_id, key, problem, verifier, reason, evidence, source, "
                "created) VALUES (?,?,?,?,?,?,?,?)",
                (
                    rejection.item_id,
                    normalize_key(rejection.problem),
                    rejection.problem,
                    rejection.verifier,
                    rejection.reason,
                    rejection.evidence,
                    rejection.source,
                    _now(),
                ),
            )

    def record_wrong_route(
        self, problem: str, item: CatalogItem, model_fingerprint: str, reason: str
    ) -> None:
        """`problem` was routed to `item` and the answer grafted from it failed verification: that
        route is never taken again for this problem's key."""
        with self.transaction() as db:
            db.execute(
                "INSERT OR IGNORE INTO wrong_routes VALUES (?,?,?,?,?,?)",
                (
                    normalize_key(problem),
                    item.root,
                    model_fingerprint,
                    item.item_id,
                    reason,
                    _now(),
                ),
            )

    def quarantine(self, root: str, reason: str) -> None:
        """An artifact that failed to restore or verify: never routed to until it verifies again."""
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO quarantine VALUES (?,?,?)", (root, reason, _now()))

    def release(self, root: str) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM quarantine WHERE root=?", (root,))

    def quarantined(self) -> dict[str, str]:
        """Quarantined roots and why."""
        return dict(self._db.execute("SELECT root, reason FROM quarantine").fetchall())

    def wrong_routes(self, key: str, model_fingerprint: str) -> set[str]:
        """Roots that a problem with this key must not be routed to again."""
        rows = self._db.execute(
            "SELECT root FROM wrong_routes WHERE key=? AND model_fingerprint=?",
            (key, model_fingerprint),
        ).fetchall()
        return {row[0] for row in rows}

    def replace_all(self, items: Iterable[CatalogItem]) -> int:
        """Drops every item row and inserts `items`, in one transaction (reindex)."""
        placeholders = ",".join("?" * len(_ITEM_COLUMNS))
        sql = f"INSERT OR IGNORE INTO items({','.join(_ITEM_COLUMNS)}) VALUES ({placeholders})"
        count = 0
        with self.transaction() as db:
            db.execute("DELETE FROM items")
            db.execute("INSERT INTO items_fts(items_fts) VALUES ('rebuild')")
            for item in items:
                db.execute(_DROP_WRONG, (item.key, item.model_fingerprint) * 2)
                count += db.execute(sql, dataclasses.astuple(item)).rowcount
        return count

    # -- reads -----------------------------------------------------------------------------

    def _rows(self, where: str, args: Sequence) -> list[CatalogItem]:
        rows = self._db.execute(
            f"SELECT {','.join(_ITEM_COLUMNS)} FROM items {where}", tuple(args)
        ).fetchall()
        return [CatalogItem(*row) for row in rows]

    def get(self, key: str, model_fingerprint: str) -> CatalogItem | None:
        rows = self._rows("WHERE key=? AND model_fingerprint=?", (key, model_fingerprint))
        return rows[0] if rows else None

    def items(self, model_fingerprint: str | None = None) -> list[CatalogItem]:
        if model_fingerprint is None:
            return self._rows("ORDER BY id", ())
        return self._rows("WHERE model_fingerprint=? ORDER BY id", (model_fingerprint,))

    def rejections(self) -> list[tuple[str, str, str, str]]:
        """(item_id, verifier, reason, source) per rejection, oldest first."""
        return self._db.execute(
            "SELECT item_id, verifier, reason, source FROM rejections ORDER BY id"
        ).fetchall()

    def integrity_ok(self) -> bool:
        """SQLite's integrity check of the file and FTS5's check of the index against the rows."""
        row = self._db.execute("PRAGMA integrity_check").fetchone()
        try:
            self._db.execute("INSERT INTO items_fts(items_fts, rank) VALUES ('integrity-check', 1)")
        except sqlite3.DatabaseError:
            return False
        return row is not None and row[0] == "ok"

    def route(
        self, problem: str, model_fingerprint: str, *, threshold: float, candidates: int = 20
    ) -> Match | None:
        """The one item for `problem`: the exact key first, else the best FTS5 candidate whose
        terms are similar enough (Jaccard >= threshold) and whose `identity` (numbers in order,
        operators, units) is the same. A route recorded as wrong for this key, or to a quarantined
        artifact, is never taken."""
        key = normalize_key(problem)
        wrong = self.wrong_routes(key, model_fingerprint) | set(self.quarantined())
        exact = self.get(key, model_fingerprint)
        if exact is not None and exact.root not in wrong:
            return Match(exact, "exact", 1.0)
        terms = _terms(problem)
        if not terms:
            return None
        query = " OR ".join(f'"{t}"' for t in sorted(set(terms)))
        columns = ",".join(f"items.{c}" for c in _ITEM_COLUMNS)
        rows = self._db.execute(
            f"SELECT {columns} FROM items_fts JOIN items ON items.id = items_fts.rowid "
            "WHERE items_fts MATCH ? AND items.model_fingerprint = ? "
            "ORDER BY bm25(items_fts) LIMIT ?",
            (query, model_fingerprint, candidates),
        ).fetchall()
        wanted, same = set(terms), identity(problem)
        best = None  # (score, item); candidates come best bm25 first, so ties keep the earlier
        for item in (CatalogItem(*row) for row in rows):
            if identity(item.problem) != same or item.root in wrong:
                continue  # another quantity or operation is another problem, however similar
            have = set(_terms(item.problem))
            score = len(wanted & have) / len(wanted | have)
            if best is None or score > best[0]:
                best = (score, item)
        if best is None or best[0] < threshold:
            return None
        return Match(best[1], "search", best[0])


def _use_wal(db: sqlite3.Connection, timeout_s: float) -> None:
    """Switches a catalog to write-ahead logging, waiting up to `timeout_s` for other openers.

    SQLite answers a journal-mode change it cannot lock with SQLITE_BUSY at once (or returns the old
    mode), without calling its busy handler, so processes opening a new catalog together would
    fail; retrying here is what the connection's timeout promises. A catalog still in rollback mode
    at the deadline stays correct (writers serialise on `BEGIN IMMEDIATE` either way), only slower;
    a lock held past the deadline is reported like any other."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if db.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":
                return
            if db.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() == "wal":
                return
            if time.monotonic() >= deadline:
                return
        except sqlite3.OperationalError as e:
            busy = "locked" in str(e) or "busy" in str(e)
            if not busy or time.monotonic() >= deadline:
                raise
        time.sleep(0.005 + 0.02 * random.random())


def _require_fts5(db: sqlite3.Connection) -> None:
    try:
        db.execute("CREATE VIRTUAL TABLE temp._kvgraft_fts5_probe USING fts5(x)")
        db.execute("DROP TABLE temp._kvgraft_fts5_probe")
    except sqlite3.OperationalError:
        raise CatalogError(
            f"SQLite {sqlite3.sqlite_version} in this process has no FTS5. If TensorFlow was "
            "imported before kvgraft_jax, its bundled SQLite took over: import kvgraft_jax first"
        ) from None


def _split_statements(script: str) -> list[str]:
    """Statements of the schema script (triggers keep their inner semicolons)."""
    out, current = [], []
    for line in script.strip().splitlines():
        current.append(line)
        text = "\n".join(current).strip()
        if text.endswith(";") and sqlite3.complete_statement(text):
            out.append(text)
            current = []
    return out
