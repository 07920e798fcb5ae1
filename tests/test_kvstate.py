"""The typed KV state: abstract form, sharded zeros, gemma dict round trip, sharding checks."""

import jax
import numpy as np
import pytest
from conftest import compiles

from kvgraft_jax.core import kvstate, sharding

SHAPE = kvstate.KVShape(num_layers=6, batch_size=2, cache_length=64, num_kv_heads=4, head_dim=32)


def test_abstract_carries_target_sharding():
    mesh = sharding.make_mesh(sharding.MeshSpec(2, 4))
    abstract = SHAPE.abstract(mesh)
    assert len(abstract) == 6
    k = abstract[0].k
    assert isinstance(k, jax.ShapeDtypeStruct)
    # bf16 K/V are held as their bits (XLA:CPU writes a bf16 slot by widening the whole cache).
    assert k.shape == (2, 64, 4, 32) and str(k.dtype) == "uint16"
    assert str(SHAPE.array_shapes(values=True)["k"][1]) == SHAPE.dtype == "bfloat16"
    assert tuple(k.sharding.spec) == ("data", None, "model")
    assert tuple(abstract[0].positions.sharding.spec) == ("data",)
    assert abstract[0].end_index.dtype == np.int32


def test_zeros_are_allocated_sharded_and_empty():
    mesh = sharding.make_mesh(sharding.MeshSpec(2, 4))
    state = kvstate.zeros(SHAPE, mesh)
    assert state.length == 0 and state.cache_length == 64
    assert state.shape == SHAPE
    kvstate.assert_shardings(state, mesh)
    assert not np.asarray(state.layers[2].k).view(np.uint16).any()
    assert len(state.layers[0].k.addressable_shards) == 8


def test_a_second_empty_cache_compiles_nothing():
    """`zeros` is one program per shape and mesh. It was a fresh closure, traced, lowered and
    compiled on every call (about 100 ms for the 270M's 8,192-token cache, in every recompute,
    deposit and verify); this fails with its cache cleared."""
    mesh = sharding.make_mesh(sharding.MeshSpec(2, 4))
    kvstate.zeros(SHAPE, mesh)  # warm
    with compiles() as compiled:
        again = kvstate.zeros(SHAPE, mesh)
    assert compiled == [], f"{len(compiled)} programs compiled by a second zeros()"
    kvstate.assert_shardings(again, mesh)
    assert again.length == 0
    assert not any(np.asarray(x).view(np.uint8).any() for x in jax.tree.leaves(again.layers))


def test_gemma_dict_round_trip():
    mesh = sharding.make_mesh(sharding.MeshSpec(1, 1))
    state = kvstate.zeros(SHAPE, mesh)
    cache = state.to_gemma()
    assert sorted(cache) == [f"layer_{i}" for i in range(6)]
    assert sorted(cache["layer_0"]) == ["end_index", "k", "positions", "v"]
    back = kvstate.layers_from_gemma(cache)
    assert all(
        a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state.layers), strict=True)
    )
    with pytest.raises(ValueError, match="layer_0"):
        kvstate.layers_from_gemma({"layer_1": cache["layer_1"]})


def test_layers_are_pytrees_and_length_is_not_a_leaf():
    mesh = sharding.make_mesh(sharding.MeshSpec(1, 1))
    state = kvstate.zeros(SHAPE, mesh)
    assert len(jax.tree.leaves(state.layers)) == 6 * 4


def test_assert_shardings_catches_a_wrong_layout():
    mesh = sharding.make_mesh(sharding.MeshSpec(2, 4))
    state = kvstate.zeros(SHAPE, mesh)
    wrong = jax.device_put(state.layers[3].k, sharding.replicated_sharding(mesh))
    layers = list(state.layers)
    layers[3] = kvstate.LayerKV(wrong, layers[3].v, layers[3].positions, layers[3].end_index)
    with pytest.raises(AssertionError, match="layer_3/k"):
        kvstate.assert_shardings(kvstate.KVState(tuple(layers), 0), mesh)
