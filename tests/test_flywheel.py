"""The flywheel on the tiny model: seed, solve twice, reuse; the reports and their accounting."""

import dataclasses
import json
import os
from pathlib import Path

import pytest

from kvgraft_jax.cli import modes, reports
from kvgraft_jax.core import environment, tokenizer
from kvgraft_jax.core import model as model_lib
from kvgraft_jax.library import accounting, catalog, dataset, flywheel, library, verifiers
from kvgraft_jax.run import config
from kvgraft_jax.store import files as files_lib
from kvgraft_jax.store import manifest

SETTINGS = flywheel.Settings(
    attempts=2, solve_tokens=8, answer_tokens=4, chunk_size=16, passes=2, seed=3
)


@pytest.fixture
def ctx(tiny_params_on, tmp_path):
    mesh, params = tiny_params_on("1")
    module = model_lib.build_model("tiny")
    context = flywheel.Context(
        module=module,
        params=params,
        mesh=mesh,
        tok=tokenizer.tiny_tokenizer(),
        model=model_lib.ModelInfo(
            "tiny",
            model_lib.config_to_json(module.config),
            model_lib.weights_fingerprint(module.config, params),
        ),
        model_name="tiny",
        versions=environment.versions(),
        library=library.Library(tmp_path / "lib"),
    )
    yield context
    context.library.close()


def _solvable(ctx, problem_id):
    """A problem whose answer is what the tiny model's greedy attempt states (so it verifies)."""
    probe = dataset.Record(problem_id, "What is the answer to question 7?", "unknown")
    _, solution, _, _ = flywheel.solve_attempt(ctx, probe, 0, SETTINGS)
    answer = verifiers.extract_answer(solution, integer=False)
    assert answer and verifiers.check_answer(solution, answer).ok, solution
    return dataclasses.replace(probe, answer=answer)


def test_seed_then_two_passes_show_reuse(ctx, tmp_path):
    seed_set, problems = dataset.make_sample()
    seeded = flywheel.seed_library(ctx, seed_set, SETTINGS, progress=False)
    assert len(seeded.accepted) == 10 and len(seeded.artifacts) == 10
    assert sorted(seeded.rejected) == ["arith-bad-program", "arith-bad-solution"]
    again = flywheel.seed_library(ctx, seed_set, SETTINGS, progress=False)
    assert again.accepted == [] and len(again.duplicates) == 10  # nothing deposited twice

    solvable = _solvable(ctx, "solvable")
    hopeless = dataset.Record("hopeless", "What is the secret code of the vault?", "zzqx-never")
    records = [problems[0], problems[1], solvable, hopeless]  # problems[1] is reworded
    out = tmp_path / "problems.jsonl"
    result = flywheel.solve(ctx, records, SETTINGS, out, progress=False)
    by = {(r.id, r.pass_): r for r in result.results}

    exact, reworded = by[(problems[0].id, 1)], by[(problems[1].id, 1)]
    assert (exact.hit, exact.route) == (True, "exact") and (reworded.hit, reworded.route) == (
        True,
        "search",
    )
    for hit in (exact, reworded):
        assert hit.prefill_tokens_avoided > 0 and hit.restore_ms > 0
        assert hit.prefill_flops_avoided_estimate > 0
        attempted = sum(a.decode_tokens for a in hit.attempts)
        assert 1 <= hit.decode_tokens - attempted <= SETTINGS.answer_tokens
        # The tiny model's answers from a graft are noise: a wrong one is a wrong route, and the
        # problem is attempted in the same pass; a right one needs no attempt.
        assert bool(hit.attempts) == hit.wrong_route
    first = by[("solvable", 1)]
    assert (first.hit, first.correct, first.deposited) == (False, True, True)
    assert first.attempts[0].sampling == "greedy" and first.attempts[0].verified
    second = by[("solvable", 2)]
    assert (second.hit, second.route) == (True, "exact") and second.prefill_tokens_avoided > 0
    if second.wrong_route:  # attempted again: its verified solution is the same artifact
        assert second.attempts and second.root in (None, first.root)
    else:
        assert second.root == first.root and second.decode_tokens < first.decode_tokens
    lost = by[("hopeless", 1)]
    assert (lost.hit, lost.correct, lost.deposited, len(lost.attempts)) == (False, False, False, 2)
    assert lost.attempts[1].sampling.startswith("temperature=0.8 seed=")
    assert by[("hopeless", 2)].hit is False
    assert any(
        r[0] == "hopeless" and r[3] == "solve pass 1" for r in ctx.library.catalog.rejections()
    )
    # A route found wrong in pass 1 is not taken in pass 2.
    for (problem_id, pass_), r in by.items():
        if pass_ == 1 and r.wrong_route:
            again = by[(problem_id, 2)]
            assert not (again.hit and again.matched_item == r.matched_item and again.root == r.root)
    # Every line of problems.jsonl carries the promised fields; every run's FLOPs are counted.
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 8
    need = {
        "id",
        "pass",
        "hit",
        "correct",
        "decode_tokens",
        "prefill_tokens_avoided",
        "restore_ms",
        "wall_ms",
    }
    assert all(need <= set(line) for line in lines)
    assert all(
        line["flops_estimate"] > 0 and line["energy_from_wall_j_estimate"] > 0 for line in lines
    )
    p1, p2 = result.passes
    assert p1["hits"] == 2 and p2["hits"] >= 1  # pass 2 grafts at least what pass 1 deposited
    assert p1["wrong_routes"] == sum(by[(r.id, 1)].wrong_route for r in records)
    assert result.library["items"] >= 11 and result.library["tokens_stored"] > 0


