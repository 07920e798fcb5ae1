"""The grafting benchmark on the tiny model: every measured field present and self-consistent."""

import json

import pytest

from kvgraft_jax.bench import artifact_bench, graft_bench, tables
from kvgraft_jax.cli import reports
from kvgraft_jax.run import config


def test_the_plain_read_floor_reads_every_state_byte_once(tmp_path):
    """The floor reads into one buffer sized to the largest file: every byte of every file once,
    short files and empty ones included, none counted twice."""
    sizes = {"state/big": 70_001, "state/d/small": 5, "state/empty": 0, "state/d/mid": 4096}
    for name, size in sizes.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    seconds, total = artifact_bench.plain_read(tmp_path)
    assert total == sum(sizes.values()) and seconds > 0


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
    reports.write(reports.BenchReport(result), report)
    data = json.loads(report.read_text())
    short, long = data["lengths"]
    assert (short["tokens"], long["tokens"]) == (24, 72)
    for row in (short, long):
        assert row["bit_identical"] is True  # graft vs recompute, every decode step (each sample)
        assert row["samples"] == graft_bench.RESTORE_REPEATS
        assert row["graft_ttft_s"] > 0 and row["recompute_ttft_s"] > 0
        assert row["restore"]["plain_read_s"] > 0 and row["digest"]["hashlib_one_core_s"] > 0
        assert row["decode_tokens_per_s"] > 0
        r = row["restore"]
        assert r["plain_read_s"] > 0 and r["sha256_all_cores_s"] > 0 and r["restore_verify_s"] > 0
        assert r["tensorstore_floor_s"] == r["tensorstore_read_s"] + r["sha256_all_cores_s"]
        assert r["efficiency_vs_tensorstore_floor"] == (
            r["tensorstore_floor_s"] / r["restore_verify_s"]
        )
        assert "no GGUF" in row["llama_cpp"]["skipped"]
    # Window 16: past it, local layers store 16 positions however long the prefix.
    assert long["bytes"]["compacted_over_full"] < short["bytes"]["compacted_over_full"] < 1.0
    assert long["bytes"]["compacted_per_token"] < long["bytes"]["full_per_token"]
    assert "8,192" in data["targets"]["note"]
    assert (report.with_suffix(".png")).read_bytes()[:4] == b"\x89PNG"
    assert data["machine"]["cpu_count"] >= 1 and data["versions"]["jax"]
    table = tables.markdown(data).splitlines()
    assert table[2].startswith("| 24 |") and table[3].startswith("| 72 |")
    assert " / n/a / n/a |" in table[2]  # no GGUF for the tiny model: no llama.cpp peers


def test_bench_lengths_flag():
    from kvgraft_jax.cli import flags

    cfg = flags.parse(["kvgraft_jax", "--mode=bench", "--bench=graft", "--bench_lengths=64,128"])
    assert cfg.bench_lengths == (64, 128)


def _row(
    tokens,
    *,
    ttft_ratio,
    compacted,
    efficiency,
    ours_per_token=None,
    llama_per_token=None,
    speed=1.0,
):
    """A row whose every ratio to llama.cpp is `speed` in our favour (>1) or against (<1)."""
    row = {
        "tokens": tokens,
        "graft_ttft_s": 0.3,
        "graft_parts_s": {"restore": 0.05, "verify": 0.05},
        "graft_over_recompute_ttft": ttft_ratio,
        "recompute_ttft_s": 0.3 / ttft_ratio,
        "bytes": {"compacted_over_full": compacted},
        "restore": {
            "efficiency": efficiency,
            # `efficiency` took a restore of 1 s: its value is the limit in seconds.
            "limit_s": efficiency["value"],
            "serial_floor_s": efficiency["value"],
            "tensorstore_floor_s": 0.04,
            "restore_verify_per_token_s": ours_per_token,
            "efficiency_vs_serial_floor": efficiency["value"],
        },
        "recompute_prefill_s": 10.0,
        "decode_tokens_per_s": 10.0,
        "decode_traffic": {"decode_bytes_per_step": 6e8, "decode_gb_per_s": 6.0},
    }
    if llama_per_token is not None:
        # llama.cpp's graft as much slower or faster than ours as its state load is per token.
        row["llama_cpp"] = {
            "state_load_per_token_s": llama_per_token,
            "graft_ttft_s": 0.3 * llama_per_token / ours_per_token,
            "decode_tokens_per_s": 30.0,
            "decode_traffic": {"decode_bytes_per_step": 3e8, "decode_gb_per_s": 9.0},
        }
        row["llama_cpp_f32"] = {"decode_tokens_per_s": 10.0 / speed, "prefill_s": 10.0 * speed}
    return row


