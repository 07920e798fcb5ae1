"""What the CLI lets third-party code print: their warnings and errors in one line each, not their INFO.

A deposit used to print about 30 INFO lines of Orbax's save protocol around our own handful. A write
that failed on a full disk printed about 150 lines around the one line that names the cause:
tracebacks from Orbax's worker threads, TensorStore callbacks landing on Orbax's closed event loop,
and asyncio's late notes on tasks nobody awaited. Our own modules keep logging at INFO (that is our
progress). `--verbosity=1` turns all of this off and shows everything, tracebacks included.
"""

from __future__ import annotations

import logging
import os
import sys

# kvgraft_jax/ (this file is kvgraft_jax/cli/quiet.py): every record from the package is ours.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_FIRST_LINE_CHARS = 300


def is_ours(record: logging.LogRecord) -> bool:
    return os.path.abspath(record.pathname).startswith(_PACKAGE_DIR)


class ThirdPartyFilter(logging.Filter):
    """Drops third-party records below WARNING; shortens the rest to their first line, with no
    traceback (the error that ends the run is ours to report, once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if is_ours(record):
            return True
        if record.levelno < logging.WARNING or _is_unretrieved_task(record):
            return False
        try:
            message = record.getMessage().strip()
        except Exception:  # a malformed call is the handler's to report (handleError), not ours
            return True
        first = message.splitlines()[0] if message else ""
        if len(first) > _FIRST_LINE_CHARS or first != message:
            first = first[:_FIRST_LINE_CHARS] + " [...]"
        record.msg, record.args = first, None
        record.exc_info = record.exc_text = record.stack_info = None
        return True


# asyncio names the class: Task, Future, or a subclass (`asyncio.gather`'s _GatheringFuture).
_UNRETRIEVED = " exception was never retrieved"


def _is_unretrieved_task(record: logging.LogRecord) -> bool:
    """asyncio's note, at garbage collection, on a task or future of a failed save that nobody
    awaited: late (after our own line), and the failure it carries is already reported. (The
    future's note came after ours in 1 of 6 full-disk deposits, the task's in most, and a
    gather's once in three full test runs.)"""
    # asyncio logs the note with the task's repr on the lines after it (`future: <Task ...>`).
    first_line = str(record.msg).split("\n", 1)[0]
    return (
        record.name == "asyncio"
        and first_line.endswith(_UNRETRIEVED)
        and first_line[: -len(_UNRETRIEVED)].isidentifier()
    )


def _is_closed_loop_callback(unraisable) -> bool:
    """TensorStore completing a write after Orbax closed the event loop that awaited it: only ever
    seen after a save already failed, and reported by that failure."""
    value = unraisable.exc_value
    return isinstance(value, RuntimeError) and str(value) == "Event loop is closed"


def install(handler: logging.Handler, *, verbose: bool) -> None:
    """Filters `handler` (absl's, which every logger reaches) and the unraisable-exception hook,
    unless `verbose`. Idempotent."""
    if verbose:
        return
    if not any(isinstance(f, ThirdPartyFilter) for f in handler.filters):
        handler.addFilter(ThirdPartyFilter())
    if getattr(sys.unraisablehook, "_kvgraft_quiet", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if not _is_closed_loop_callback(unraisable):
            previous(unraisable)

    hook._kvgraft_quiet = True
    sys.unraisablehook = hook