def test_a_grafted_answer_that_fails_is_a_wrong_route_attempted_at_once(ctx, tmp_path):
    """A hit's correctness follows the decoded answer: the catalog's item for this very problem
    says 13, the dataset's verifier wants something the model never says."""
    seed = dataset.Record("ten-plus-three", "What is 10 + 3?", "13", solution="10 + 3 = 13")
    assert flywheel.seed_library(ctx, [seed], SETTINGS, progress=False).accepted
    record = dataset.Record("ten-plus-three", "What is 10 + 3?", "zzqx-never")
    result = flywheel.solve(ctx, [record], SETTINGS, tmp_path / "p.jsonl", progress=False)
    first, second = result.results
    assert (first.hit, first.route, first.wrong_route, first.correct) == (
        True,
        "exact",
        True,
        False,
    )
    assert len(first.attempts) == SETTINGS.attempts  # fell back to attempts in the same pass
    key = catalog.normalize_key(record.problem)
    assert ctx.library.catalog.wrong_routes(key, ctx.model.fingerprint) == {first.root}
    assert (second.hit, second.route) == (False, "miss")  # never routed there again
    assert result.passes[0]["wrong_routes"] == 1 and result.passes[1]["wrong_routes"] == 0


def test_solve_mode_writes_summary_problems_and_plot(ctx, tmp_path, monkeypatch):
    """The CLI's mode function end to end: files beside --report, estimates labelled."""
    seed_file, problem_file = tmp_path / "seed.jsonl", tmp_path / "problems.jsonl"
    seed_set, problems = dataset.make_sample()
    dataset.write_jsonl(seed_set[:2], seed_file)
    dataset.write_jsonl(problems[:2] + problems[-1:], problem_file)
    lib = tmp_path / "lib2"
    common = dict(model="tiny", chunk_size=16, library=str(lib), mesh="data:1,model:1")
    seeded = modes.run_deposit(config.RunConfig(mode="deposit", dataset=str(seed_file), **common))
    assert seeded.catalog_items == 2
    report_path = tmp_path / "out" / "summary.json"
    cfg = config.RunConfig(
        mode="solve",
        dataset=str(problem_file),
        report=str(report_path),
        attempts=1,
        solve_tokens=4,
        answer_tokens=3,
        passes=2,
        joules_per_flop=2e-12,
        device_watts=300.0,
        **common,
    )
    report = modes.run_solve(cfg)
    reports.write(report, report_path)
    summary = json.loads(report_path.read_text())
    p1, p2 = summary["passes"]
    # Pass 2 grafts what pass 1 grafted right; a wrong route (the tiny model's answers from a
    # graft are noise) is not taken again.
    assert p1["hits"] == 2 and p2["hits"] == p1["hits"] - p1["wrong_routes"]
    assert summary["assumptions"]["joules_per_flop"] == 2e-12
    assert "estimate" in summary["assumptions"]["energy_from_flops_j"]
    p1 = summary["passes"][0]
    assert p1["energy_from_flops_j_estimate"] == pytest.approx(p1["flops_estimate"] * 2e-12)
    assert summary["library"]["stored_over_attended"] > 0
    png = (report_path.parent / "flywheel.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((report_path.parent / "problems.jsonl").read_text().splitlines()) == 6


def test_flop_counter_uses_xla_cost_analysis(ctx):
    eng = ctx.engine(64)
    flops = accounting.program_flops(eng.prefill_program(16))
    assert flops > 0
    assert accounting.program_flops(eng.prefill_program(32)) > flops  # more tokens, more work


def test_route_never_crosses_models(ctx):
    seed_set, _ = dataset.make_sample()
    flywheel.seed_library(ctx, seed_set[:1], SETTINGS, progress=False)
    assert ctx.library.route(seed_set[0].problem, ctx.model.fingerprint, threshold=0.8)
    assert ctx.library.route(seed_set[0].problem, "another-weights", threshold=0.8) is None
    assert catalog.normalize_key(seed_set[0].problem) in [
        i.key for i in ctx.library.catalog.items()
    ]


def test_chapters_hold_several_items_and_route_to_one_artifact(ctx):
    seed_set, problems = dataset.make_sample()
    chapters = dataclasses.replace(SETTINGS, chapter_items=4)
    seeded = flywheel.seed_library(ctx, seed_set, chapters, progress=False)
    assert len(seeded.accepted) == 10 and len(seeded.artifacts) == 3  # 4 + 4 + 2 items
    items = ctx.library.catalog.items(ctx.model.fingerprint)
    assert sorted({i.root for i in items}) == sorted(seeded.artifacts)
    first = manifest.read_manifest(ctx.library.artifact_path(seeded.artifacts[0]))
    assert len(first.knowledge.items) == 4 and first.knowledge.text.count("Problem:") == 4
    # A problem in the middle of the first chapter routes to that chapter, grafted whole.
    match = ctx.library.route(problems[2].problem, ctx.model.fingerprint, threshold=0.8)
    assert match.item.root == seeded.artifacts[0] and match.item.artifact_tokens == first.length
    result = flywheel.solve_one(ctx, problems[2], 1, chapters)
    assert result.hit and result.prefill_tokens_avoided == first.length


@pytest.mark.parametrize("rows", [1, 2])
def test_a_damaged_artifact_is_quarantined_and_the_run_goes_on(ctx, tmp_path, rows):
    """Alone, or in a batch with the other problem's graft (which the refusal must not lose)."""
    settings = dataclasses.replace(SETTINGS, batch_size=rows)
    records = [
        dataset.Record("ten-plus-three", "What is 10 + 3?", "13", solution="10 + 3 = 13"),
        dataset.Record("ten-plus-four", "What is 10 + 4?", "14", solution="10 + 4 = 14"),
    ]
    seeded = flywheel.seed_library(ctx, records, SETTINGS, progress=False)
    assert len(seeded.artifacts) == 2
    damaged = ctx.library.route("What is 10 + 3?", ctx.model.fingerprint, threshold=0.8).item.root
    state = Path(os.fspath(ctx.library.artifact_path(damaged))) / files_lib.STATE_DIR
    victim = max((p for p in state.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    original = victim.read_bytes()
    victim.write_bytes(original[:-1])  # truncated: refused by the size check, before any read

    result = flywheel.solve(ctx, records, settings, tmp_path / "p.jsonl", progress=False)
    by = {(r.id, r.pass_): r for r in result.results}
    assert {r.batch_rows for r in result.results} == {rows}
    first = by[("ten-plus-three", 1)]
    assert first.quarantined and not first.hit and len(first.attempts) == SETTINGS.attempts
    assert by[("ten-plus-four", 1)].hit  # the run went on
    assert by[("ten-plus-three", 2)].route == "miss"  # never routed to it again
    assert result.passes[0]["quarantined"] == 1 and result.passes[1]["quarantined"] == 0
    assert set(ctx.library.catalog.quarantined()) == {damaged}

    skipped = ctx.library.reindex().skipped
    assert any(s.startswith(damaged) and "quarantined" in s for s in skipped)
    victim.write_bytes(original)  # repaired: it verifies again, and comes back
    assert ctx.library.reindex().skipped == []
    assert ctx.library.catalog.quarantined() == {}
    match = ctx.library.route("What is 10 + 3?", ctx.model.fingerprint, threshold=0.8)
    assert match is not None and match.item.root == damaged


class _RecordingTokenizer:
    """The tiny tokenizer, recording whether each encode asked for BOS (None: left to default)."""

    def __init__(self, tok):
        self._tok, self.calls = tok, []

    def encode(self, text, **kwargs):
        self.calls.append((text, kwargs.get("add_bos")))
        return self._tok.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_bos_starts_every_sequence_at_position_0_and_nothing_else(ctx, tmp_path):
    """Every path that starts a sequence (a library artifact, an attempt's prompt) adds BOS; a
    query that continues a grafted prefix does not; no path leaves it to a default."""
    tok = _RecordingTokenizer(ctx.tok)
    ctx = dataclasses.replace(ctx, tok=tok)
    seed = dataset.Record("seed", "What is 10 + 3?", "13", solution="10 + 3 = 13")
    flywheel.seed_library(ctx, [seed], SETTINGS, progress=False)
    records = [
        dataset.Record("seed", "What is 10 + 3?", "13"),
        dataset.Record("miss", "What is the secret code of the vault?", "zzqx-never"),
    ]
    flywheel.solve(ctx, records, dataclasses.replace(SETTINGS, passes=1), tmp_path / "p.jsonl")
    assert tok.calls and all(add_bos is not None for _, add_bos in tok.calls), tok.calls
    queries = {flywheel.hit_query(r.problem) for r in records}
    prompts = {flywheel.solve_prompt(r.problem) for r in records}
    kinds = {"query": 0, "prompt": 0, "artifact": 0}
    for text, add_bos in tok.calls:
        if text in queries:  # continues a grafted prefix
            kinds["query"] += 1
            assert not add_bos, text
        elif text in prompts or text.startswith("Problem:"):  # a sequence from position 0
            kinds["prompt" if text in prompts else "artifact"] += 1
            assert add_bos, text
    assert all(kinds.values()), kinds  # every path was seen
    (artifact_root,) = {i.root for i in ctx.library.catalog.items()}
    stored = manifest.read_manifest(ctx.library.artifact_path(artifact_root)).token_ids[0]
    assert stored[0] == ctx.tok.bos_id


def test_a_batched_solve_routes_and_judges_as_the_sequential_one(ctx, tmp_path):
    """Sample problems solved one at a time and four at a time, each into its own seeded
    library: the same routes, and every verdict the same wherever the grafted answer is (a batch
    reads float32 weights: other bits, so the tiny model's noise answers may change; on the 270M
    all 36 verdicts of the sample set's two passes matched, see issue #18's note)."""
    seed_set, problems = dataset.make_sample()
    # Six seeded problems (two reworded) and two the library lacks: two batches of four.
    seed_set, problems = seed_set[:6], problems[:6] + problems[-2:]
    settings = dataclasses.replace(SETTINGS, passes=1, attempts=1)
    batched_ctx = dataclasses.replace(
        ctx, library=library.Library(tmp_path / "lib4"), _engines={}, _batch_engines={}
    )
    results = {}
    for rows, run_ctx in ((1, ctx), (4, batched_ctx)):
        flywheel.seed_library(run_ctx, seed_set, settings, progress=False)
        solved = flywheel.solve(
            run_ctx,
            problems,
            dataclasses.replace(settings, batch_size=rows),
            tmp_path / f"p{rows}.jsonl",
            progress=False,
        )
        results[rows] = solved.results
    one, four = results[1], results[4]
    assert [r.id for r in one] == [r.id for r in four]
    assert sum(r.hit for r in four) == 6  # every seeded problem routed, rewordings included
    for a, b in zip(one, four, strict=True):
        assert (a.hit, a.route, a.matched_item, a.root if a.hit else None) == (
            b.hit,
            b.route,
            b.matched_item,
            b.root if b.hit else None,
        ), a.id
        assert (a.batch_rows, b.batch_rows) == (1, 4)
        if a.hit and a.answer == b.answer:
            assert (a.correct, a.wrong_route) == (b.correct, b.wrong_route), a.id
        if not a.hit:  # misses: attempted one at a time (1 row) or in batched rounds (4)
            for r in (a, b):
                assert [t.index for t in r.attempts][:1] == [0] and r.attempts[
                    0
                ].sampling == "greedy"
                assert r.deposited == r.correct == any(t.verified for t in r.attempts)
    for r in four:
        assert r.flops_estimate > 0  # its share of the batch programs it ran in
        if r.hit:
            assert r.restore_ms > 0 and r.prefill_tokens_avoided > 0 and r.wall_ms > 0
            assert r.prefill_flops_avoided_estimate > 0
    batched_ctx.library.close()
