"""Graft and prove it: grafted decode is bit-identical to the matched references (a) and (b)."""

import numpy as np
import pytest

from kvgraft_jax import artifact, bits, deposit, engine, graft, kvstate, model, runtime, tokenizer

PREFIX, QUERY, NEW = 100, 12, 6
CHUNK = 32


def _ids(length, seed):
    return np.random.default_rng(seed).integers(4, 1024, size=(1, length)).astype(np.int32)


def _engine(tiny_params_on, mesh_name, cache_length):
    mesh, params = tiny_params_on(mesh_name)
    return engine.Engine(
        model.build_model("tiny"), params, mesh, batch_size=1, cache_length=cache_length
    )


@pytest.fixture(scope="module")
def artifacts(tiny_params_on, tmp_path_factory):
    """The same prefix deposited on meshes (1), (8,) and (2,4)."""
    base = tmp_path_factory.mktemp("graft")
    out = {}
    for name in ("1", "8", "2x4"):
        mesh, params = tiny_params_on(name)
        module = model.build_model("tiny")
        eng = engine.Engine(module, params, mesh, batch_size=1, cache_length=PREFIX)
        out[name] = deposit.deposit(
            eng,
            _ids(PREFIX, 0),
            chunk_size=CHUNK,
            path=base / f"on_{name}",
            model=deposit.describe_model("tiny", module, params),
            tokenizer=deposit.describe_tokenizer(tokenizer.tiny_tokenizer()),
            versions=runtime.versions(),
        ).path
    return out


@pytest.mark.parametrize("mesh_name", ["1", "8", "2x4"])
def test_graft_is_bit_identical_to_the_recompute_on_the_deposit_mesh(
    artifacts, tiny_params_on, mesh_name
):
    eng = _engine(tiny_params_on, mesh_name, PREFIX + QUERY + NEW)
    query = _ids(QUERY, 1)
    grafted = graft.graft(eng, artifacts[mesh_name], query, max_new_tokens=NEW)
    reference = graft.recompute(eng, grafted.manifest, query, max_new_tokens=NEW)
    verdict = graft.compare(grafted.run, reference)
    assert verdict.bit_identical, verdict
    assert verdict.first_mismatch_step is None and verdict.argmax_agreement == 1.0
    assert verdict.steps == NEW
    np.testing.assert_array_equal(grafted.run.token_ids, reference.token_ids)
    # Not vacuous: a different query changes the logits, and the comparison sees it.
    other = graft.recompute(eng, grafted.manifest, _ids(QUERY, 2), max_new_tokens=NEW)
    assert not graft.compare(grafted.run, other).bit_identical


@pytest.mark.parametrize(
    ("source", "target"), [("1", "2x4"), ("2x4", "1"), ("8", "2x4"), ("2x4", "8")]
)
def test_graft_on_another_mesh_equals_prefill_there_then_reshard(
    artifacts, tiny_params_on, source, target
):
    """Reference (b): persistence plus re-sharding changed nothing."""
    cache = PREFIX + QUERY + NEW
    src, dst = _engine(tiny_params_on, source, cache), _engine(tiny_params_on, target, cache)
    query = _ids(QUERY, 1)
    grafted = graft.graft(dst, artifacts[source], query, max_new_tokens=NEW)
    reference = graft.prefill_elsewhere_then_continue(
        src, dst, grafted.manifest, query, max_new_tokens=NEW
    )
    verdict = graft.compare(grafted.run, reference)
    assert verdict.bit_identical, verdict
    # Reference (c), recorded: the recompute on the target mesh is a different computation.
    recomputed = graft.compare(
        grafted.run, graft.recompute(dst, grafted.manifest, query, max_new_tokens=NEW)
    )
    print(
        f"(c) deposit {source} -> graft {target}: bit_identical={recomputed.bit_identical} "
        f"argmax={recomputed.argmax_agreement:.3f} max|dlogit|={recomputed.max_abs_logit_diff:.4f}"
    )


def test_insert_keeps_positions_and_zero_fill(artifacts, tiny_params_on):
    eng = _engine(tiny_params_on, "2x4", PREFIX + 20)
    restored = artifact.restore(artifacts["2x4"], eng.mesh)
    placed = graft.insert(restored.state, eng)
    assert placed.length == PREFIX and placed.cache_length == PREFIX + 20
    k = np.asarray(placed.layers[0].k)
    assert bits.bits_equal(k[:, :PREFIX], restored.state.layers[0].k)
    assert not bits.as_bits(k[:, PREFIX:]).any()
    assert np.asarray(placed.layers[0].positions)[0, PREFIX - 1] == PREFIX - 1
    kvstate.assert_shardings(placed, eng.mesh)


def test_graft_refuses_too_small_a_cache_and_other_weights(artifacts, tiny_params_on):
    eng = _engine(tiny_params_on, "1", PREFIX + 4)
    with pytest.raises(engine.EngineError, match="exceeds the cache length"):
        graft.graft(eng, artifacts["1"], _ids(QUERY, 1), max_new_tokens=NEW)
    _, other = tiny_params_on("1", seed=1)
    fingerprint = model.weights_fingerprint(model.TINY_CONFIGS["tiny"], other)
    with pytest.raises(artifact.IncompatibleArtifactError, match="weights"):
        graft.graft(
            eng,
            artifacts["1"],
            _ids(2, 1),
            max_new_tokens=1,
            expected=artifact.Expected(model_fingerprint=fingerprint),
        )
