"""Exactness in the documented workflow, on the real Gemma 3 270M: deposit in one run, verify in a
later one, with default flags.

Each cell runs `python -m kvgraft_jax.main --mode=deposit` and then `--mode=verify` as separate
processes, as a user does. The two runs size their caches differently (the deposit fits the
prefix, the verify also fits the query and the answer); the cells are chosen so that most of them
land in different numbers of attention blocks, which is what made the prefix's bits differ before
attention became cache-length invariant. Prefixes lie below and above the 512-token sliding
window, at and off multiples of the chunk size, with chunk sizes 64 and 128, compacted and not, on
the deposit mesh (reference a) and on another mesh (reference b). Every cell must print
BIT-IDENTICAL and exit 0.
"""

import json
from pathlib import Path

import pytest
from cli_runs import run_cli

from kvgraft_jax.core import attention
from kvgraft_jax.run import config, runtime

ROOT = Path(__file__).resolve().parents[1]
QUERY = " Question: what must match? Answer:"
WINDOW = 512  # Gemma 3 270M's sliding window

# (prefix tokens, chunk size, compact, deposit mesh, verify mesh, extra verify flags)
CELLS = {
    "issue_433_chunk128": (433, 128, True, "data:1,model:1", "data:1,model:1", ()),
    "below_window_off_chunk_64_full": (500, 64, False, "data:1,model:1", "data:1,model:1", ()),
    "above_window_on_chunk_128": (768, 128, True, "data:1,model:1", "data:1,model:1", ()),
    "above_window_off_chunk_64_other_mesh": (
        700,
        64,
        True,
        "data:1,model:1",
        "data:2,model:4",
        ("--max_new_tokens=80",),
    ),
    "below_window_off_chunk_128_full_other_mesh": (
        250,
        128,
        False,
        "data:1,model:1",
        "model:8",
        (),
    ),
    "sharded_deposit_above_window_on_chunk_64": (
        768,
        64,
        False,
        "data:2,model:4",
        "data:2,model:4",
        (),
    ),
}


@pytest.fixture(scope="module")
def tok():
    return runtime.load_tokenizer(config.RunConfig(model="gemma3_270m", prompt="x"))


def text_of(tok, tokens: int) -> str:
    """A text that the 270M's tokenizer turns into exactly `tokens` ids (BOS included)."""
    words = (ROOT / "configs/knowledge/cache_manual.txt").read_text().split()
    text = ""
    for i in range(10_000):
        candidate = (text + " " + words[i % len(words)]).strip()
        if len(tok.encode(candidate, add_bos=True)) > tokens:
            break
        text = candidate
    while len(tok.encode(text, add_bos=True)) < tokens:
        text += " a"
    assert len(tok.encode(text, add_bos=True)) == tokens
    return text


def _cli(*args: str):
    return run_cli("--model=gemma3_270m", *args, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("cell", list(CELLS))
def test_deposit_then_verify_in_separate_runs_is_bit_identical(cell, tok, tmp_path):
    tokens, chunk, compact, deposit_mesh, verify_mesh, extra = CELLS[cell]
    notes = tmp_path / "notes.txt"
    notes.write_text(text_of(tok, tokens))
    art = tmp_path / "notes"
    dep = _cli(
        "--mode=deposit",
        f"--mesh={deposit_mesh}",
        f"--chunk_size={chunk}",
        f"--text_file={notes}",
        f"--artifact={art}",
        "--compact" if compact else "--nocompact",
        f"--report={tmp_path / 'deposit.json'}",
    )
    assert dep.returncode == 0, dep.stdout + dep.stderr
    deposited = json.loads((tmp_path / "deposit.json").read_text())
    assert deposited["tokens"] == tokens
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["protocol"]["attention"] == attention.ATTENTION
    kept_from = (manifest["compaction"] or {}).get("kept_from", 0)
    assert kept_from == (tokens - WINDOW if compact and tokens > WINDOW else 0)

    ver = _cli(
        "--mode=verify",
        f"--mesh={verify_mesh}",
        f"--artifact={art}",
        f"--query={QUERY}",
        "--max_new_tokens=8",
        *extra,
        f"--report={tmp_path / 'verify.json'}",
    )
    assert ver.returncode == 0, ver.stdout + ver.stderr
    assert "BIT-IDENTICAL" in ver.stdout
    report = json.loads((tmp_path / "verify.json").read_text())
    kind = "a" if deposit_mesh == verify_mesh else "b"
    assert report["reference"].startswith(f"{kind}:")
    assert report["comparison"]["bit_identical"]
    steps = report["comparison"]["grafted_step_sha256"]
    assert steps == report["comparison"]["reference_step_sha256"] and len(steps) >= 8
    assert all(t["matched"] for t in report["contract"] if t["name"] != "mesh")
    # The graft's cache (prefix + query + answer) is another length than the deposit's.
    graft_slots = report["graft"]["cache_slots"]
    assert deposited["cache_slots"] == attention.cache_slots(tokens)
    if cell != "issue_433_chunk128":
        assert graft_slots != deposited["cache_slots"], "the cell needs another cache length"
    # The recompute a user would write: prefix + query as one text in chunks of the same size, in
    # the graft's own cache. Where the prefix fills whole chunks that is the reference's schedule.
    natural = report["natural"]
    assert natural["cache_slots"] == graft_slots
    assert natural["same_schedule_as_graft"] == (tokens % chunk == 0)
    if natural["same_schedule_as_graft"]:
        assert natural["bit_identical"]
        assert natural["same_computation_as_reference"] == (kind == "a")
