"""Graft and prove it: grafted decode is bit-identical to the matched references (a) and (b),
prefix chains equal the whole text deposited at once, and relocation is refused or labelled."""

import itertools
import shutil

import numpy as np
import pytest
from conftest import compiles

from kvgraft_jax.core import attention, bits, engine, environment, kvstate, model, tokenizer
from kvgraft_jax.exact import deposit, graft
from kvgraft_jax.store import errors, layout, manifest, writer
from kvgraft_jax.store import restore as restore_lib

PREFIX, QUERY, NEW = 100, 12, 6
CHUNK = 32
CACHE = PREFIX + QUERY + NEW
MESHES = ("1", "8", "2x4", "4x2")


def _ids(length, seed):
    return np.random.default_rng(seed).integers(4, 1024, size=(1, length)).astype(np.int32)


@pytest.fixture(scope="module")
def engines(tiny_params_on):
    """Engines cached by (mesh, cache length, position offset): each compiles its programs once."""
    cache = {}

    def get(mesh_name, cache_length=CACHE, offset=0):
        key = (mesh_name, cache_length, offset)
        if key not in cache:
            mesh, params = tiny_params_on(mesh_name)
            cache[key] = engine.Engine(
                model.build_model("tiny"),
                params,
                mesh,
                batch_size=1,
                cache_length=cache_length,
                position_offset=offset,
            )
        return cache[key]

    return get


def _deposit(eng, ids, path, parent=None):
    module, params = eng.model, eng.params
    return deposit.deposit(
        eng,
        ids,
        chunk_size=CHUNK,
        path=path,
        model=model.describe_model("tiny", module, params),
        tokenizer=tokenizer.tiny_tokenizer().info(),
        versions=environment.versions(),
        parent=parent,
    )


@pytest.fixture(scope="module")
def artifacts(engines, tmp_path_factory):
    """The same prefix deposited on meshes (1), (8,), (2,4) and (4,2)."""
    base = tmp_path_factory.mktemp("graft")
    return {
        name: _deposit(engines(name, PREFIX), _ids(PREFIX, 0), base / f"on_{name}").path
        for name in MESHES
    }


@pytest.mark.parametrize("mesh_name", MESHES)
def test_graft_is_bit_identical_to_the_recompute_on_the_deposit_mesh(artifacts, engines, mesh_name):
    eng = engines(mesh_name)
    query = _ids(QUERY, 1)
    grafted = graft.graft(eng, artifacts[mesh_name], query, max_new_tokens=NEW)
    assert grafted.exact and grafted.prefix.relocated_by == 0
    reference = graft.recompute(eng, grafted.links, query, max_new_tokens=NEW)
    verdict = graft.compare(grafted.run, reference)
    assert verdict.bit_identical, verdict
    assert verdict.first_mismatch_step is None and verdict.argmax_agreement == 1.0
    assert verdict.max_kl_divergence == 0.0 and verdict.steps == NEW
    np.testing.assert_array_equal(grafted.run.token_ids, reference.token_ids)
    # Not vacuous: a different query changes the logits, and the comparison sees it.
    other = graft.recompute(eng, grafted.links, _ids(QUERY, 2), max_new_tokens=NEW)
    assert not graft.compare(grafted.run, other).bit_identical


@pytest.mark.parametrize(
    ("source", "target"), [p for p in itertools.permutations(MESHES, 2) if p[0] != p[1]]
)
def test_graft_on_another_mesh_equals_prefill_there_then_reshard(
    artifacts, engines, source, target
):
    """Reference (b): persistence plus re-sharding changed nothing, in every cell of the matrix."""
    src, dst = engines(source), engines(target)
    query = _ids(QUERY, 1)
    grafted = graft.graft(dst, artifacts[source], query, max_new_tokens=NEW)
    # The restore re-hashed every array on the target mesh: the roots are equal there.
    assert grafted.manifest.root == manifest.read_manifest(artifacts[source]).root
    reference = graft.prefill_elsewhere_then_continue(
        src, dst, grafted.links, query, max_new_tokens=NEW
    )
    verdict = graft.compare(grafted.run, reference)
    assert verdict.bit_identical, verdict
    assert verdict.state_root_after_query["grafted"] == verdict.state_root_after_query["reference"]


def test_insert_keeps_positions_and_zero_fill(artifacts, engines):
    eng = engines("2x4", PREFIX + 20)
    restored = restore_lib.restore(artifacts["2x4"], eng.mesh)
    placed = graft.insert([restored.state], eng)
    assert placed.length == PREFIX and placed.cache_length == attention.cache_slots(PREFIX + 20)
    k = np.asarray(placed.layers[0].k)
    assert bits.bits_equal(k[:, :PREFIX], restored.state.layers[0].k)
    assert not bits.as_bits(k[:, PREFIX:]).any()
    assert np.asarray(placed.layers[0].positions)[0, PREFIX - 1] == PREFIX - 1
    kvstate.assert_shardings(placed, eng.mesh)


