"""The grafting benchmark on the tiny model: every measured field present and self-consistent."""

import json

from kvgraft_jax.bench import graft_bench
from kvgraft_jax.cli import modes
from kvgraft_jax.run import config


def test_graft_bench_reports_side_by_side(tmp_path):
    report = tmp_path / "bench" / "graft.json"
    cfg = config.RunConfig(
        mode="bench",
        bench="graft",
        model="tiny",
        mesh="data:1,model:1",
        chunk_size=16,
        bench_lengths=(24, 72),
        report=str(report),
    )
    result = graft_bench.run(cfg, repeats=1, directory=str(tmp_path))
    modes.write_report(result, str(report))
    data = json.loads(report.read_text())
    short, long = data["lengths"]
    assert (short["tokens"], long["tokens"]) == (24, 72)
    for row in (short, long):
        assert row["bit_identical"] is True  # graft vs recompute, every decode step
        assert row["graft_ttft_s"] > 0 and row["recompute_ttft_s"] > 0
        assert row["restore"]["plain_read_s"] > 0 and row["digest"]["hashlib_one_core_s"] > 0
        assert row["decode_tokens_per_s"] > 0
        r = row["restore"]
        assert r["limit_s"] == max(r["plain_read_s"], r["sha256_all_cores_s"]) > 0
        assert r["efficiency"]["value"] == r["limit_s"] / r["restore_verify_s"]
        assert r["serial_floor_s"] == r["plain_read_s"] + r["sha256_all_cores_s"]
        assert "no GGUF" in row["llama_cpp"]["skipped"]
    # Window 16: past it, local layers store 16 positions however long the prefix.
    assert long["bytes"]["compacted_over_full"] < short["bytes"]["compacted_over_full"] < 1.0
    assert long["bytes"]["compacted_per_token"] < long["bytes"]["full_per_token"]
    assert "8,192" in data["targets"]["note"]
    assert (report.with_suffix(".png")).read_bytes()[:4] == b"\x89PNG"
    assert data["machine"]["cpu_count"] >= 1 and data["versions"]["jax"]


def test_bench_lengths_flag():
    from kvgraft_jax.cli import flags

    cfg = flags.parse(["kvgraft_jax", "--mode=bench", "--bench=graft", "--bench_lengths=64,128"])
    assert cfg.bench_lengths == (64, 128)