def test_targets_are_met_or_not_from_the_numbers_of_the_run():
    """Both branches of every target: a run that meets them and one that misses each."""
    limit = graft_bench.TARGETS["graft_ttft_over_recompute_at_8192"]
    good = artifact_bench.efficiency(limit_s=0.9, restore_s=1.0)
    bad = artifact_bench.efficiency(limit_s=0.5, restore_s=1.0)
    assert (good["value"], good["met"]) == (0.9, True)
    assert (bad["value"], bad["met"]) == (0.5, False)
    assert artifact_bench.efficiency(limit_s=1.0, restore_s=0.0)["met"] is False

    met = graft_bench.targets(
        [
            _row(
                8192,
                ttft_ratio=limit / 2,
                compacted=0.1,
                efficiency=good,
                ours_per_token=1e-6,
                llama_per_token=2e-6,
                speed=1.5,
            )
        ]
    )
    missed = graft_bench.targets(
        [
            _row(
                8192,
                ttft_ratio=limit * 2,
                compacted=0.99,
                efficiency=bad,
                ours_per_token=3e-6,
                llama_per_token=2e-6,
                speed=0.5,
            )
        ]
    )
    names = {
        "graft_ttft_over_recompute_at_8192",
        "compacted_over_full_bytes_at_8192",
        "restore_verify_efficiency_at_8192",
        "graft_restore_verify_per_token_over_llama_cpp_state_load_per_token",
        "graft_ttft_over_llama_cpp_graft_ttft_at_8192",
        "restore_verify_over_serial_floor_at_8192",
        "decode_tokens_per_s_over_llama_cpp_f32_at_8192",
        "recompute_prefill_over_llama_cpp_f32_prefill_at_8192",
    }
    reported = "decode_against_llama_cpp_q4_at_8192"  # not a target: ratios with their bytes
    assert set(met) == set(missed) == names | {reported}
    assert met[reported]["tokens_per_s_ratio"] == 10.0 / 30.0
    assert met[reported]["bytes_per_step_ratio"] == 2.0
    met.pop(reported)
    missed.pop(reported)
    assert all(met[n]["met"] is True for n in names), met
    assert all(missed[n]["met"] is False for n in names), missed
    assert (
        missed["graft_restore_verify_per_token_over_llama_cpp_state_load_per_token"]["value"] == 1.5
    )
    # What each restore figure would be with restore + verify at TensorStore's floor (0.04 s in
    # place of the graft's 0.05 + 0.05), the rest as measured.
    at_floor = {
        n: v["at_tensorstore_floor"] for n, v in missed.items() if "at_tensorstore_floor" in v
    }
    assert at_floor == {
        "graft_ttft_over_recompute_at_8192": (0.3 - 0.05 - 0.05 + 0.04) / (0.3 / (limit * 2)),
        "graft_ttft_over_llama_cpp_graft_ttft_at_8192": (0.3 - 0.05 - 0.05 + 0.04)
        / (0.3 * 2e-6 / 3e-6),
        "graft_restore_verify_per_token_over_llama_cpp_state_load_per_token": 0.04 / 8192 / 2e-6,
        "restore_verify_efficiency_at_8192": 0.5 / 0.04,
        "restore_verify_over_serial_floor_at_8192": 0.5 / 0.04,
    }
    assert "note" in graft_bench.targets(
        [_row(512, ttft_ratio=0.1, compacted=0.1, efficiency=good)]
    )


