"""Verifiers: answer matching and the program sandbox (timeout, memory, output, network, scratch)."""

import pytest

from kvgraft_jax.library import dataset, verifiers


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("391", 391),
        (" 1,024 ", 1024),
        ("042", 42),
        ("-7", -7),
        ("+5.", 5),
        ("x1", None),
        ("", None),
    ],
)
def test_parse_integer(text, value):
    assert verifiers.parse_integer(text) == value


@pytest.mark.parametrize(
    ("solution", "answer", "ok"),
    [
        ("17 * 23 = 391.", "391", True),
        ("First 17 * 20 = 340, then 340 + 51 = 391", "391", True),
        ("Answer: 0391", "391", True),  # AIME style leading zero
        ("17 * 23 = 392.", "391", False),
        ("The answer is 391. Then 5 more.", "391", True),  # the answer line wins over later numbers
        ("no number here", "391", False),
        ("The capital is Tokyo", "tokyo", False),  # exact means exact: no substring match
        ("The capital is\nTokyo", "tokyo", True),  # the last line is the stated answer
        ("Answer:  TOKYO. ", "Tokyo", True),
        ("Answer: Kyoto", "Tokyo", False),
        ("", "Tokyo", False),
    ],
)
def test_check_answer(solution, answer, ok):
    verdict = verifiers.check_answer(solution, answer)
    assert verdict.ok is ok, verdict
    assert verdict.verifier == (verifiers.INTEGER if answer.strip().isdigit() else verifiers.EXACT)
    assert verdict.reason and "expected" in verdict.evidence


def test_program_output_is_checked():
    ok = verifiers.run_program("x = 17\nprint('working...')\nprint(x * 23)", "391")
    assert ok.ok and ok.verifier == verifiers.PROGRAM and ok.candidate == "391"
    assert ok.evidence["returncode"] == 0 and ok.evidence["isolation"].startswith("bubblewrap")
    wrong = verifiers.run_program("print(17 * 24)", "391")
    assert not wrong.ok and "408 != 391" in wrong.reason


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("while True:\n    pass", "timed out"),
        ("import time\ntime.sleep(30)", "timed out"),
        ("x = bytearray(2 * 1024**3)\nprint(1)", "MemoryError"),
        ("print('a' * 100000)\nprint(1)", "printed more than"),
        ("while True:\n    print('a' * 1000)", "printed more than"),
        ("import socket\nsocket.create_connection(('8.8.8.8', 53))", "Network is unreachable"),
        ("raise ValueError('boom')", "ValueError: boom"),
        ("import sys\nsys.exit(3)", "exit status 3"),
        ("open('big', 'w').write('x' * (4 << 20))\nprint(1)", "File too large"),
    ],
)
def test_program_limits(source, reason):
    limits = verifiers.ProgramLimits(timeout_s=2.0, memory_mb=256)
    verdict = verifiers.run_program(source, "1", limits=limits)
    assert not verdict.ok
    assert reason in verdict.reason, verdict


def test_program_runs_in_its_own_scratch_directory(tmp_path):
    marker = tmp_path / "outside"
    marker.write_text("host file")
    source = (
        "import os\nopen('note.txt', 'w').write('x')\n"
        f"print(os.path.exists({str(marker)!r}) or os.getcwd())"
    )
    verdict = verifiers.run_program(source, "unused")
    assert verdict.evidence["stdout"].strip() == "/scratch"  # the host file is not there


def test_sample_seed_set_verdicts():
    """The shipped seed set: every record verifies except the two planted wrong ones."""
    seed_set, _ = dataset.make_sample()
    verdicts = {
        r.id: (
            verifiers.run_program(r.program, r.answer)
            if r.program
            else verifiers.check_answer(r.solution, r.answer)
        )
        for r in seed_set
    }
    rejected = sorted(i for i, v in verdicts.items() if not v.ok)
    assert rejected == ["arith-bad-program", "arith-bad-solution"]
