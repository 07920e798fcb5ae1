"""Ragged batches: rows graft their own artifacts at their own positions, exact against the batch
replayed as its reference, on meshes (1), (8,) and (2,4)."""

import dataclasses
import json
import shutil

import numpy as np
import pytest

from kvgraft_jax.core import (
    attention,
    bits,
    engine,
    environment,
    model,
    tokenizer,
    weight_layout,
)
from kvgraft_jax.exact import batch, deposit, graft
from kvgraft_jax.library import accounting
from kvgraft_jax.store import errors

CHUNK, ROWS = 8, 4


def _ids(length, seed):
    return np.random.default_rng(seed).integers(4, 1024, size=length).astype(np.int32)


def _deposit(eng, ids, path, **options):
    return deposit.deposit(
        eng,
        ids[None, :],
        chunk_size=CHUNK,
        path=path,
        model=model.describe_model("tiny", eng.model, eng.params),
        tokenizer=tokenizer.tiny_tokenizer().info(),
        versions=environment.versions(),
        **options,
    ).path


@pytest.fixture(scope="module")
def library(tiny_params_on, tmp_path_factory):
    """Per mesh, artifacts deposited there: prefixes of 40 and 300 positions, a child of the
    first (a chain), and a compacted one (its local layers store only the window)."""
    made = {}

    def get(mesh_name):
        if mesh_name not in made:
            mesh, params = tiny_params_on(mesh_name)
            eng = engine.Engine(
                model.build_model("tiny"), params, mesh, batch_size=1, cache_length=400
            )
            root = tmp_path_factory.mktemp(f"batch_{mesh_name}")
            short = _deposit(eng, _ids(40, 1), root / "short")
            made[mesh_name] = {
                "short": short,
                "long": _deposit(eng, _ids(300, 2), root / "long"),
                "child": _deposit(eng, _ids(20, 3), root / "child", parent=short),
                "compact": _deposit(eng, _ids(100, 4), root / "compact", compact=True),
            }
        return made[mesh_name]

    return get


def _items(art):
    """Six items for four rows (the last two wait for free rows); queries of 3 to 20 tokens, two
    longer than a chunk; one item grafts nothing."""
    return [
        batch.BatchItem(art["short"], _ids(5, 10), 6),
        batch.BatchItem(art["long"], _ids(12, 11), 4),
        batch.BatchItem(art["child"], _ids(3, 12), 7),
        batch.BatchItem(art["compact"], _ids(9, 13), 5),
        batch.BatchItem(art["long"], _ids(7, 14), 3),
        batch.BatchItem(None, _ids(20, 15), 4),  # no prefix: a fresh attempt
    ]


def _engines(tiny_params_on, mesh_name, items, rows=ROWS):
    mesh, params = tiny_params_on(mesh_name)
    slots = batch.cache_length(items, CHUNK)
    module = model.build_model("tiny")
    batched = batch.batch_engine(module, params, mesh, batch_size=rows, cache_length=slots)
    single = engine.Engine(module, params, mesh, batch_size=1, cache_length=slots)
    return batched, single


@pytest.mark.parametrize("mesh_name", ["1", "8", "2x4"])
def test_a_ragged_batch_is_bit_identical_to_its_batch_reference(library, tiny_params_on, mesh_name):
    items = _items(library(mesh_name))
    eng, single = _engines(tiny_params_on, mesh_name, items)
    assert eng.weight_layout == weight_layout.batch_program(eng.mesh, ROWS)
    grafted = batch.run(eng, items, batch.grafted(eng), chunk_size=CHUNK)
    s = grafted.schedule
    assert [len(r.token_ids) for r in grafted.items] == [i.max_new_tokens for i in items]
    assert s.new_tokens == (6, 4, 7, 5, 3, 4)
    # Continuous batching: items 4 and 5 took rows as they were freed, after the start; item 1
    # (the smallest budget) freed its row first.
    placed = {p.item: p for p in s.placements}
    assert all(placed[n].step == 0 for n in range(4)) and placed[4].row == 1
    assert 0 < placed[4].step <= placed[5].step
    # The rows read their queries together (a 12-token query in two steps), then decode.
    assert [st.length for st in s.steps[:2]] == [CHUNK, 4]
    assert s.steps[0].starts == (40, 300, 60, 100) and s.steps[0].valid == (5, 8, 3, 8)
    # Decode throughput counts the steps where every row decodes (no query chunk: length 1).
    assert grafted.decode_tokens == sum(sum(st.valid) for st in s.steps if st.length == 1)
    assert 0 < grafted.decode_tokens < sum(i.max_new_tokens - 1 for i in items)

    # The reference: exactly this batch, from its recorded schedule, every prefix recomputed.
    plan = batch.BatchSchedule.from_json(s.to_json())
    reference = batch.run(eng, items, batch.recomputed(single), chunk_size=CHUNK, plan=plan)
    verdict = batch.compare(grafted, reference)
    assert verdict.bit_identical and verdict.identical_items == len(items), verdict
    assert reference.schedule == s


