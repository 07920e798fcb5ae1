"""Input files a run reads (datasets, batch files, batch reports): a missing, oversized,
non-UTF-8 or non-JSON file is one `error` naming its flag (and, in JSONL, its line), raised
before anything is built from it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def read_text(
    path: str | Path, *, flag: str, error: type[Exception], max_bytes: int | None = None
) -> str:
    """The file's UTF-8 text; `max_bytes` refuses a larger file before reading it."""
    file = Path(path)
    if not file.is_file():
        raise error(f"{flag}={path}: no such file")
    size = file.stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise error(f"{flag}={path}: {size:,} bytes, at most {max_bytes:,}")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{flag}={path}: not UTF-8 (byte {e.start})") from None


def json_lines(
    path: str | Path,
    *,
    flag: str,
    error: type[Exception],
    where: Callable[[int], str],
    max_bytes: int | None = None,
) -> Iterator[tuple[str, Any]]:
    """Each non-blank line of a JSONL file, parsed, with `where(line_number)` for its errors."""
    text = read_text(path, flag=flag, error=error, max_bytes=max_bytes)
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield where(number), json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{where(number)}: not JSON ({e})") from None
