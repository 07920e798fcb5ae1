"""Freed host memory stays with a CLI process: the next restore or graft reuses its pages."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from kvgraft_jax.core import host_memory

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="glibc's thresholds; elsewhere nothing is set"
)

# Sixteen 4 MiB buffers written, freed, and again, as a restore's host buffers are: the page
# faults of the last round.
ROUNDS = """
import resource, sys
import numpy as np
from kvgraft_jax.core import host_memory
if sys.argv[1] == "keep":
    assert host_memory.keep_freed_pages()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    before = faults()
    buffers = [np.ones(4 << 20, np.uint8) for _ in range(16)]
    del buffers
print(faults() - before)
"""


def _clean_env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")
    }


def _last_round_faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", ROUNDS, mode],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(done.stdout.split()[-1])


def test_kept_pages_are_reused_where_glibc_hands_them_back():
    """64 MiB of fresh pages: glibc's defaults fault them in again every round, kept they are
    reused (no fresh page)."""
    assert _last_round_faults("default") > 4_000
    assert _last_round_faults("keep") < 500


def test_the_environment_chooses_first():
    assert not host_memory.keep_freed_pages({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert not host_memory.keep_freed_pages({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert host_memory.KEPT is False


def test_the_cli_keeps_them_before_its_run():
    """`main` sets them before the run (here one that stops at a flag the mode needs)."""
    script = textwrap.dedent(
        """
        import sys
        from kvgraft_jax import main
        from kvgraft_jax.core import host_memory
        sys.argv = ["kvgraft_jax", "--mode=deposit", "--model=tiny"]
        try:
            main.run()
        except SystemExit:
            pass
        print("KEPT", host_memory.KEPT)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.stdout.split()[-2:] == ["KEPT", "True"], done.stdout + done.stderr
