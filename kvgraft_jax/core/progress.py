"""Progress bars on stderr for work that takes more than a few seconds (tqdm).

Bars are drawn only when stderr is a terminal (`disable=None`), so logs and CI output stay clean;
results go to stdout and never mix with them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def bar(
    items: Iterable[T], *, desc: str, unit: str, total: int | None = None, enabled: bool = True
) -> tqdm:
    """`items`, with a bar that advances as each is taken (`set_postfix` adds live counts)."""
    return tqdm(
        items, desc=desc, unit=unit, total=total, disable=None if enabled else True, leave=False
    )


def counter(total: int, *, desc: str, unit: str) -> Callable[[int, int], None]:
    """A `(done, total)` callback (the engine's prefill reports chunks so) driving one bar."""
    shown = tqdm(total=total, desc=desc, unit=unit, disable=None, leave=False)

    def update(done: int, total: int) -> None:
        shown.update(done - shown.n)
        if done == total:
            shown.close()

    return update
