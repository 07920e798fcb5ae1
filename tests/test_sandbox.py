"""The program verifier's sandbox, attacked: each test fails if its attack succeeds.

Each hostile program prints "contained" only when its attack failed, so a verdict that accepts
"contained" is the sandbox holding; side effects on the host are checked as well.
"""

import os
import socket
import sqlite3
import threading
import time

import pytest

from kvgraft_jax.library import sandbox, verifiers

LIMITS = verifiers.ProgramLimits(timeout_s=5.0)


@pytest.fixture(autouse=True)
def _needs_the_sandbox():
    missing = sandbox.available()
    assert missing is None, f"this machine must isolate programs: {missing}"


def _contained(source: str) -> verifiers.Verdict:
    verdict = verifiers.run_program(source, "contained", limits=LIMITS)
    assert verdict.ok and verdict.verifier == verifiers.PROGRAM, verdict
    return verdict


def test_cannot_read_the_host(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the library's key")
    _contained(
        f"""
import os
leaks = []
for path in ({str(secret)!r}, {os.path.expanduser("~")!r}, "/etc/passwd", {os.getcwd()!r}):
    try:
        leaks.append(open(path).read() if os.path.isfile(path) else os.listdir(path))
    except OSError:
        pass
print("LEAK" if leaks else "contained")
"""
    )


def test_cannot_write_the_host_or_the_catalog(tmp_path):
    catalog_file = tmp_path / "catalog.sqlite"
    with sqlite3.connect(catalog_file) as db:
        db.execute("CREATE TABLE items(problem TEXT, answer TEXT)")
    before = catalog_file.read_bytes()
    _contained(
        f"""
import sqlite3
wrote = False
for attempt in (
    lambda: open({str(tmp_path / "pwned")!r}, "w").write("x"),
    lambda: sqlite3.connect({str(catalog_file)!r}).execute(
        "INSERT INTO items VALUES ('What is 2 + 2?', '5')").connection.commit(),
):
    try:
        attempt()
        wrote = True
    except Exception:
        pass
print("WROTE" if wrote else "contained")
"""
    )
    assert not (tmp_path / "pwned").exists()
    assert catalog_file.read_bytes() == before


def test_cannot_reach_host_sockets_or_the_network(tmp_path):
    path = str(tmp_path / "host.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(path)
    unix.listen()
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0kvgraft-test-abstract")
    abstract.listen()
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    port = tcp.getsockname()[1]
    try:
        _contained(
            f"""
import socket
reached = []
for family, address in (
    (socket.AF_UNIX, {path!r}),
    (socket.AF_UNIX, "\\0kvgraft-test-abstract"),
    (socket.AF_INET, ("127.0.0.1", {port})),
    (socket.AF_INET, ("8.8.8.8", 53)),
):
    s = socket.socket(family)
    s.settimeout(2)
    try:
        s.connect(address)
        reached.append(address)
    except OSError:
        pass
print(f"REACHED {{reached}}" if reached else "contained")
"""
        )
    finally:
        for s in (unix, abstract, tcp):
            s.close()


def _processes_with(token: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_nothing_it_started_outlives_the_verdict():
    token = "kvgraft-orphan-marker"
    verdict = _contained(
        f"""
import os, sys
for _ in range(5):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c",
                "import time; time.sleep(120)", "{token}"])
        os._exit(0)
print("contained")
"""
    )
    assert verdict.evidence["seconds"] < LIMITS.timeout_s
    time.sleep(0.5)
    assert _processes_with(token) == []


def test_a_held_or_replaced_output_cannot_block_the_verifier():
    started = time.perf_counter()
    verdict = verifiers.run_program(
        """
import os, time
os.close(1)
os.mkfifo("stdout")
if os.fork() == 0:
    time.sleep(120)  # keeps the original pipe's other copies open, in vain
open("stdout", "w")  # blocks forever: nobody reads this FIFO
""",
        "1",
        limits=verifiers.ProgramLimits(timeout_s=2.0),
    )
    assert not verdict.ok and "timed out" in verdict.reason
    assert time.perf_counter() - started < 10


def test_cannot_signal_anyone_outside():
    _contained(
        """
import os, signal
for target in (os.getppid(), 1, -1):
    try:
        os.kill(target, signal.SIGKILL)
    except OSError:
        pass
print("contained")
"""
    )
    assert os.getpid() > 0  # this process is alive to assert it


def test_forks_and_open_files_are_bounded():
    _contained(
        """
import os
children = files = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            import time
            time.sleep(5)
            os._exit(0)
        children += 1
except OSError:
    pass
try:
    handles = [open("/dev/null") for _ in range(500)]
except OSError:
    pass
else:
    files = len(handles)
print("contained" if children < 64 and files < 500 else f"{children} children, {files} files")
"""
    )


def test_without_isolation_programs_are_refused_unless_labelled(monkeypatch):
    monkeypatch.setattr(sandbox, "available", lambda: "user namespaces are disabled")
    with pytest.raises(verifiers.SandboxRequired, match="user namespaces are disabled"):
        verifiers.run_program("print(1)", "1")
    verdict = verifiers.run_program("print(1)", "1", allow_unsandboxed=True)
    assert verdict.ok and verdict.verifier == verifiers.UNSANDBOXED
    assert verdict.evidence["isolation"].startswith("none (user namespaces are disabled)")


def test_runs_in_parallel_threads():
    """The flywheel may verify from a threaded process: each run has its own scratch."""
    results = []

    def run(i):
        results.append(verifiers.run_program(f"print({i} * 2)", str(i * 2), limits=LIMITS).ok)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 4
