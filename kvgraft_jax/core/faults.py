"""Fault injection: named points where a test stops a process, to kill it there and check what
a crash at that moment leaves behind.

A test starts the process with `KVGRAFT_FAULT_PAUSE_AT=<point>`; on reaching that point the process
prints `KVGRAFT_PAUSED <point>` and sleeps, and the test SIGKILLs it (`tests/conftest.py`). Unset,
a point is one dictionary lookup. The points are listed here so a test cannot name one that does
not exist.
"""

from __future__ import annotations

import os
import time

PAUSE_ENV = "KVGRAFT_FAULT_PAUSE_AT"
POINTS = frozenset(
    {
        "after_state",  # artifact write: state files written, no manifest yet
        "after_manifest",  # manifest written, no commit marker yet
        "before_rename",  # marker written, staging directory not yet renamed into place
        "library_before_catalog",  # a library deposit committed, its catalog row not yet written
    }
)


def pause_point(name: str) -> None:
    """Stops here (for a SIGKILL) when the process was started to pause at `name`."""
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}")
    if os.environ.get(PAUSE_ENV) == name:
        print(f"KVGRAFT_PAUSED {name}", flush=True)
        time.sleep(3600)