def _program(monkeypatch, program):
    """Makes `weight_layout.batch_program` choose `program` (as on a CPU with or without bf16
    dot instructions), so both batch programs are tested on every host."""
    bf16 = program == weight_layout.GEMM_BF16
    monkeypatch.setattr(weight_layout, "cpu_has_bf16_dot", lambda: bf16)


@pytest.mark.parametrize("program", weight_layout.BATCH_PROGRAMS)
def test_each_batch_program_replays_exactly_and_refuses_the_other(
    library, tiny_params_on, monkeypatch, program
):
    """Both batch programs (the one a CPU without bf16 dot instructions runs, and the one with)
    are bit-identical to their batch reference on every host; a schedule answered by one is
    refused by the other (`OtherProgramError`), not replayed into other bits. Rows split over
    `data` (2 per device here) still take the bf16 program; one row per device does not."""
    items = _items(library("2x4"))
    _program(monkeypatch, program)
    eng, single = _engines(tiny_params_on, "2x4", items)
    assert eng.weight_layout == program and eng.batch_program
    grafted = batch.run(eng, items, batch.grafted(eng), chunk_size=CHUNK)
    assert grafted.schedule.weight_layout == program
    plan = batch.BatchSchedule.from_json(grafted.schedule.to_json())
    reference = batch.run(eng, items, batch.recomputed(single), chunk_size=CHUNK, plan=plan)
    verdict = batch.compare(grafted, reference)
    assert verdict.bit_identical and verdict.identical_items == len(items), verdict

    other = next(p for p in weight_layout.BATCH_PROGRAMS if p != program)
    foreign = dataclasses.replace(plan, weight_layout=other)
    with pytest.raises(batch.OtherProgramError, match=f"answered by the batch program '{other}'"):
        batch.run(eng, items, batch.recomputed(single), chunk_size=CHUNK, plan=foreign)
    mesh = eng.mesh  # data: 2
    assert weight_layout.batch_program(mesh, 2) == weight_layout.GEMM_F32  # one row per device
    assert weight_layout.batch_program(mesh, 3) == program  # not split: 3 rows on each device

    # A verify replays the recorded program where this CPU can: the float32 one anywhere, the
    # bf16 one only with bf16 dot instructions (elsewhere XLA converts its operands: other
    # bits), where the host's own program is built and refused by name, before any step.
    def replay(recorded, bf16_here):
        monkeypatch.setattr(weight_layout, "cpu_has_bf16_dot", lambda: bf16_here)
        module = model.build_model("tiny")
        return batch.batch_engine(
            module, single.params, mesh, batch_size=ROWS, cache_length=64, program=recorded
        )

    assert replay(weight_layout.GEMM_F32, True).weight_layout == weight_layout.GEMM_F32
    assert replay(weight_layout.GEMM_BF16, True).weight_layout == weight_layout.GEMM_BF16
    stranded = replay(weight_layout.GEMM_BF16, False)
    assert stranded.weight_layout == weight_layout.GEMM_F32
    with pytest.raises(batch.OtherProgramError, match="answered by the batch program 'gemm-bf16"):
        batch.check_program(
            dataclasses.replace(plan, weight_layout=weight_layout.GEMM_BF16), stranded
        )
    assert replay("gemm-f64-v9", True).weight_layout == weight_layout.GEMM_BF16  # unknown: host's


