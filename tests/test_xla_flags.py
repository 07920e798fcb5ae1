"""XLA flags: the collective timeouts every run raises, and which flags the contract compares."""

import os
import subprocess
import sys

from kvgraft_jax.core import xla_flags


def test_runs_raise_the_collective_timeouts_once():
    flags = xla_flags.with_collective_timeouts("--xla_force_host_platform_device_count=8")
    assert flags.split()[0] == "--xla_force_host_platform_device_count=8"
    assert all(f in flags.split() for f in xla_flags.COLLECTIVE_TIMEOUTS)
    assert xla_flags.with_collective_timeouts(flags) == flags  # idempotent
    mine = "--xla_cpu_collective_timeout_seconds=5"
    assert xla_flags.with_collective_timeouts(mine).split().count(mine) == 1
    assert "--xla_cpu_collective_timeout_seconds=1800" not in xla_flags.with_collective_timeouts(
        mine
    )


def test_this_process_runs_with_them():
    # conftest raised them before JAX started, like main does for every CLI run.
    assert all(f in os.environ["XLA_FLAGS"].split() for f in xla_flags.COLLECTIVE_TIMEOUTS)


def test_only_numeric_flags_are_part_of_the_contract():
    numeric = "--xla_cpu_enable_fast_math=false"
    text = xla_flags.with_collective_timeouts(f"--xla_force_host_platform_device_count=8 {numeric}")
    assert xla_flags.normalize(text) == numeric
    assert xla_flags.normalize("--b=1 --a=2") == "--a=2 --b=1"


def test_jax_accepts_the_flags():
    """XLA aborts on an unknown flag: the names must exist in the pinned jaxlib."""
    env = dict(os.environ, XLA_FLAGS=xla_flags.with_collective_timeouts(""), JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.device_count())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr[-2000:]
