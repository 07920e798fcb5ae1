"""The README's benchmark tables, generated from a `--bench=graft` or `--bench=batch` report
(never typed by hand).

    python -m kvgraft_jax.bench.tables benchmarks/graft_270m_cpu.json
    python -m kvgraft_jax.bench.tables benchmarks/batch_270m_cpu.json

Reads only the JSON: no JAX, no model. `tests/test_graft_bench.py` checks that the README holds
exactly this output for the committed report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def _peer(row: dict[str, Any], name: str, key: str, fmt: str) -> str:
    side = row.get(name) or {}
    value = side.get(key)
    if value is None and "decode_traffic" in side and key in side["decode_traffic"]:
        value = side["decode_traffic"][key]
    return "n/a" if value is None else format(value, fmt)


def _rounded(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return round(value, 3) if isinstance(value, float) else value


def _target_rows(targets: dict[str, Any], fmt: str) -> list[str]:
    """A report's targets as table rows: value, target and verdict (a reported figure without a
    target in JSON; a note as is)."""
    rows = []
    for name, verdict in targets.items():
        if isinstance(verdict, dict) and "met" in verdict:
            floor = verdict.get("at_tensorstore_floor")
            at_floor = f" ({floor:{fmt}} at the TensorStore floor)" if floor is not None else ""
            rows.append(
                f"| `{name}` | {verdict['value']:{fmt}}{at_floor} | {verdict['target']:{fmt}} | "
                f"{'met' if verdict['met'] else 'NOT met'} |"
            )
        elif isinstance(verdict, dict):
            detail = json.dumps(_rounded(verdict), sort_keys=True)
            rows.append(f"| `{name}` | {detail} | reported, not a target | |")
        else:
            rows.append(f"| {name} | {verdict} | | |")
    return rows


def markdown(report: dict[str, Any]) -> str:
    """The README's benchmark tables from a `--bench=graft` report: one row per prefix length,
    then every target with its value and verdict."""
    lines = [
        "| prefix tokens | recompute TTFT | graft TTFT | graft parts, ms (restore / verify / "
        "insert / query + first token / manifests + rest) | decode tok/s (ours / llama.cpp F32 / "
        "Q4_K_M) | decode GB/s moved (ours / F32 / Q4_K_M) | prefill s (ours / F32 / Q4_K_M) | "
        "restore + verify / llama.cpp state load (Q4_K_M), ms | restore vs serial floor | "
        "bit-identical |",
        "| " + " | ".join(["---"] * 10) + " |",
    ]
    for row in report["lengths"]:
        parts = row["graft_parts_s"]
        lines.append(
            f"| {row['tokens']:,} | {row['recompute_ttft_s']:.2f} s | {row['graft_ttft_s']:.3f} s | "
            + " / ".join(
                _ms(parts[k])
                for k in (
                    "restore",
                    "verify",
                    "insert",
                    "query_and_first_token",
                    "manifests_and_the_rest",
                )
            )
            + f" | {row['decode_tokens_per_s']:.1f} / {_peer(row, 'llama_cpp_f32', 'decode_tokens_per_s', '.1f')}"
            f" / {_peer(row, 'llama_cpp', 'decode_tokens_per_s', '.1f')}"
            f" | {row['decode_traffic']['decode_gb_per_s']:.1f} / "
            f"{_peer(row, 'llama_cpp_f32', 'decode_gb_per_s', '.1f')} / "
            f"{_peer(row, 'llama_cpp', 'decode_gb_per_s', '.1f')}"
            f" | {row['recompute_prefill_s']:.2f} / {_peer(row, 'llama_cpp_f32', 'prefill_s', '.2f')}"
            f" / {_peer(row, 'llama_cpp', 'prefill_s', '.2f')}"
            f" | {_ms(row['restore']['restore_verify_s'])} / "
            f"{_peer(row, 'llama_cpp', 'state_load_s', '.3f')}"
            f" | {row['restore']['efficiency_vs_serial_floor']:.0%}"
            f" | {'yes' if row['bit_identical'] else 'NO'} |"
        )
    lines += [
        "",
        "| target (at 8,192 tokens) | value | target | met |",
        "| --- | --- | --- | --- |",
    ]
    lines += _target_rows(report["targets"], ".4g")
    return "\n".join(lines) + "\n"


def batch_markdown(report: dict[str, Any]) -> str:
    """The README's batch table from a `--bench=batch` report: one row per batch size."""
    items = report["items"]
    lines = [
        "| rows | decode tok/s, hits (x B = 1) | items/s, hits (x B = 1) | decode tok/s, attempts "
        "(x B = 1) | mean first token, hits | weights read | reference bit-identical | "
        "bit-identical to alone / argmax agreement |",
        "| " + " | ".join(["---"] * 8) + " |",
    ]
    for size in report["batch_sizes"]:
        ratio = size.get("over_batch_of_one", {})
        hits, attempts = size["hits"], size["attempts"]
        alone = size.get("against_alone")
        lines.append(
            f"| {size['batch_size']} | {hits['decode_tokens_per_s']:.1f} "
            f"({ratio.get('hits', {}).get('decode_tokens_per_s', float('nan')):.2f}x) | "
            f"{hits['items_per_s']:.2f} ({ratio.get('hits', {}).get('items_per_s', float('nan')):.2f}x) | "
            f"{attempts['decode_tokens_per_s']:.1f} "
            f"({ratio.get('attempts', {}).get('decode_tokens_per_s', float('nan')):.2f}x) | "
            f"{hits['mean_first_token_s']:.2f} s | {size['weight_layout']} | "
            f"{size['reference']['identical_items']}/{size['reference']['items']} "
            f"{'yes' if size['reference']['bit_identical'] else 'NO'} | "
            + (
                f"{alone['identical_items']}/{alone['items']} / {alone['argmax_agreement']:.1%}"
                if alone
                else "(is the alone run)"
            )
            + " |"
        )
    lines += [
        "",
        f"{items['count']} items per queue: hits graft prefixes of "
        f"{', '.join(str(n) for n in items['hit_prefix_tokens'])} tokens and read a "
        f"{items['hit_query_tokens']}-token query; attempts read {items['attempt_tokens']} tokens "
        f"with no prefix; {items['new_tokens_per_item']} new tokens each.",
        "",
        "| target | value | target | met |",
        "| --- | --- | --- | --- |",
    ]
    lines += _target_rows(report["targets"], ".3g")
    return "\n".join(lines) + "\n"


def for_report(report: dict[str, Any]) -> str:
    """The tables of either benchmark's report (`--bench=graft` or `--bench=batch`)."""
    return batch_markdown(report) if "batch_sizes" in report else markdown(report)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m kvgraft_jax.bench.tables REPORT.json", file=sys.stderr)
        return 2
    sys.stdout.write(for_report(json.loads(Path(argv[1]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
