"""Running the CLI in its own process, as a user does, and reading what it printed."""

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_OUR_FILES = {f.name for f in (ROOT / "kvgraft_jax").rglob("*.py")}  # absl logs the basename
_LOG_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+ +\d+ ([^:\]]+):\d+\] (.*)$")


def third_party_info(stderr: str) -> list[str]:
    """Log lines below WARNING that other packages' code wrote (the CLI keeps them off)."""
    found = (_LOG_LINE.match(line) for line in stderr.splitlines())
    return [m.group(0) for m in found if m and m.group(1) == "I" and m.group(2) not in _OUR_FILES]


def run_cli(
    *args: str, devices: int = 8, timeout: float = 300, wrapper: Sequence[str] = ()
) -> subprocess.CompletedProcess:
    """`python -m kvgraft_jax.main ARGS` from the repository root with `devices` forced host
    devices; `wrapper` is a command to run it under (bubblewrap with its own file-system view)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run(
        [*wrapper, sys.executable, "-m", "kvgraft_jax.main", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
        check=False,
    )