def test_graft_refuses_too_small_a_cache_and_other_weights(artifacts, engines, tiny_params_on):
    eng = engines("1", PREFIX + 4)
    too_many = eng.kv_shape.cache_length - PREFIX  # the query's tokens come on top
    with pytest.raises(engine.EngineError, match="exceeds the cache length"):
        graft.graft(eng, artifacts["1"], _ids(QUERY, 1), max_new_tokens=too_many)
    _, other = tiny_params_on("1", seed=1)
    fingerprint = model.weights_fingerprint(model.TINY_CONFIGS["tiny"], other)
    with pytest.raises(errors.IncompatibleArtifactError, match="weights"):
        graft.graft(
            eng,
            artifacts["1"],
            _ids(2, 1),
            max_new_tokens=1,
            expected=manifest.Expected(model_fingerprint=fingerprint),
        )


# -- prefix chains ----------------------------------------------------------------------------

PARENT = 64  # a multiple of CHUNK: the chain's schedule is then the whole text's schedule


@pytest.fixture(scope="module")
def chain(engines, tmp_path_factory):
    base = tmp_path_factory.mktemp("chain")
    ids = _ids(PREFIX, 3)
    whole = _deposit(engines("2x4", PREFIX), ids, base / "whole")
    parent = _deposit(engines("2x4", PARENT), ids[:, :PARENT], base / "parent")
    child = _deposit(engines("2x4", PREFIX), ids[:, PARENT:], base / "child", parent=parent.path)
    return whole, parent, child


def test_a_child_stores_only_its_positions_and_names_its_parent(chain):
    whole, parent, child = chain
    m = child.manifest
    assert m.parent == parent.root and m.parent_path == "../parent"
    assert (m.first_position, m.last_position, m.length) == (PARENT, PREFIX - 1, PREFIX - PARENT)
    assert all(a.shape[1] == PREFIX - PARENT for a in m.arrays if "end_index" not in a.name)
    assert m.protocol.schedule == [[64, 32], [96, 4]]
    assert (
        whole.manifest.protocol.schedule == parent.manifest.protocol.schedule + m.protocol.schedule
    )
    # The child's bytes are the whole deposit's slots PARENT.. exactly.
    tail = writer.used_slice(
        kvstate.KVState(whole.state.layers, PREFIX), _mesh_of(whole.state), start=PARENT
    )
    for got, want in zip(child.state.layers, tail.layers, strict=True):
        assert bits.bits_equal(got.k, want.k) and bits.bits_equal(got.v, want.v)


def _mesh_of(state):
    return state.layers[0].k.sharding.mesh


@pytest.mark.parametrize("mesh_name", ["2x4", "1"])
def test_grafting_parent_then_child_equals_the_whole_text(chain, engines, mesh_name):
    whole, _, child = chain
    eng = engines(mesh_name)
    prefix = graft.load_prefix(eng, child.path)
    assert [link.manifest.root for link in prefix.links] == [chain[1].root, child.root]
    # The grafted chain is, bit for bit, the state of the whole text deposited at once.
    assert layout.digest_state(writer.used_slice(prefix.state, eng.mesh))[1] == whole.root
    query = _ids(QUERY, 1)
    from_chain = graft.graft(eng, child.path, query, max_new_tokens=NEW)
    from_whole = graft.graft(eng, whole.path, query, max_new_tokens=NEW)
    assert graft.compare(from_chain.run, from_whole.run).bit_identical
    if mesh_name == "2x4":  # (a): the chain replayed link by link on the deposit mesh
        reference = graft.recompute(eng, from_chain.links, query, max_new_tokens=NEW)
    else:  # (b): prefilled on the deposit mesh, moved here
        reference = graft.prefill_elsewhere_then_continue(
            engines("2x4"), eng, from_chain.links, query, max_new_tokens=NEW
        )
    assert graft.compare(from_chain.run, reference).bit_identical


def test_a_chain_with_a_missing_or_replaced_parent_is_refused(chain, engines, tmp_path):
    _, parent, child = chain
    moved_child = tmp_path / "child"
    shutil.copytree(child.path, moved_child)
    eng = engines("2x4")
    with pytest.raises(errors.ArtifactNotFoundError, match="extends parent root"):
        graft.load_prefix(eng, moved_child)
    # A different artifact where the parent should be: refused by its root, not trusted by path.
    shutil.copytree(parent.path, tmp_path / "parent")
    impostor = _deposit(engines("2x4", PARENT), _ids(PARENT, 9), tmp_path / "other")
    shutil.rmtree(tmp_path / "parent")
    shutil.copytree(impostor.path, tmp_path / "parent")
    with pytest.raises(errors.IncompatibleArtifactError, match="parent was replaced"):
        graft.load_prefix(eng, moved_child)


