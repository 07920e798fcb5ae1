"""External verifiers: only what one of these accepts enters the library.

A verifier never asks the model. It compares a candidate answer with the known one (exact after
normalisation, or as an integer, AIME style), or runs a model-written Python program isolated in
a bubblewrap sandbox (`sandbox.py`: namespaces, nobody's view of the host, limits, a pipe for its
output) and checks what it prints. Every verdict carries its evidence, which the catalog stores.

    verdict = verifiers.check_answer("The answer is 391.", "391")   # integer match
    verdict = verifiers.run_program("print(17 * 23)", "391")        # program output match
    verdict.ok, verdict.reason, verdict.evidence
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unicodedata
from typing import Any

from kvgraft_jax.library import sandbox

EXACT = "exact"
INTEGER = "integer"
PROGRAM = "program"

_INT = re.compile(r"[-+]?\d[\d,]*")
_ANSWER_LINE = re.compile(r"answer\s*(?:is|:|=)\s*(.+)", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A verifier's decision, why, and what it saw."""

    ok: bool
    verifier: str  # EXACT, INTEGER or PROGRAM (program: its output checked with EXACT/INTEGER)
    reason: str
    candidate: str  # the answer that was checked, as extracted
    evidence: dict[str, Any]

    def evidence_json(self) -> str:
        return json.dumps(self.evidence, sort_keys=True)


def normalize_text(text: str) -> str:
    """Unicode NFKC, case-folded, whitespace collapsed, surrounding quotes and final period dropped."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = " ".join(text.split())
    text = text.strip(" \"'`")
    return text.rstrip(".").strip()


def parse_integer(text: str) -> int | None:
    """The integer a short answer states ('391', '1,024', '042', '-7'); None if it states none."""
    match = _INT.fullmatch(normalize_text(text).replace(" ", ""))
    if match is None:
        return None
    return int(match.group(0).replace(",", ""))


def is_integer_answer(answer: str) -> bool:
    return parse_integer(answer) is not None


def extract_answer(text: str, *, integer: bool) -> str:
    """The answer a solution states: what follows its last 'Answer:' / 'answer is' (the first
    number there, for an integer answer), else its last number (integer) or last non-empty line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    stated = None
    for line in reversed(lines):
        found = _ANSWER_LINE.search(line)
        if found:
            stated = found.group(1).strip()
            break
    if integer:
        numbers = _INT.findall(stated if stated is not None else text)
        if not numbers:
            return ""
        chosen = numbers[0] if stated is not None else numbers[-1]
        return chosen.replace(",", "").lstrip("+")
    if stated is not None:
        return stated
    return lines[-1] if lines else ""


def check_answer(solution: str, answer: str) -> Verdict:
    """Does `solution` state `answer`? Integer match when the answer is an integer, else exact."""
    integer = is_integer_answer(answer)
    candidate = extract_answer(solution, integer=integer)
    return _compare(candidate, answer, integer=integer, evidence={"extracted": candidate})


def _compare(candidate: str, answer: str, *, integer: bool, evidence: dict[str, Any]) -> Verdict:
    if integer:
        got, want = parse_integer(candidate), parse_integer(answer)
        ok = got is not None and got == want
        reason = "integer match" if ok else f"integer {got} != {want}"
        return Verdict(ok, INTEGER, reason, candidate, evidence | {"expected": want})
    got, want = normalize_text(candidate), normalize_text(answer)
    ok = bool(got) and got == want
    reason = "normalised match" if ok else f"{got!r} != {want!r}"
    return Verdict(ok, EXACT, reason, candidate, evidence | {"expected": want})


# -------------------------------------------------------------------------------------------
# Programs


ProgramLimits = sandbox.Limits
UNSANDBOXED = "program (unsandboxed)"


class SandboxRequired(RuntimeError):
    """A program verifier on a machine that cannot isolate it, without the explicit opt-in."""