def test_the_host_decides_the_batch_program(monkeypatch):
    """`cpu_has_bf16_dot` reads /proc/cpuinfo's flags; KVGRAFT_BF16_DOT overrides it."""
    for forced, expected in (("1", True), ("0", False)):
        monkeypatch.setenv("KVGRAFT_BF16_DOT", forced)
        weight_layout.cpu_has_bf16_dot.cache_clear()
        assert weight_layout.cpu_has_bf16_dot() is expected
    monkeypatch.delenv("KVGRAFT_BF16_DOT")
    weight_layout.cpu_has_bf16_dot.cache_clear()
    try:
        with open("/proc/cpuinfo") as f:
            flags = " ".join(line for line in f if line.startswith("flags")).split()
    except OSError:
        flags = []
    assert weight_layout.cpu_has_bf16_dot() == bool({"avx512_bf16", "amx_bf16"} & set(flags))
    weight_layout.cpu_has_bf16_dot.cache_clear()


@pytest.mark.parametrize(
    ("name", "program"),
    [("tiny", p) for p in weight_layout.BATCH_PROGRAMS] + [("tiny_mqa", weight_layout.GEMM_F32)],
)
def test_no_batch_step_copies_a_weight(tiny_params_on, monkeypatch, name, program):
    """Each GEMM weight is held in the shape its GEMM reads (`weight_layout.gemm_operand`):
    held any other way, XLA:CPU copies it into that shape on every step (the 270M's 8-row step
    spent 49 of 217 ms copying `kv_einsum` and `attn_vec_einsum`), and the head widens its bf16
    table a tile at a time (`weight_layout.tiled_head`), never whole. Checked on the compiled
    decode and chunk steps: no instruction outside the parameters, other than a product, makes
    an f32 or bf16 array of a weight's size from a weight (the tiny table is 8 tiles of 128
    rows). The bf16 program only where the CPU runs bf16 products (elsewhere XLA converts its
    operands, which is why such a CPU runs the float32 program)."""
    import re

    import jax

    if program == weight_layout.GEMM_BF16 and not weight_layout.cpu_has_bf16_dot():
        pytest.skip("this CPU has no bf16 dot instructions: its batch program is float32")
    _program(monkeypatch, program)
    monkeypatch.setattr(weight_layout, "HEAD_TILE_ROWS", 128)
    mesh, params = tiny_params_on("1", name)
    eng = batch.batch_engine(model.build_model(name), params, mesh, batch_size=8, cache_length=768)
    assert eng.weight_layout == program
    weights = {x.size for x in jax.tree.leaves(eng._program_weights) if x.size > 1024}
    kinds = "f32" if program == weight_layout.GEMM_F32 else "(?:bf16|f32)"
    instruction = re.compile(rf"%[\w.\-]+ = {kinds}\[([\d,]*)\]\S* ([\w\-]+)\((.*?)\)")
    for length in (1, CHUNK):
        hlo = eng.ragged_program(length).as_text()
        entry = hlo[hlo.index("\nENTRY") :]
        copies = [
            line.strip()[:160]
            for line in entry.splitlines()
            if (m := instruction.search(line))
            and m.group(2) not in ("parameter", "dot", "get-tuple-element", "bitcast")
            and int(np.prod([int(d) for d in m.group(1).split(",") if d])) in weights
            and "%params" in m.group(3)
            and "%tokens" not in m.group(3)  # the embedding lookup: tokens x width
        ]
        assert copies == [], copies[:3]


def test_a_row_depends_on_its_own_values_only(library, tiny_params_on):
    """One item's query changed in one token: that item's logits change, and no other row's bit
    (the rows' lengths, and so every step's program, are the same)."""
    items = _items(library("1"))
    eng, _ = _engines(tiny_params_on, "1", items)
    before = batch.run(eng, items, batch.grafted(eng), chunk_size=CHUNK)
    query = items[2].query_ids.copy()
    query[0] += 1
    changed = list(items)
    changed[2] = batch.BatchItem(items[2].source, query, items[2].max_new_tokens)
    after = batch.run(eng, changed, batch.grafted(eng), chunk_size=CHUNK)
    assert after.schedule == before.schedule
    same = [
        a.logits_sha256 == b.logits_sha256 for a, b in zip(after.items, before.items, strict=True)
    ]
    assert same == [True, True, False, True, True, True]
    verdict = batch.compare(after, before)
    assert not verdict.bit_identical and verdict.first_mismatch == (2, 0)