# -- own position only ------------------------------------------------------------------------

OFFSET = 10


def test_grafting_at_another_position_is_refused_without_allow_relocation(artifacts, engines):
    eng = engines("2x4", CACHE, OFFSET)
    with pytest.raises(graft.GraftError, match="allow_relocation"):
        graft.graft(eng, artifacts["2x4"], _ids(QUERY, 1), max_new_tokens=NEW)


def test_relocation_is_labelled_approximate_and_measured(artifacts, engines):
    eng = engines("2x4", CACHE, OFFSET)
    query = _ids(QUERY, 1)
    moved = graft.graft(eng, artifacts["2x4"], query, max_new_tokens=NEW, allow_relocation=True)
    assert not moved.exact and moved.prefix.relocated_by == OFFSET and moved.prefix.state is None
    kept = graft.load_prefix(eng, artifacts["2x4"], allow_relocation=True)
    positions = np.asarray(kept.state.layers[0].positions)[0]
    np.testing.assert_array_equal(positions[:PREFIX], np.arange(PREFIX) + OFFSET)
    assert not positions[PREFIX:].any()
    at_offset = graft.recompute(eng, moved.links, query, max_new_tokens=NEW)
    # The recompute at the new offset holds the same positions; its keys are computed there.
    verdict = graft.compare(moved.run, at_offset)
    # Re-rotating keys is close to computing them there (RoPE is relative), but not exact.
    assert verdict.max_kl_divergence < 1e-3
    assert 0 < verdict.max_abs_logit_diff < 0.1
    # The unrotated prefix at the wrong offset is far worse: relocation does real work.
    unrotated = graft.insert([restore_lib.restore(artifacts["2x4"], eng.mesh).state], eng)
    wrong = graft.continue_from(eng, unrotated, query, chunk_size=CHUNK, max_new_tokens=NEW)
    assert graft.compare(wrong, at_offset).max_abs_logit_diff > 10 * verdict.max_abs_logit_diff


def test_relocating_back_by_zero_changes_nothing(artifacts, engines):
    eng = engines("2x4")
    restored = restore_lib.restore(artifacts["2x4"], eng.mesh)
    placed = graft.insert([restored.state], eng)
    same = graft.relocate(placed, eng, by=0)
    for a, b in zip(placed.layers, same.layers, strict=True):
        assert bits.bits_equal(a.k, b.k) and bits.bits_equal(a.positions, b.positions)


def test_a_graft_reads_each_manifest_of_its_chain_once(chain, engines, monkeypatch):
    """Resolving the chain reads and checks every link's manifest; restore and graft reuse them."""
    from kvgraft_jax.store import chain as chain_lib

    _whole, _parent, child = chain
    reads = []
    real = manifest.read_manifest

    def counted(path):
        reads.append(str(path))
        return real(path)

    for module in (manifest, chain_lib, restore_lib, writer):
        if hasattr(module, "read_manifest"):
            monkeypatch.setattr(module, "read_manifest", counted)
    eng = engines("2x4", CACHE)
    grafted = graft.graft(eng, child.path, _ids(QUERY, 1), max_new_tokens=NEW)
    assert len(grafted.links) == 2
    assert sorted(reads) == sorted(str(link.path) for link in grafted.links), reads
    # The call's wall time to the first token holds every part a benchmark reports, and more.
    p, run = grafted.prefix, grafted.run
    assert grafted.ttft_s >= p.restore_s + p.verify_s + p.insert_s + run.first_token_s > 0
    restored = restore_lib.restore(child.path, eng.mesh)
    assert restored.total_s >= restored.restore_s + restored.verify_s > 0


def test_a_second_graft_compiles_nothing(artifacts, engines):
    """Every program a graft runs (query, decode, insert, the cut to the used slots, the zeroing
    of dropped slots) is compiled once per layout: the same graft again compiles nothing. The
    cut and the zeroing were fresh closures once, compiled again on every call (about 85 ms of
    each 270M graft; this test fails with the cut's cache cleared)."""
    eng = engines("2x4")
    query = _ids(QUERY, 1)
    graft.graft(eng, artifacts["2x4"], query, max_new_tokens=NEW)  # warm
    with compiles() as compiled:
        graft.graft(eng, artifacts["2x4"], query, max_new_tokens=NEW)
    assert compiled == [], f"{len(compiled)} programs compiled by a repeated graft"