# Only with `allow_unsandboxed=True` where bubblewrap cannot run: limits and sockets refused in
# the child Python, best effort, and every verdict says so (its verifier is UNSANDBOXED).
_UNSANDBOXED_LAUNCHER = """
import resource, socket, sys
memory, cpu, file_bytes = (int(x) for x in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
def _refuse(*a, **k):
    raise OSError("network access is disabled in the program verifier")
socket.socket = socket.create_connection = socket.getaddrinfo = _refuse
script = sys.argv[4]
sys.argv = [script]
with open(script, encoding="utf-8") as f:
    code = compile(f.read(), script, "exec")
del resource, socket, memory, cpu, file_bytes, f, _refuse
exec(code, {"__name__": "__main__", "__file__": script})
"""


def _run_unsandboxed(source: str, limits: ProgramLimits) -> sandbox.Ran:
    with tempfile.TemporaryDirectory(prefix="kvgraft-verify-") as scratch:
        script = os.path.join(scratch, "program.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(source)
        argv = [
            sys.executable,
            "-I",
            "-S",
            "-c",
            _UNSANDBOXED_LAUNCHER,
            str(limits.memory_mb << 20),
            str(int(limits.timeout_s) + 1),
            str(limits.file_bytes),
            script,
        ]
        started = time.perf_counter()
        proc = subprocess.Popen(
            argv,
            cwd=scratch,
            env={"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            return sandbox.Ran(None, b"", b"", time.perf_counter() - started, True)
        seconds = time.perf_counter() - started
        return sandbox.Ran(
            proc.returncode,
            out[: limits.output_bytes + 1],
            err[-limits.file_bytes :],
            seconds,
            False,
        )


def run_program(
    source: str,
    answer: str,
    *,
    limits: ProgramLimits | None = None,
    allow_unsandboxed: bool = False,
) -> Verdict:
    """Runs `source` isolated (`sandbox`); its last printed line must match `answer` (integer
    match for an integer answer, else exact). Where this machine cannot isolate it, refused with
    `SandboxRequired` unless `allow_unsandboxed`, whose verdicts are labelled UNSANDBOXED."""
    limits = limits or ProgramLimits()
    integer = is_integer_answer(answer)
    missing = sandbox.available()
    if missing is not None and not allow_unsandboxed:
        raise SandboxRequired(
            f"program verifiers need isolation and {missing}; pass --allow_unsandboxed_programs "
            "to run them anyway (every item is then labelled verified unsandboxed)"
        )
    verifier = PROGRAM if missing is None else UNSANDBOXED
    evidence: dict[str, Any] = {
        "timeout_s": limits.timeout_s,
        "memory_mb": limits.memory_mb,
        "output_bytes": limits.output_bytes,
        "isolation": "bubblewrap: user, mount, PID, IPC, network namespaces; nobody's view of "
        "the host but a read-only Python; private scratch"
        if missing is None
        else f"none ({missing}): sockets refused in-process only",
    }
    ran = (
        sandbox.run_python(source, limits) if missing is None else _run_unsandboxed(source, limits)
    )
    evidence["seconds"] = round(ran.seconds, 3)
    if ran.timed_out:
        return Verdict(False, verifier, f"timed out after {limits.timeout_s} s", "", evidence)
    evidence["returncode"] = ran.returncode
    out, err, proc = ran.stdout, ran.stderr, ran
    if len(out) > limits.output_bytes:
        return Verdict(
            False,
            verifier,
            f"printed more than {limits.output_bytes} bytes, the limit",
            "",
            evidence,
        )
    stdout = out.decode("utf-8", errors="replace")
    evidence["stdout"] = stdout[-500:]
    if proc.returncode != 0:
        tail = err.decode("utf-8", errors="replace").strip().splitlines()
        evidence["stderr"] = "\n".join(tail[-5:])
        why = tail[-1] if tail else f"exit status {proc.returncode}"
        return Verdict(False, verifier, f"program failed: {why}", "", evidence)
    lines = [line.strip() for line in stdout.strip().splitlines() if line.strip()]
    candidate = lines[-1] if lines else ""
    verdict = _compare(candidate, answer, integer=integer, evidence=evidence)
    return dataclasses.replace(
        verdict,
        verifier=verifier,
        reason=f"program output: {verdict.reason}",
        evidence=verdict.evidence | {"checked_as": verdict.verifier},
    )
