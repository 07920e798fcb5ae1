"""XLA flags: which ones can change numerics (part of the exactness contract), and the CPU
collectives' timeouts every run raises.

XLA:CPU aborts the process when the threads of a collective miss a 40 s rendezvous. With 8 forced
host devices on a loaded 2-core machine they can (seen twice on `--mode=verify --mesh=data:8`), so
every run raises those timeouts before JAX starts: a busy machine is slower, never aborted. They
change no numerics, and neither does the forced host device count, so neither is part of the
contract. Stdlib only: this runs before JAX is imported.
"""

from __future__ import annotations

COLLECTIVE_TIMEOUTS = (
    "--xla_cpu_collective_timeout_seconds=1800",
    "--xla_cpu_collective_call_terminate_timeout_seconds=1800",
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120",
)
# Flags (by name) that change no bit of any result.
NOT_NUMERIC = (
    "--xla_force_host_platform_device_count",
    *(flag.split("=")[0] for flag in COLLECTIVE_TIMEOUTS),
)


def _name(flag: str) -> str:
    return flag.split("=")[0]


def with_collective_timeouts(text: str) -> str:
    """`text` (an XLA_FLAGS value) plus the raised timeouts, unless it sets them itself."""
    given = {_name(f) for f in text.split()}
    extra = [f for f in COLLECTIVE_TIMEOUTS if _name(f) not in given]
    return " ".join([*text.split(), *extra])


def normalize(text: str) -> str:
    """The flags of `text` that can change numerics, sorted."""
    return " ".join(sorted(f for f in text.split() if _name(f) not in NOT_NUMERIC))
