"""Reading the CLI's stderr: which log lines came from other packages' code."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_OUR_FILES = {f.name for f in (ROOT / "kvgraft_jax").glob("*.py")}
_LOG_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+ +\d+ ([^:\]]+):\d+\] (.*)$")


def third_party_info(stderr: str) -> list[str]:
    """Log lines below WARNING that other packages' code wrote (the CLI keeps them off)."""
    found = (_LOG_LINE.match(line) for line in stderr.splitlines())
    return [m.group(0) for m in found if m and m.group(1) == "I" and m.group(2) not in _OUR_FILES]
