"""The command line: every flagfile parses, bad flags exit 2 with one line, generate runs end to end."""

import json
from pathlib import Path

import pytest
from cli_runs import run_cli, third_party_info

from kvgraft_jax.cli import flags
from kvgraft_jax.core import sharding
from kvgraft_jax.run import config

ROOT = Path(__file__).resolve().parents[1]
FLAGFILES = sorted((ROOT / "configs").rglob("*.flags"))
# Devices JAX sees on each TPU slice a flagfile names (v5p: one device per chip, 2 cores each).
SLICE_DEVICES = {"v5e8": 8, "v6e8": 8, "v5p8": 4, "v5e16": 16, "v5p16": 8}
MULTIHOST_SLICES = {"v5e16", "v5p16"}  # 4 and 2 hosts


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kvgraft_jax: error:")]


def test_there_are_flagfiles():
    names = {p.name for p in FLAGFILES}
    assert names >= {"tiny_cpu.flags", "base.flags"}
    assert {n.split("_")[1] for n in names if n.startswith("gemma3_") and "_v" in n} >= {
        "270m",
        "1b",
        "4b",
        "12b",
        "27b",
    }


@pytest.mark.parametrize("path", FLAGFILES, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_flagfile_parses_into_a_valid_config(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # nested --flagfile paths are relative to the repository root
    cfg = flags.parse(["kvgraft_jax", f"--flagfile={path}"])
    assert isinstance(cfg, config.RunConfig)
    assert cfg.model in config.MODEL_NAMES
    assert config.RunConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    slice_name = path.stem.rsplit("_", 1)[-1]
    if slice_name in SLICE_DEVICES:  # a TPU flagfile: its mesh fits its slice exactly
        spec = sharding.MeshSpec.parse(cfg.mesh, num_devices=SLICE_DEVICES[slice_name])
        assert spec.num_devices == SLICE_DEVICES[slice_name]
        assert cfg.batch_size % spec.data == 0
        assert cfg.mode == "deposit" and cfg.artifact
        # Real weights, fetched beforehand: a Hugging Face text checkpoint (270M, 1B) brings its
        # tokenizer.model; the gemma Orbax checkpoints (4B and up) name theirs.
        assert cfg.weights.startswith("checkpoints/")
        text_only_hf = cfg.model in ("gemma3_270m", "gemma3_1b")
        assert bool(cfg.tokenizer) != text_only_hf
        # Slices spread over several hosts join one run and keep artifacts where all hosts see.
        multihost = slice_name in MULTIHOST_SLICES
        assert cfg.distributed == multihost
        assert cfg.artifact.startswith("gs://") == multihost


def test_flags_reach_the_config():
    cfg = flags.parse(
        [
            "kvgraft_jax",
            "--mesh=data:2,model:4",
            "--prompt_ids=2,5,9",
            "--chunk_size=8",
            "--model=tiny_mqa",
        ]
    )
    assert (cfg.mesh, cfg.prompt_ids, cfg.chunk_size, cfg.model) == (
        "data:2,model:4",
        (2, 5, 9),
        8,
        "tiny_mqa",
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus=1"], "Unknown command line flag 'bogus'"),
        (["--mode=fly"], "--mode"),
        (["--prompt=a", "--prompt_ids=2,3"], "mutually exclusive"),
        (["--text=a", "--text_file=b", "--prompt=x"], "mutually exclusive"),
        (["--prompt_ids=2,x"], "comma-separated integers"),
        (["--chunk_size=0", "--prompt=x"], "--chunk_size"),
        (["--mode=generate"], "needs --prompt"),
        (["--prompt=x", "extra"], "positional"),
        (["--prompt=x", "--coordinator_address=h:1"], "need --distributed"),
        (["--prompt=x", "--distributed", "--num_processes=2", "--process_id=2"], "is not in"),
        (["--mode=reindex", "--library=l", "--distributed"], "runs on one process"),
        (["--mode=bench", "--distributed"], "runs on one process"),
        (["--prompt=x", "--library_artifacts=gs://b/l"], "needs --library"),
        (["--prompt=x", "--max_new_tokens=1000000000000"], "at most 131,072"),
        (["--prompt=x", "--cache_length=10000000"], "at most 131,072"),
    ],
)
def test_bad_flags_are_config_errors(argv, message):
    with pytest.raises(config.ConfigError, match=message):
        flags.parse(["kvgraft_jax", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus=1"], "Unknown command line flag 'bogus'"),
        (["--prompt=a", "--prompt_ids=2,3"], "mutually exclusive"),
        (["--mode=solve", "--library=/tmp/lib"], "needs --dataset"),
        (["--mode=reindex"], "needs --library"),
        (["--mesh=data:3,model:3", "--prompt=x"], "needs 9 devices"),
        (
            ["--weights=/nonexistent", "--prompt_ids=2,3"],
            "--weights=/nonexistent: no such file or directory",
        ),
        (
            ["--weights=/nonexistent.gguf", "--prompt=x"],
            "--weights=/nonexistent.gguf: no such file",
        ),
        (["--weights=/nonexistent/dir", "--prompt=x"], "a Hugging Face Gemma 3 text checkpoint"),
        (["--model=gemma3_1b", "--prompt=x"], "has no embedded weights"),
        (["--prompt=x", "--max_new_tokens=1e12"], "invalid literal for int()"),
        (
            [
                "--mode=deposit",
                "--text_file=kvgraft_jax/assets/tiny_tokenizer.model",
                "--artifact=x",
            ],
            "not UTF-8 text",
        ),
    ],
)
def test_cli_usage_errors_exit_2_with_one_line(argv, message):
    result = run_cli(*argv)
    assert result.returncode == 2, result.stderr
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert result.stdout == ""


def test_generate_runs_the_embedded_default_and_writes_a_report(tmp_path):
    report_path = tmp_path / "out" / "report.json"
    result = run_cli(
        "--flagfile=configs/tiny_cpu.flags",
        "--mesh=data:2,model:4",
        "--batch_size=2",
        f"--report={report_path}",
    )
    assert result.returncode == 0, result.stderr
    assert "continuation:" in result.stdout and "timings:" in result.stdout
    report = json.loads(report_path.read_text())
    assert report["mesh"] == "data:2,model:4" and report["num_devices"] == 8
    assert report["config"]["chunk_size"] == 16
    assert report["schedule"][0] == [0, 16]
    assert sum(length for _, length in report["schedule"]) == len(report["prompt_ids"])
    assert (
        len(report["new_token_ids"]) == 2
        and report["new_token_ids"][0] == report["new_token_ids"][1]
    )
    assert len(report["step_logits_sha256"]) == len(report["new_token_ids"][0])
    assert report["versions"]["jax"] == "0.9.2"
    assert len(report["model"]["fingerprint"]) == 64


def test_generate_from_ids_is_reproducible_across_processes(tmp_path):
    reports = []
    for i in range(2):
        path = tmp_path / f"r{i}.json"
        result = run_cli(
            "--model=tiny",
            "--prompt_ids=2,300,301,302,303",
            "--max_new_tokens=4",
            f"--report={path}",
        )
        assert result.returncode == 0, result.stderr
        reports.append(json.loads(path.read_text()))
    assert reports[0]["step_logits_sha256"] == reports[1]["step_logits_sha256"]
    assert reports[0]["continuation"] is not None  # the tiny model has a tokenizer


def test_deposit_then_inspect_on_another_mesh(tmp_path):
    target = tmp_path / "doc"
    report_path = tmp_path / "deposit.json"
    text = "A checked solution: 17 * 23 = 391. It is stored once and grafted later."
    result = run_cli(
        "--mode=deposit",
        f"--text={text}",
        f"--artifact={target}",
        "--mesh=data:2,model:4",
        f"--report={report_path}",
    )
    assert result.returncode == 0, result.stderr
    assert f"artifact: {target}" in result.stdout
    assert "] depositing " in result.stderr  # our progress is there; Orbax's save protocol is not
    assert third_party_info(result.stderr) == [], third_party_info(result.stderr)
    root = json.loads(report_path.read_text())["root"]
    assert f"root: {root}" in result.stdout

    again = run_cli(
        "--mode=deposit", f"--text={text}", f"--artifact={target}", "--mesh=data:2,model:4"
    )
    assert again.returncode == 0 and f"root: {root}" in again.stdout  # same content: a no-op

    other = run_cli("--mode=deposit", "--text=Different text.", f"--artifact={target}")
    assert other.returncode == 1
    assert "ArtifactExistsError" in other.stderr and "--overwrite" in other.stderr

    inspect = run_cli("--mode=inspect", f"--artifact={target}", "--mesh=model:8")
    assert inspect.returncode == 0, inspect.stderr
    assert (
        f"root: {root}" in inspect.stdout and "intact: restored on data:1,model:8" in inspect.stdout
    )

    # Damage one state file: inspect reports it and exits 1.
    data = max(
        (p for p in (target / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    damaged = run_cli("--mode=inspect", f"--artifact={target}")
    assert damaged.returncode == 1
    assert "NOT INTACT: CorruptArtifactError" in damaged.stdout


def test_deposit_from_a_text_file_and_missing_inputs(tmp_path):
    text_file = tmp_path / "manual.txt"
    text_file.write_text("Chapter 1. The cache holds keys after RoPE.\n", encoding="utf-8")
    ok = run_cli(
        "--mode=deposit",
        f"--text_file={text_file}",
        f"--artifact={tmp_path / 'a'}",
        "--chunk_size=8",
    )
    assert ok.returncode == 0, ok.stderr
    for argv, message in [
        (["--mode=deposit", f"--artifact={tmp_path / 'b'}"], "needs --text"),
        (["--mode=deposit", "--text=x"], "needs --artifact"),
        (
            [
                "--mode=deposit",
                f"--text_file={tmp_path / 'none.txt'}",
                f"--artifact={tmp_path / 'c'}",
            ],
            "no such file",
        ),
    ]:
        result = run_cli(*argv)
        assert result.returncode == 2 and message in result.stderr, result.stderr
    missing = run_cli("--mode=inspect", f"--artifact={tmp_path / 'nothing'}")
    assert missing.returncode == 1 and "ArtifactNotFoundError" in missing.stdout


def test_bench_prints_json_with_side_by_side_ratios(tmp_path):
    report_path = tmp_path / "bench.json"
    result = run_cli(
        "--mode=bench",
        "--bench=artifact",
        "--bench_mb=2",
        "--mesh=data:1,model:2",
        f"--report={report_path}",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    assert json.loads(result.stdout.split("report:")[0]) == report
    assert report["state_bytes"] >= 2 * 2**20 - 18 * 1024
    assert set(report["ratios"]) == {
        "read_over_plain_read",
        "tensorstore_read_over_plain_read",
        "restore_total_over_plain_read",
        "digest_speedup_over_hashlib_one_core",
    }
    assert all(v > 0 for v in report["gb_per_s"].values())
    # The verified restore's yardstick: the slower of a plain read and SHA-256 on all cores.
    assert report["limit_s"] == max(report["plain_read_s"], report["sha256_all_cores_s"]) > 0
    eff = report["restore_efficiency"]
    assert eff["target"] == 0.8 and eff["value"] == report["limit_s"] / report["restore_total_s"]
    assert eff["met"] == (eff["value"] >= 0.8)
    assert report["serial_floor_s"] == report["plain_read_s"] + report["sha256_all_cores_s"]
    assert report["efficiency_vs_serial_floor"] == (
        report["serial_floor_s"] / report["restore_total_s"]
    )
    # The format's own floor: TensorStore's read of the same arrays, then the same hashing.
    assert report["tensorstore_read_s"] > 0
    assert report["tensorstore_floor_s"] == (
        report["tensorstore_read_s"] + report["sha256_all_cores_s"]
    )
    assert report["best_efficiency_vs_serial_floor_with_tensorstore"] == (
        report["serial_floor_s"] / report["tensorstore_floor_s"]
    )


def test_graft_and_verify_from_the_cli(tmp_path):
    target = tmp_path / "doc"
    dep = run_cli(
        "--flagfile=configs/tiny_deposit.flags", f"--artifact={target}", "--mesh=data:2,model:4"
    )
    assert dep.returncode == 0, dep.stderr
    query = ["--query= What is 17 * 23?", "--max_new_tokens=4"]
    graft = run_cli(
        "--mode=graft",
        f"--artifact={target}",
        *query,
        "--mesh=data:2,model:4",
        f"--report={tmp_path / 'g.json'}",
    )
    assert graft.returncode == 0, graft.stderr
    assert "continuation:" in graft.stdout and "first token" in graft.stdout
    g = json.loads((tmp_path / "g.json").read_text())
    assert g["prefix_tokens"] > 0 and len(g["new_token_ids"][0]) == 4
    assert g["query_schedule"][0][0] == g["prefix_tokens"]  # the query starts at the prefix's end

    same = run_cli(
        "--mode=verify",
        f"--artifact={target}",
        *query,
        "--mesh=data:2,model:4",
        f"--report={tmp_path / 'a.json'}",
    )
    assert same.returncode == 0, same.stdout + same.stderr
    assert "reference a:" in same.stdout and "BIT-IDENTICAL" in same.stdout
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["graft"]["step_logits_sha256"] == g["step_logits_sha256"]  # graft is reproducible
    assert a["comparison"]["grafted_step_sha256"] == a["comparison"]["reference_step_sha256"]

    other = run_cli("--mode=verify", f"--artifact={target}", *query, "--mesh=model:8")
    assert other.returncode == 0, other.stdout + other.stderr
    assert "reference b:" in other.stdout and "BIT-IDENTICAL" in other.stdout

    few = run_cli(
        "--mode=verify", f"--artifact={target}", *query, "--mesh=data:1,model:2", devices=2
    )
    assert few.returncode == 3, few.stdout + few.stderr
    assert "reference c:" in few.stdout and "cannot be built" in few.stdout

    wrong = run_cli("--mode=graft", f"--artifact={target}", *query, "--seed=7")
    assert wrong.returncode == 1 and "weights fingerprint differs" in wrong.stderr


def test_prefix_chain_and_relocation_from_the_cli(tmp_path):
    parent, child = tmp_path / "parent", tmp_path / "child"
    common = ["--model=tiny", "--chunk_size=16", "--mesh=data:1,model:8"]
    dep = run_cli(
        *common, "--mode=deposit", "--text=Chapter one: the cache key.", f"--artifact={parent}"
    )
    assert dep.returncode == 0, dep.stderr
    dep = run_cli(
        *common,
        "--mode=deposit",
        "--text= Chapter two: grafting at own positions.",
        f"--artifact={child}",
        f"--parent={parent}",
        f"--report={tmp_path / 'd.json'}",
    )
    assert dep.returncode == 0, dep.stderr
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["parent"] and d["positions"][0] > 0 and "parent:" in dep.stdout
    query = ["--query= Which chapter?", "--max_new_tokens=3"]
    same = run_cli(*common, "--mode=verify", f"--artifact={child}", *query)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "a chain of 2 artifacts" in same.stdout and "BIT-IDENTICAL" in same.stdout

    refused = run_cli(*common, "--mode=graft", f"--artifact={child}", *query, "--graft_position=7")
    assert refused.returncode == 1 and "--allow_relocation" in refused.stderr

    moved = run_cli(
        *common,
        "--mode=verify",
        f"--artifact={child}",
        *query,
        "--graft_position=7",
        "--allow_relocation",
        f"--report={tmp_path / 'r.json'}",
    )
    assert moved.returncode == 3, moved.stdout + moved.stderr
    assert "APPROXIMATE" in moved.stdout and "reference r:" in moved.stdout
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["graft"]["exact"] is False and r["graft"]["positions"][0] == 7
    assert r["graft"]["relocation"]["to_position"] == 7
    assert 0 <= r["graft"]["relocation"]["max_kl_divergence"] < 1e-2


def test_cycle_deposits_grafts_and_verifies_in_one_run(tmp_path):
    result = run_cli(
        "--model=tiny",
        "--mode=cycle",
        "--text_file=configs/knowledge/cache_manual.txt",
        f"--artifact={tmp_path / 'doc'}",
        "--query= What is 17 * 23?",
        "--max_new_tokens=4",
        "--chunk_size=32",
        f"--report={tmp_path / 'c.json'}",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "== deposit" in result.stdout and "BIT-IDENTICAL" in result.stdout
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["deposit"]["root"] == report["verify"]["graft"]["root"]
    assert report["verify"]["comparison"]["bit_identical"] and report["exit_code"] == 0


def test_the_readme_flag_table_is_generated_from_the_config_fields():
    """Each setting is declared once (`config.setting`); the flags and this table come from it."""
    readme = (ROOT / "README.md").read_text()
    assert flags.markdown_table() in readme, (
        "README flag table is stale: python -m kvgraft_jax.cli.flags --markdown"
    )


def test_every_config_field_is_a_flag_with_the_same_default():
    import dataclasses

    from absl import flags as absl_flags

    fv = absl_flags.FlagValues()
    flags.define_flags(fv)
    fv(["kvgraft_jax"])
    for field in dataclasses.fields(config.RunConfig):
        value = fv[field.name].value
        if isinstance(field.default, tuple):
            value = tuple(type(d)(v) for d, v in zip(field.default, value, strict=True))
        assert value == field.default, field.name
    assert set(fv) >= {f.name for f in dataclasses.fields(config.RunConfig)}


@pytest.mark.parametrize(
    "mode, extra, needs",
    [
        ("deposit", {"text": "x", "artifact": "/nonexistent/a"}, "--mode=deposit"),
        ("generate", {"prompt": "Paris is"}, "--prompt"),
    ],
)
def test_a_model_without_a_tokenizer_is_refused_before_its_weights_load(mode, extra, needs):
    """gemma3_1b with random weights has no tokenizer here: text is refused by name, at once
    (its 1B weights would take a minute to make)."""
    from kvgraft_jax.cli import modes

    cfg = config.RunConfig(mode=mode, model="gemma3_1b", weights="random", **extra)
    with pytest.raises(config.ConfigError, match=f"{needs} works on text: pass --tokenizer=PATH"):
        modes.run(cfg)
