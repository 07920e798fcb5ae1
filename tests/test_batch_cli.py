"""Batches from the command line: `--mode=graft --batch_file`, `--mode=verify --batch_file`, and
`--mode=verify --batch_report` proving an earlier process's recorded answers; every bad batch file
or forged report is one clear error before any model work."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_runs import run_cli

from kvgraft_jax.cli import batch_modes, modes
from kvgraft_jax.cli import flags as kv_flags
from kvgraft_jax.exact import batch
from kvgraft_jax.run import config as config_lib
from kvgraft_jax.run import runtime

TINY = ["--model=tiny", "--weights=random", "--seed=0", "--mesh=data:2,model:4"]
BATCH = [*TINY, "--batch_size=2", "--chunk_size=4", "--max_new_tokens=6"]


def _cfg(*argv: str) -> config_lib.RunConfig:
    return kv_flags.parse(["kvgraft_jax", *argv])


@pytest.fixture(scope="module")
def batch_dir(tmp_path_factory):
    """Two artifacts (one compacted, one not, other chunk sizes) and a batch file of four items:
    grafts of each, a second graft of the first, and an attempt with no prefix."""
    folder = tmp_path_factory.mktemp("batch")
    for name, text, extra in (
        ("a1", "The sky is blue because air scatters short wavelengths of sunlight.", []),
        ("a2", "Water boils at one hundred degrees at sea level. " * 6, ["--compact=false"]),
    ):
        modes.run_deposit(
            _cfg(
                *TINY,
                "--mode=deposit",
                f"--text={text}",
                f"--artifact={folder / name}",
                "--chunk_size=16",
                *extra,
            )
        )
    lines = [
        {"id": "sky", "artifact": "a1", "query": " Why is the sky blue?"},
        {"id": "water", "artifact": str(folder / "a2"), "query": " When?", "max_new_tokens": 3},
        {"id": "fresh", "artifact": None, "query": "Tell me a story about", "max_new_tokens": 9},
        {"id": "sky-ids", "artifact": "a1", "query_ids": [651, 235, 10, 11, 12, 13, 14, 15, 16]},
    ]
    (folder / "batch.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return folder


def test_a_batch_graft_is_proven_later_by_another_process(batch_dir, tmp_path):
    report = tmp_path / "graft.json"
    done = run_cli(
        *BATCH, "--mode=graft", f"--batch_file={batch_dir / 'batch.jsonl'}", f"--report={report}"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "item sky (row 0" in done.stdout and "item fresh" in done.stdout
    recorded = json.loads(report.read_text())
    assert [i["id"] for i in recorded["items"]] == ["sky", "water", "fresh", "sky-ids"]
    assert [len(i["new_token_ids"]) for i in recorded["items"]][1:3] == [3, 9]
    assert recorded["items"][2]["chain"] == [] and recorded["items"][2]["prefix_tokens"] == 0
    assert recorded["schedule"]["batch_size"] == 2 and recorded["mesh"] == "data:2,model:4"
    # A row was refilled: four items through two rows.
    assert len(recorded["schedule"]["placements"]) == 4
    assert {p["step"] for p in recorded["schedule"]["placements"]} != {0}

    # Later, another process: the recorded schedule replayed as the reference, every digest equal.
    proven = run_cli(*BATCH, "--mode=verify", f"--batch_report={report}")
    assert proven.returncode == 0, proven.stdout + proven.stderr[-3000:]
    assert "BIT-IDENTICAL: 4 items" in proven.stdout

    # One changed bit of one recorded answer is found: exit 1, the item and token named.
    forged = json.loads(report.read_text())
    digest = forged["items"][3]["logits_sha256"][2]
    forged["items"][3]["logits_sha256"][2] = digest[:-1] + ("0" if digest[-1] != "0" else "1")
    (tmp_path / "forged.json").write_text(json.dumps(forged))
    differs = modes.run_verify(
        _cfg(*BATCH, "--mode=verify", f"--batch_report={tmp_path / 'forged.json'}")
    )
    assert differs.exit_code == 1
    assert differs.comparison["first_mismatch"] == [3, 2] or differs.comparison[
        "first_mismatch"
    ] == (3, 2)
    assert differs.comparison["identical_items"] == 3

    # Answered by another attention program: not a difference, nothing here can prove it (exit 3).
    older = json.loads(report.read_text())
    older["schedule"]["attention"] = "kvgraft-blockwise/v1/block=256"
    (tmp_path / "older.json").write_text(json.dumps(older))
    unprovable = run_cli(*BATCH, "--mode=verify", f"--batch_report={tmp_path / 'older.json'}")
    assert unprovable.returncode == 3, unprovable.stderr[-3000:]
    assert "OtherProgramError" in unprovable.stderr and "Traceback" not in unprovable.stderr

    # On another mesh the replay is another program: not a proof either way (exit 3), said so.
    elsewhere = modes.run_verify(
        _cfg(*BATCH, "--mesh=model:8", "--mode=verify", f"--batch_report={report}")
    )
    assert elsewhere.exit_code in (0, 3)
    assert any("rerun with --mesh=data:2,model:4" in n for n in elsewhere.notes)


def test_verify_of_a_batch_file_in_one_run(batch_dir):
    cfg = _cfg(*BATCH, "--mode=verify", f"--batch_file={batch_dir / 'batch.jsonl'}")
    verified = modes.run_verify(cfg)
    assert verified.exit_code == 0 and verified.comparison["bit_identical"]
    assert verified.graft is not None and len(verified.graft.items) == 4
    assert verified.deposit_meshes == ["data:2,model:4"] and not verified.notes


def test_an_artifact_replaced_since_the_batch_is_refused(batch_dir, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(batch_dir, folder)
    report = tmp_path / "graft.json"
    graft = modes.run_graft(_cfg(*BATCH, "--mode=graft", f"--batch_file={folder / 'batch.jsonl'}"))
    report.write_text(json.dumps(graft.to_json()))
    shutil.rmtree(folder / "a1")
    modes.run_deposit(
        _cfg(
            *TINY, "--mode=deposit", "--text=Another text entirely.", f"--artifact={folder / 'a1'}"
        )
    )
    with pytest.raises(batch.BatchError, match=r"item sky: the artifact at .* now holds the chain"):
        modes.run_verify(_cfg(*BATCH, "--mode=verify", f"--batch_report={report}"))


def test_a_forged_report_is_refused_before_any_model_work(batch_dir, tmp_path):
    good = modes.run_graft(
        _cfg(*BATCH, "--mode=graft", f"--batch_file={batch_dir / 'batch.jsonl'}")
    ).to_json()
    cases = {
        "not json": "{",
        "a list": "[]",
        "no schedule": json.dumps({k: v for k, v in good.items() if k != "schedule"}),
        "no items": json.dumps(good | {"items": []}),
        "rows": json.dumps(good | {"schedule": good["schedule"] | {"batch_size": 10**9}}),
        "steps": json.dumps(good | {"schedule": good["schedule"] | {"steps": "x"}}),
        "ids": json.dumps(good | {"items": [good["items"][0] | {"query_ids": "abc"}]}),
        "artifact": json.dumps(good | {"items": [good["items"][0] | {"artifact": 5}]}),
        "model": json.dumps(good | {"model": ["x"]}),
    }
    for name, text in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.raises(config_lib.ConfigError, match="--batch_report"):
            modes.run_verify(_cfg(*BATCH, "--mode=verify", f"--batch_report={path}"))
    path = tmp_path / "slots.json"
    path.write_text(json.dumps(good | {"cache_slots": 10**12}))
    with pytest.raises(batch.BatchError, match="records a cache of"):
        modes.run_verify(_cfg(*BATCH, "--mode=verify", f"--batch_report={path}"))
    path.write_text(
        json.dumps(good | {"schedule": good["schedule"] | {"weight_layout": "gemm-f32"}})
    )
    with pytest.raises(batch.OtherProgramError, match="answered by the batch program 'gemm-f32'"):
        modes.run_verify(_cfg(*BATCH, "--mode=verify", f"--batch_report={path}"))
    path.write_text(json.dumps(good | {"schedule": good["schedule"] | {"attention": "v1"}}))
    with pytest.raises(batch.OtherProgramError, match="answered by the attention 'v1'"):
        modes.run_verify(_cfg(*BATCH, "--mode=verify", f"--batch_report={path}"))
    path.write_text(json.dumps(good | {"model": {"fingerprint": "f" * 64}}))
    with pytest.raises(config_lib.ConfigError, match="made with weights ffff"):
        modes.run_verify(_cfg(*BATCH, "--mode=verify", f"--batch_report={path}"))


@pytest.mark.parametrize(
    "line, message",
    [
        ("{", "line 2: not JSON"),
        ("[1, 2]", "line 2: an item is a JSON object"),
        ('{"query_ids": [5], "extra": 1}', r"line 2: unknown keys \['extra'\]"),
        ('{"artifact": "a1"}', "exactly one of `query` and `query_ids`"),
        ('{"query": "x", "query_ids": [5]}', "exactly one of `query` and `query_ids`"),
        ('{"query": ""}', "`query` is non-empty text"),
        ('{"query_ids": []}', "`query_ids` is a non-empty list"),
        ('{"query_ids": [1.5]}', "`query_ids` is a non-empty list"),
        ('{"query_ids": [true]}', "`query_ids` is a non-empty list"),
        ('{"artifact": 3, "query_ids": [5]}', "`artifact` is a directory path or null"),
        ('{"query_ids": [5], "max_new_tokens": 0}', "`max_new_tokens` is an integer"),
        ('{"query_ids": [5], "max_new_tokens": "4"}', "`max_new_tokens` is an integer"),
        ('{"query_ids": [5], "max_new_tokens": 1e9}', "`max_new_tokens` is an integer"),
        ('{"query_ids": [5], "id": [1]}', "`id` is a string"),
        ('{"id": "one", "query_ids": [5]}', r"ids used twice: \['one'\]"),
    ],
)
def test_a_bad_batch_file_line_is_named(tmp_path, line, message):
    path = tmp_path / "b.jsonl"
    path.write_text('{"id": "one", "query_ids": [5, 6]}\n' + line + "\n")
    tok = runtime.load_tokenizer(_cfg(*TINY, "--prompt=x"))
    with pytest.raises(config_lib.ConfigError, match=message):
        batch_modes.read_batch_file(str(path), tok, default_new_tokens=4)


def test_oversized_batch_inputs_are_refused_before_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(batch_modes, "MAX_FILE_BYTES", 64)
    big = tmp_path / "big.jsonl"
    big.write_text('{"query_ids": [5]}\n' * 10)
    with pytest.raises(config_lib.ConfigError, match="190 bytes, at most 64"):
        batch_modes.read_batch_file(str(big), None, default_new_tokens=4)
    with pytest.raises(config_lib.ConfigError, match=r"--batch_report=.*at most 64"):
        modes.run_verify(_cfg(*BATCH, "--mode=verify", f"--batch_report={big}"))


def test_bad_batch_files_and_flags_end_in_one_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe{")
    for path, message in (
        (tmp_path / "missing.jsonl", "no such file"),
        (empty, "no items"),
        (binary, "not UTF-8"),
    ):
        with pytest.raises(config_lib.ConfigError, match=message):
            batch_modes.read_batch_file(str(path), None, default_new_tokens=4)
    for argv, message in (
        (["--mode=generate", "--prompt=x", f"--batch_file={empty}"], "--batch_file is for"),
        (["--mode=graft", f"--batch_report={empty}"], "--batch_report is for --mode=verify"),
        (
            ["--mode=verify", f"--batch_report={empty}", f"--batch_file={empty}"],
            "mutually exclusive",
        ),
        (["--mode=graft", f"--batch_file={empty}", "--artifact=x"], "no --artifact"),
        (["--mode=graft", f"--batch_file={empty}", "--allow_relocation"], "own positions only"),
    ):
        with pytest.raises(config_lib.ConfigError, match=message):
            _cfg(*TINY, *argv)
    # From the command line: exit 2 and one line, no traceback.
    done = run_cli(*TINY, "--mode=graft", f"--batch_file={tmp_path / 'b.jsonl'}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "no such file" in done.stderr and "Traceback" not in done.stderr
