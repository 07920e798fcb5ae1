"""Files and directories appear whole or not at all; nothing half-written is left under a name."""

import os

import pytest

from kvgraft_jax.core import atomic


def test_replace_file_writes_whole_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "sub" / "report.json"
    atomic.replace_file(target, "one\n")
    atomic.replace_file(target, b"two\n")
    assert target.read_bytes() == b"two\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["report.json"]


def test_create_file_keeps_the_first_creators_content(tmp_path):
    target = tmp_path / "library.json"
    assert atomic.create_file(target, "first") is True
    assert atomic.create_file(target, "second") is False
    assert target.read_text() == "first"
    assert sorted(os.listdir(tmp_path)) == ["library.json"]


def test_a_failed_staged_directory_leaves_nothing(tmp_path):
    target = tmp_path / "conversion"
    with (
        pytest.raises(RuntimeError, match="killed"),
        atomic.staged_directory(target, accept_existing=lambda t: True) as staging,
    ):
        (staging / "half").write_text("x")
        raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []


def test_a_staged_directory_appears_whole_or_defers_to_a_whole_one(tmp_path):
    target = tmp_path / "conversion"
    with atomic.staged_directory(target, accept_existing=lambda t: False) as staging:
        (staging / "done").write_text("mine")
    assert (target / "done").read_text() == "mine"
    # A second maker finds it there: kept when whole, an error when not.
    with atomic.staged_directory(target, accept_existing=lambda t: (t / "done").exists()) as s:
        (s / "done").write_text("theirs")
    assert (target / "done").read_text() == "mine"
    with (
        pytest.raises(OSError),
        atomic.staged_directory(target, accept_existing=lambda t: False) as s,
    ):
        (s / "done").write_text("theirs")
    assert [p.name for p in tmp_path.iterdir()] == ["conversion"]
