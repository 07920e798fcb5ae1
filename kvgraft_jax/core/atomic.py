"""Files and directories that appear whole or not at all, on a local filesystem.

Everything is written under a hidden name beside its target, then renamed (or linked) into place:
a crash leaves at most a hidden leftover, never a half-written file under the real name. (An
artifact's commit, `store/writer.py`, follows the same rule across processes and object stores,
with its own marker; this module serves the single-process writers.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


def _hidden_beside(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _write(path: Path, data: str | bytes) -> None:
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)


def replace_file(target: str | os.PathLike, data: str | bytes) -> None:
    """Writes `target` whole; a concurrent writer's version or this one wins, never a mix."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _hidden_beside(target, "tmp")
    try:
        _write(tmp, data)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def create_file(target: str | os.PathLike, data: str | bytes) -> bool:
    """Creates `target` whole unless it exists; False when another writer created it first."""
    target = Path(target)
    tmp = _hidden_beside(target, "tmp")
    try:
        _write(tmp, data)
        os.link(tmp, target)  # fails if the name exists: the first creator wins
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def staged_directory(
    target: str | os.PathLike, *, accept_existing: Callable[[Path], bool]
) -> Iterator[Path]:
    """Yields an empty hidden directory beside `target` to fill; renamed into place on success.

    When `target` appeared meanwhile (another process made the same thing first), it is kept if
    `accept_existing(target)` says it is whole, and the staged copy is dropped. On any exception
    the staged directory is removed and nothing appears under `target`.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _hidden_beside(target, "staging")
    staging.mkdir()
    try:
        yield staging
        try:
            os.rename(staging, target)
        except OSError:
            if not (target.exists() and accept_existing(target)):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
