"""Several CPU processes on localhost form one mesh through jax.distributed (gloo collectives).

Deposit on 2 processes (4 devices each), restore and graft on 1 process and on 4 (2 devices
each): the roots, the grafted logits and the state after the query are the same bits everywhere,
and a damaged artifact is refused by every process (none is left waiting in a collective).
The processes are real `python -m kvgraft_jax.main` runs; each test kills all of them on failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvgraft_jax.cli import flags as kv_flags
from kvgraft_jax.cli import modes
from kvgraft_jax.store import files as files_lib
from kvgraft_jax.store import manifest as manifest_lib

REPO = Path(__file__).resolve().parents[1]
QUERY = ["--query=What does a graft cost?", "--max_new_tokens=5"]
LAYOUT = ["--mesh=data:2,model:4", "--batch_size=2"]  # 8 devices however many processes hold them


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_processes(n: int, *args: str, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """`n` CLI processes with 8/n devices each joined into one run; all killed on any failure."""
    port = _free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={8 // n}",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "JAX_PLATFORMS": "cpu",
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvgraft_jax.main",
                *args,
                "--distributed",
                f"--coordinator_address=localhost:{port}",
                f"--num_processes={n}",
                f"--process_id={i}",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, killed whole below
        )
        for i in range(n)
    ]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for i, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"process {i} of {n} still running after {timeout} s (a hang)")
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return results


def _ok(results) -> None:
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i}: rc {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"


def _root_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("root: "))


def _in_process(*argv: str):
    """The same run in this (one) process, with its 8 forced devices."""
    return kv_flags.parse(["kvgraft_jax", *argv])


@pytest.fixture(scope="module")
def two_process_artifact(tmp_path_factory):
    target = tmp_path_factory.mktemp("mp") / "doc"
    results = run_processes(
        2, "--flagfile=configs/tiny_deposit.flags", f"--artifact={target}", *LAYOUT
    )
    _ok(results)
    return target, results


def test_deposit_on_two_processes_gives_the_one_process_root(two_process_artifact, tmp_path):
    target, results = two_process_artifact
    roots = {_root_line(r.stdout) for r in results}
    assert len(roots) == 1, roots  # every process computed the same root
    manifest = manifest_lib.read_manifest(target)
    assert _root_line(results[0].stdout) == f"root: {manifest.root}"
    # Each process wrote its own shards (Orbax's per-process OCDBT stores), one manifest in all.
    state = target / files_lib.STATE_DIR
    assert (state / "ocdbt.process_0").is_dir() and (state / "ocdbt.process_1").is_dir()
    assert not [p for p in target.parent.iterdir() if files_lib.STAGING_INFIX in p.name]

    single = modes.run_deposit(
        _in_process(
            "--flagfile=configs/tiny_deposit.flags", f"--artifact={tmp_path / 'one'}", *LAYOUT
        )
    )
    assert single.root == manifest.root


def test_graft_on_four_processes_and_on_one_is_bit_identical(two_process_artifact, tmp_path):
    target, _ = two_process_artifact
    report = tmp_path / "v4.json"
    results = run_processes(
        4,
        "--flagfile=configs/tiny_cpu.flags",
        "--mode=verify",
        f"--artifact={target}",
        *QUERY,
        *LAYOUT,
        f"--report={report}",
    )
    _ok(results)
    for r in results:
        assert "BIT-IDENTICAL" in r.stdout, r.stdout
    four = json.loads(report.read_text())  # written by process 0 only
    assert four["comparison"]["bit_identical"] and four["reference"].startswith("a")

    one = modes.run_verify(
        _in_process(
            "--flagfile=configs/tiny_cpu.flags",
            "--mode=verify",
            f"--artifact={target}",
            *QUERY,
            *LAYOUT,
        )
    ).to_json()
    assert one["comparison"]["bit_identical"]
    # Same layout over 1 or 4 processes: the same logits bits at every step, the same state.
    assert one["graft"]["step_logits_sha256"] == four["graft"]["step_logits_sha256"]
    assert one["graft"]["state_root_after_query"] == four["graft"]["state_root_after_query"]
    assert one["graft"]["root"] == four["graft"]["root"] == manifest_lib.read_manifest(target).root

    # Restored on one process onto another mesh: the same root (re-hashed there).
    inspected = modes.run_inspect(
        _in_process("--mode=inspect", f"--artifact={target}", "--mesh=model:8", "--batch_size=2")
    )
    assert inspected.intact and inspected.summary["root"] == four["graft"]["root"]


def test_a_damaged_artifact_is_refused_by_every_process(two_process_artifact, tmp_path):
    target, _ = two_process_artifact
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", str(target), str(damaged)], check=True)
    files = files_lib.walk_files(files_lib.as_path(damaged) / files_lib.STATE_DIR)
    victim = Path(os.fspath(files[1]))  # in process 1's share of the file check
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))

    results = run_processes(2, "--mode=inspect", f"--artifact={damaged}", *LAYOUT, timeout=180)
    assert [r.returncode for r in results] == [1, 1], [r.stderr[-2000:] for r in results]
    assert "changed since the deposit" in results[1].stdout + results[1].stderr
    assert "process 1 failed" in results[0].stdout + results[0].stderr


def test_a_batch_split_over_two_processes_gives_the_one_process_bits(tmp_path):
    """Six items through four rows, two rows per process (`data:4` across the processes), rows
    refilled as items finish: every item's logits digests and the batch schedule equal the
    one-process run's, and a later one-process verify proves the two-process report.

    `model:2`: a reduction over two devices is one commutative addition. Over four (`model:4`)
    the sums run in the collective library's order, which is not the same within one process as
    across two (measured: 22 of 81 token digests differ); the report records the process count
    and a verify names that difference rather than calling it a fault.
    """
    mesh = ["--model=tiny", "--weights=random", "--seed=0", "--mesh=data:4,model:2"]
    for name, text in (("a1", "Grafts cost a restore."), ("a2", "Chunks are recorded. " * 5)):
        modes.run_deposit(
            _in_process(*mesh, "--mode=deposit", f"--text={text}", f"--artifact={tmp_path / name}")
        )
    items = [
        {"id": "one", "artifact": "a1", "query": " What does a graft cost?"},
        {"id": "two", "artifact": "a2", "query": " What is recorded?", "max_new_tokens": 3},
        {"id": "three", "query": "A fresh question", "max_new_tokens": 7},
        {"id": "four", "artifact": "a1", "query": " Again?", "max_new_tokens": 2},
        {"id": "five", "artifact": "a2", "query": " And the chunks, how long are they?"},
        {"id": "six", "query": "Another fresh one", "max_new_tokens": 9},
    ]
    batch_file = tmp_path / "batch.jsonl"
    batch_file.write_text("".join(json.dumps(i) + "\n" for i in items))
    run = [*mesh, "--mode=graft", f"--batch_file={batch_file}", "--batch_size=4"]
    run += ["--chunk_size=4", "--max_new_tokens=5", "--stop_at_eos=false"]
    report = tmp_path / "two.json"
    results = run_processes(2, *run, f"--report={report}")
    _ok(results)
    two = json.loads(report.read_text())
    assert two["processes"] == 2 and len(two["schedule"]["placements"]) == 6
    one = modes.run_graft(_in_process(*run)).to_json()
    assert one["processes"] == 1 and two["schedule"] == one["schedule"]
    assert [i["logits_sha256"] for i in two["items"]] == [i["logits_sha256"] for i in one["items"]]
    assert [len(i["new_token_ids"]) for i in two["items"]] == [5, 3, 7, 2, 5, 9]

    verified = modes.run_verify(
        _in_process(*mesh, "--mode=verify", f"--batch_report={report}", "--chunk_size=4")
    )
    assert verified.exit_code == 0 and verified.comparison["bit_identical"], verified.comparison
    assert any("on 2 processes" in n for n in verified.notes)