def test_a_batch_of_one_is_bit_identical_to_the_single_graft(library, tiny_params_on):
    """One row reads the single graft's weights and takes the same query chunks: the ragged step
    (per-row slots, pad masks) then gives `graft.graft`'s bits, chain and compacted included."""
    items = _items(library("1"))
    eng, single = _engines(tiny_params_on, "1", items, rows=1)
    assert eng.weight_layout == single.weight_layout == weight_layout.CONTRACT_LAST
    run = batch.run(eng, items, batch.grafted(eng), chunk_size=CHUNK)
    assert [p.row for p in run.schedule.placements] == [0] * len(items)
    attempt = single.generate(
        items[5].query_ids[None, :], max_new_tokens=items[5].max_new_tokens, chunk_size=CHUNK
    )
    assert run.items[5].logits_sha256 == tuple(bits.sha256(x) for x in attempt.step_logits)
    for item, result in zip(items[:5], run.items, strict=False):
        g = graft.graft(
            single, item.source, item.query_ids[None, :], max_new_tokens=len(result.token_ids)
        )
        assert result.logits_sha256 == tuple(bits.sha256(x) for x in g.run.step_logits)
        assert (result.token_ids == g.run.token_ids[0]).all()


def test_a_stop_token_frees_the_row_and_the_reference_follows_the_plan(library, tiny_params_on):
    items = _items(library("1"))
    eng, single = _engines(tiny_params_on, "1", items)
    probe = batch.run(eng, items, batch.grafted(eng), chunk_size=CHUNK)
    # The first item with a token, after its first and before its last, not seen before it.
    n, end = next(
        (n, k)
        for n, r in enumerate(probe.items)
        for k in range(1, len(r.token_ids) - 1)
        if r.token_ids[k] not in r.token_ids[:k]
    )
    stop = int(probe.items[n].token_ids[end])
    stopped = batch.run(eng, items, batch.grafted(eng), chunk_size=CHUNK, stop_token=stop)
    assert list(stopped.items[n].token_ids) == list(probe.items[n].token_ids[: end + 1])
    assert stopped.schedule.new_tokens != probe.schedule.new_tokens
    for r, item in zip(stopped.items, items, strict=True):  # every item ends at a stop or budget
        assert r.token_ids[-1] == stop or len(r.token_ids) == item.max_new_tokens
        assert stop not in r.token_ids[:-1]
    reference = batch.run(
        eng, items, batch.recomputed(single), chunk_size=CHUNK, plan=stopped.schedule
    )
    assert batch.compare(stopped, reference).bit_identical


def test_sampled_rows_draw_from_their_own_logits_and_replay_exactly(library, tiny_params_on):
    """Rows with a seeded sampler draw each token on the host from their own logits row (other
    tokens than the argmax's); the reference, with fresh samplers of the same seeds, draws the
    same tokens from the same bits."""

    def sampled(seeds):
        return [
            dataclasses.replace(
                item,
                sampler=None if seed is None else engine.temperature_sampler(0.8, seed),
            )
            for item, seed in zip(_items(library("1")), seeds, strict=True)
        ]

    seeds = [None, 3, 4, None, 5, 6]
    items = sampled(seeds)
    eng, single = _engines(tiny_params_on, "1", items)
    greedy = batch.run(eng, _items(library("1")), batch.grafted(eng), chunk_size=CHUNK)
    drawn = batch.run(eng, items, batch.grafted(eng), chunk_size=CHUNK)
    assert any(
        list(g.token_ids) != list(d.token_ids)
        for seed, g, d in zip(seeds, greedy.items, drawn.items, strict=True)
        if seed is not None
    )
    # Cost accounting: each step's program FLOPs shared among the rows that worked in it.
    counter = accounting.FlopCounter()
    shares = counter.batch_items(eng, drawn)
    total = sum(counter.of(eng.ragged_program(s.length)) for s in drawn.schedule.steps)
    assert min(shares) > 0 and sum(shares) == pytest.approx(total, rel=1e-9)
    assert all(len(r.steps) >= len(r.token_ids) for r in drawn.items)
    reference = batch.run(
        eng, sampled(seeds), batch.recomputed(single), chunk_size=CHUNK, plan=drawn.schedule
    )
    assert batch.compare(drawn, reference).bit_identical
    assert [list(r.token_ids) for r in reference.items] == [list(r.token_ids) for r in drawn.items]


