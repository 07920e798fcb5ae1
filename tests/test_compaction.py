"""Sliding-window compaction is exact: a compacted artifact grafts bit-identically to the full one."""

import numpy as np
import pytest
from conftest import compiles

from kvgraft_jax.core import engine, environment, model, tokenizer
from kvgraft_jax.exact import deposit, graft
from kvgraft_jax.store import restore

WINDOW = model.TINY_CONFIGS["tiny"].sliding_window_size  # 16
QUERY, NEW, CHUNK = 12, 6, 8


def _ids(length, seed):
    return np.random.default_rng(seed).integers(4, 1024, size=(1, length)).astype(np.int32)


def _engine(tiny_params_on, mesh_name, cache_length):
    mesh, params = tiny_params_on(mesh_name)
    return engine.Engine(
        model.build_model("tiny"), params, mesh, batch_size=1, cache_length=cache_length
    )


def _deposit(eng, ids, path, *, compact, parent=None):
    return deposit.deposit(
        eng,
        ids,
        chunk_size=CHUNK,
        path=path,
        model=model.describe_model("tiny", eng.model, eng.params),
        tokenizer=tokenizer.tiny_tokenizer().info(),
        versions=environment.versions(),
        parent=parent,
        compact=compact,
    )


def _stored_bytes(manifest):
    return sum(
        int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
        for a in manifest.arrays
        if a.name.endswith(("/k", "/v"))
    )


@pytest.mark.parametrize("length", [WINDOW - 6, WINDOW, 100])
@pytest.mark.parametrize("mesh_name", ["1", "2x4"])
def test_compacted_graft_is_bit_identical_to_the_full_one(
    tiny_params_on, tmp_path, length, mesh_name
):
    ids, query = _ids(length, 0), _ids(QUERY, 1)
    eng = _engine(tiny_params_on, mesh_name, length + QUERY + NEW)
    full = _deposit(eng, ids, tmp_path / "full", compact=False)
    small = _deposit(eng, ids, tmp_path / "small", compact=True)
    c = small.manifest.compaction
    assert c is not None and c.window == WINDOW and c.kept_from == max(0, length - WINDOW)
    assert c.local_layers == [0, 1, 2, 3, 4]  # tiny: 5 local layers, then 1 global
    k0 = next(a for a in small.manifest.arrays if a.name == "layer_0/k")
    k5 = next(a for a in small.manifest.arrays if a.name == "layer_5/k")
    assert k0.shape[1] == min(length, WINDOW) and k5.shape[1] == length
    if length > WINDOW:
        assert small.root != full.root  # the digests cover what is stored
        ratio = _stored_bytes(small.manifest) / _stored_bytes(full.manifest)
        assert ratio == pytest.approx((5 * WINDOW + length) / (6 * length))
    else:
        assert small.root == full.root  # nothing to drop

    from_full = graft.graft(eng, full.path, query, max_new_tokens=NEW)
    from_small = graft.graft(eng, small.path, query, max_new_tokens=NEW)
    verdict = graft.compare(from_small.run, from_full.run)
    assert verdict.first_mismatch_step is None and verdict.steps == NEW, verdict
    # Reference (a) for the compacted artifact: the full recompute, dropped slots hashed as zeros.
    reference = graft.recompute(eng, from_small.links, query, max_new_tokens=NEW)
    assert graft.compare(from_small.run, reference).bit_identical


def test_dropped_slots_restore_as_zeros_and_the_rest_as_deposited(tiny_params_on, tmp_path):
    eng = _engine(tiny_params_on, "2x4", 100)
    small = _deposit(eng, _ids(100, 0), tmp_path / "small", compact=True)
    restored = restore.restore(small.path, eng.mesh)
    kept = 100 - WINDOW
    for i, (got, want) in enumerate(zip(restored.state.layers, small.state.layers, strict=True)):
        k, full_k = np.asarray(got.k).view(np.uint16), np.asarray(want.k).view(np.uint16)
        if i < 5:
            assert not k[:, :kept].any()
            np.testing.assert_array_equal(k[:, kept:], full_k[:, kept:])
        else:
            np.testing.assert_array_equal(k, full_k)
        np.testing.assert_array_equal(np.asarray(got.positions), np.asarray(want.positions))


def test_compaction_on_another_mesh_and_in_a_chain(tiny_params_on, tmp_path):
    ids, query = _ids(100, 3), _ids(QUERY, 1)
    cache = 100 + QUERY + NEW
    src, dst = _engine(tiny_params_on, "2x4", cache), _engine(tiny_params_on, "1", cache)
    whole = _deposit(src, ids, tmp_path / "whole", compact=False)
    parent = _deposit(src, ids[:, :64], tmp_path / "parent", compact=True)
    child = _deposit(src, ids[:, 64:], tmp_path / "child", compact=True, parent=parent.path)
    assert child.manifest.compaction.kept_from == 36 - WINDOW
    from_chain = graft.graft(dst, child.path, query, max_new_tokens=NEW)
    from_whole = graft.graft(dst, whole.path, query, max_new_tokens=NEW)
    assert graft.compare(from_chain.run, from_whole.run).first_mismatch_step is None
    # Reference (b): prefilled on the deposit mesh, moved to this one, continued here.
    reference = graft.prefill_elsewhere_then_continue(
        src, dst, from_chain.links, query, max_new_tokens=NEW
    )
    assert graft.compare(from_chain.run, reference).bit_identical


def test_a_second_deposit_compiles_nothing(tiny_params_on, tmp_path):
    """Every program a compacted deposit runs (the empty cache, the prefill, the cut to the used
    slots, compaction's cut, the stacking) is compiled once per layout: depositing another text of
    the same length compiles nothing. The empty cache and compaction's cut were fresh closures,
    compiled again on every deposit; this fails with either one's cache cleared."""
    eng = _engine(tiny_params_on, "2x4", 100 + QUERY + NEW)
    _deposit(eng, _ids(100, 0), tmp_path / "first", compact=True)  # warm
    with compiles() as compiled:
        second = _deposit(eng, _ids(100, 1), tmp_path / "second", compact=True)
    assert second.manifest.compaction is not None and second.manifest.compaction.kept_from
    assert compiled == [], f"{len(compiled)} programs compiled by a second deposit"