def test_the_readme_tables_come_from_the_committed_report():
    """The README's benchmark tables are `--markdown` of the committed report, byte for byte."""
    from cli_runs import ROOT

    report = json.loads((ROOT / "benchmarks" / "graft_270m_cpu.json").read_text())
    table = tables.markdown(report)
    readme = (ROOT / "README.md").read_text()
    begin, end = "<!-- graft-bench:begin -->\n", "<!-- graft-bench:end -->"
    assert readme[readme.index(begin) + len(begin) : readme.index(end)] == table
    assert report["model"] == "gemma3_270m" and [r["tokens"] for r in report["lengths"]] == [
        512,
        2048,
        8192,
    ]
    assert all(r["bit_identical"] for r in report["lengths"])
    assert "llama_cpp_f32" in report["lengths"][-1]

    batches = json.loads((ROOT / "benchmarks" / "batch_270m_cpu.json").read_text())
    begin, end = "<!-- batch-bench:begin -->\n", "<!-- batch-bench:end -->"
    assert readme[readme.index(begin) + len(begin) : readme.index(end)] == tables.for_report(
        batches
    )
    assert [s["batch_size"] for s in batches["batch_sizes"]] == [1, 4, 8]
    assert all(s["reference"]["bit_identical"] for s in batches["batch_sizes"])


def test_batch_bench_reports_every_batch_size_against_one(tmp_path):
    """`--bench=batch` on the tiny model: the same queue through 1 and 2 rows, each run's
    reference replayed and compared bit for bit, the ratios to one row, and the table."""
    from kvgraft_jax.bench import batch_bench

    report = tmp_path / "bench" / "batch.json"
    cfg = config.RunConfig(
        mode="bench",
        bench="batch",
        model="tiny",
        mesh="data:2,model:1",
        chunk_size=64,
        max_new_tokens=4,
        bench_batch_sizes=(2, 1),
        report=str(report),
    )
    result = batch_bench.run(cfg, directory=str(tmp_path))
    reports.write(reports.BenchReport(result), report)
    data = json.loads(report.read_text())
    one, two = data["batch_sizes"]
    assert (one["batch_size"], two["batch_size"]) == (1, 2)
    assert data["items"]["count"] == 4 and data["mesh"] == "data:2,model:1"
    for size in (one, two):
        assert size["reference"] == {"bit_identical": True, "identical_items": 4, "items": 4}
        assert size["hits"]["items"] == size["attempts"]["items"] == 4
        assert size["hits"]["decode_tokens"] > 0
        for kind in ("hits", "attempts"):  # the median of three runs, all bit-identical
            timed = size[kind]
            assert timed["timed_runs"] == 3 and timed["runs_bit_identical"] is True
            assert sorted(timed["decode_tokens_per_s_runs"])[1] == timed["decode_tokens_per_s"]
    assert one["weight_layout"] == "contract-last" and two["weight_layout"] == "gemm-f32-v2"
    assert two["rows_sharded_over_data"] and not one["rows_sharded_over_data"]
    assert "against_alone" not in one and two["against_alone"]["items"] == 4
    assert one["over_batch_of_one"]["hits"]["decode_tokens_per_s"] == 1.0
    assert "B = 8" in data["targets"]["note"]  # the target needs sizes 1 and 8
    assert report.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    table = tables.for_report(data).splitlines()
    assert table[2].startswith("| 1 | ") and table[3].startswith("| 2 | ")
    assert "4/4 yes" in table[3]


def test_bench_batch_sizes_flag_is_checked():
    from kvgraft_jax.cli import flags

    cfg = flags.parse(["kvgraft_jax", "--mode=bench", "--bench=batch", "--bench_batch_sizes=1,8"])
    assert cfg.bench_batch_sizes == (1, 8)
    with pytest.raises(config.ConfigError, match="--bench_batch_sizes must be positive"):
        config.RunConfig(mode="bench", bench="batch", bench_batch_sizes=(0,))