def test_a_batch_refuses_what_it_cannot_run_before_any_step(library, tiny_params_on, tmp_path):
    art = library("1")
    items = _items(art)
    eng, single = _engines(tiny_params_on, "1", items)
    steps = []
    real_step = eng.ragged_step
    eng.ragged_step = lambda *a: steps.append(1) or real_step(*a)
    too_long = [*items, batch.BatchItem(art["long"], _ids(5, 20), 300)]
    with pytest.raises(
        batch.BatchError, match=r"needs \d+ cache slots.*batch.cache_length\(items, chunk_size\)"
    ):
        batch.run(eng, too_long, batch.grafted(eng), chunk_size=CHUNK)
    bad_id = [batch.BatchItem(art["short"], np.array([5, 0, 7], np.int32), 2)]
    with pytest.raises(engine.EngineError, match="token id 0 is outside"):
        batch.run(eng, bad_id, batch.grafted(eng), chunk_size=CHUNK)
    with pytest.raises(batch.BatchError, match="non-empty row"):
        batch.run(
            eng,
            [batch.BatchItem(art["short"], np.zeros(0, np.int32), 2)],
            batch.grafted(eng),
            chunk_size=CHUNK,
        )
    with pytest.raises(batch.BatchError, match="at least one item"):
        batch.run(eng, [], batch.grafted(eng), chunk_size=CHUNK)
    with pytest.raises(errors.ArtifactNotFoundError):
        batch.run(
            eng,
            [batch.BatchItem(tmp_path / "none", _ids(3, 1), 2)],
            batch.grafted(eng),
            chunk_size=CHUNK,
        )
    assert steps == []

    # A plan for another batch, or one that places an item in a busy row, is refused.
    run = batch.run(eng, items, batch.grafted(eng), chunk_size=CHUNK)
    other_rows = batch.BatchSchedule.from_json(
        run.schedule.to_json().replace('"batch_size":4', '"batch_size":2')
    )
    with pytest.raises(batch.BatchError, match="the plan is for 2 rows"):
        batch.run(eng, items, batch.recomputed(single), chunk_size=CHUNK, plan=other_rows)
    # A plan answered by another attention program is not replayed: its bits are not this build's.
    other_attention = dataclasses.replace(run.schedule, attention="kvgraft-blockwise/v1/block=256")
    with pytest.raises(batch.OtherProgramError, match="answered by the attention 'kvgraft-blo"):
        batch.run(eng, items, batch.recomputed(single), chunk_size=CHUNK, plan=other_attention)
    # A schedule recorded before it named its attention: the float32 batch program's products
    # were v2's already, every other program's v1's.
    unnamed = json.loads(run.schedule.to_json())
    del unnamed["attention"]
    for layout, named in (
        (weight_layout.GEMM_F32, attention.ATTENTION),
        (weight_layout.CONTRACT_LAST, "kvgraft-blockwise/v1/block=256"),
    ):
        text = json.dumps(unnamed | {"weight_layout": layout})
        assert batch.BatchSchedule.from_json(text).attention == named
    busy = list(run.schedule.placements)
    busy[-1] = batch.Placement(1, busy[-1].row, busy[-1].item)
    forged = batch.BatchSchedule(**{**run.schedule.__dict__, "placements": tuple(busy)})
    with pytest.raises(batch.BatchError, match="still holds item"):
        batch.run(eng, items, batch.recomputed(single), chunk_size=CHUNK, plan=forged)
    for text in ("[]", '{"batch_size": 4}', "not json", '{"placements": 3}'):
        with pytest.raises(batch.BatchError, match="not a batch schedule"):
            batch.BatchSchedule.from_json(text)
    outside = list(run.schedule.placements)
    outside[0] = batch.Placement(0, 7, outside[0].item)
    forged = batch.BatchSchedule(**{**run.schedule.__dict__, "placements": tuple(outside)})
    with pytest.raises(batch.BatchError, match="outside its rows"):
        batch.run(eng, items, batch.recomputed(single), chunk_size=CHUNK, plan=forged)

    # A damaged artifact in one row is refused: its restore re-verifies every digest.
    damaged = tmp_path / "damaged"
    shutil.copytree(art["long"], damaged)
    biggest = max(
        (p for p in damaged.rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0x10
    biggest.write_bytes(bytes(data))
    with pytest.raises(errors.CorruptArtifactError):
        batch.run(
            eng,
            [*items[:4], batch.BatchItem(damaged, _ids(7, 14), 3)],
            batch.grafted(eng),
            chunk_size=CHUNK,
        )
