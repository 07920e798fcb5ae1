"""External verifiers: only what one of these accepts enters the library.

A verifier never asks the model. It compares a candidate answer with the known one (exact after
normalisation, or as an integer, AIME style), or runs a model-written Python program in a
subprocess (timeout, memory, file-size and output limits, no network, a scratch directory) and
checks what it prints. Every verdict carries its evidence, which the catalog stores.

    verdict = verifiers.check_answer("The answer is 391.", "391")   # integer match
    verdict = verifiers.run_program("print(17 * 23)", "391")        # program output match
    verdict.ok, verdict.reason, verdict.evidence
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unicodedata
from typing import Any

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


@dataclasses.dataclass(frozen=True)
class ProgramLimits:
    timeout_s: float = 5.0
    memory_mb: int = 256
    output_bytes: int = 4096
    file_bytes: int = 1 << 20


# Runs in the child Python before the program: limits, then sockets refused (on top of the network
# namespace where the machine allows one; without it this is the only barrier: best effort, and
# the evidence says so), then the program as __main__. Doing this in the child instead of a
# preexec_fn keeps the parent (multithreaded JAX) from forking Python code.
_LAUNCHER = """
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


@functools.cache
def _network_namespace_prefix() -> tuple[str, ...]:
    """`unshare -rn` when this machine lets an unprivileged user make a network namespace."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    try:
        done = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return (unshare, "-rn") if done.returncode == 0 else ()


def run_program(source: str, answer: str, *, limits: ProgramLimits = ProgramLimits()) -> Verdict:
    """Runs `source` with Python in a scratch directory under limits; its last printed line must
    match `answer` (integer match for an integer answer, else exact)."""
    integer = is_integer_answer(answer)
    network = _network_namespace_prefix()
    evidence: dict[str, Any] = {
        "timeout_s": limits.timeout_s,
        "memory_mb": limits.memory_mb,
        "output_bytes": limits.output_bytes,
        "network": "network namespace (unshare -rn)" if network else "sockets disabled in-process",
    }
    with tempfile.TemporaryDirectory(prefix="kvgraft-verify-") as scratch:
        script = os.path.join(scratch, "program.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(source)
        limits_args = [
            str(limits.memory_mb << 20),
            str(int(limits.timeout_s) + 1),
            str(limits.file_bytes),
        ]
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
        # Output goes to files in the scratch directory, so RLIMIT_FSIZE bounds it too and a
        # program that prints without end cannot fill this process's memory.
        out_path, err_path = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
        started = time.perf_counter()
        with open(out_path, "wb") as out_file, open(err_path, "wb") as err_file:
            try:
                proc = subprocess.Popen(
                    [*network, sys.executable, "-I", "-S", "-c", _LAUNCHER, *limits_args, script],
                    cwd=scratch,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out_file,
                    stderr=err_file,
                    start_new_session=True,
                )
            except OSError as e:
                return Verdict(False, PROGRAM, f"could not start: {e}", "", evidence)
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                evidence["seconds"] = round(time.perf_counter() - started, 3)
                return Verdict(
                    False, PROGRAM, f"timed out after {limits.timeout_s} s", "", evidence
                )
        evidence["seconds"] = round(time.perf_counter() - started, 3)
        evidence["returncode"] = proc.returncode
        with open(out_path, "rb") as f:
            out = f.read(limits.output_bytes + 1)
        with open(err_path, "rb") as f:
            err = f.read(limits.file_bytes)
    if len(out) > limits.output_bytes:
        return Verdict(
            False,
            PROGRAM,
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
        return Verdict(False, PROGRAM, f"program failed: {why}", "", evidence)
    lines = [line.strip() for line in stdout.strip().splitlines() if line.strip()]
    candidate = lines[-1] if lines else ""
    verdict = _compare(candidate, answer, integer=integer, evidence=evidence)
    return dataclasses.replace(
        verdict,
        verifier=PROGRAM,
        reason=f"program output: {verdict.reason}",
        evidence=verdict.evidence | {"checked_as": verdict.verifier},
    )
