"""Model registry, real-size shape checks (nothing allocated), deterministic tiny weights, fingerprint."""

import jax
import numpy as np
import pytest
from gemma.gm.nn import _modules

from kvgraft_jax.core import model, sharding

# Parameter counts of gemma's text-only Gemma 3 classes, from jax.eval_shape.
EXPECTED_PARAMS = {
    "gemma3_270m": 268_098_176,
    "gemma3_1b": 999_885_952,
    "gemma3_4b": 3_880_099_328,
    "gemma3_12b": 11_765_788_416,
    "gemma3_27b": 27_009_002_240,
}


@pytest.mark.parametrize("name", list(model.GEMMA3_MODELS))
def test_real_size_configs_shape_check_without_allocating(name):
    module = model.build_model(name)
    abstract = model.abstract_params(module)
    leaves = jax.tree.leaves(abstract)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(int(np.prod(x.shape)) for x in leaves) == EXPECTED_PARAMS[name]
    assert {str(x.dtype) for x in leaves} == {"bfloat16"}
    assert module.config.vision_encoder is None  # text only
    # Every parameter has logical axes, so a sharding plan exists on any mesh.
    mesh = sharding.make_mesh(sharding.MeshSpec(2, 4))
    plan = model.param_plan(abstract, module.config, mesh)
    specs = [s.spec for s in jax.tree.leaves(plan.shardings, is_leaf=lambda x: hasattr(x, "spec"))]
    assert len(specs) == len(leaves)
    assert any("model" in tuple(s) for s in specs)


def test_gemma3_270m_facts():
    config = model.build_model("gemma3_270m").config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        18,
        4,
        1,
        256,
    )
    assert config.num_embed == 262_144 and config.sliding_window_size == 512


@pytest.mark.parametrize("name", list(model.TINY_CONFIGS))
def test_tiny_family_keeps_gemma3_traits(name):
    config = model.TINY_CONFIGS[name]
    types = list(config.attention_types)
    assert types[:6] == [_modules.AttentionType.LOCAL_SLIDING] * 5 + [_modules.AttentionType.GLOBAL]
    assert config.use_qk_norm and config.sliding_window_size < 48
    assert config.num_heads % config.num_kv_heads == 0


def test_tiny_has_several_kv_heads_for_head_sharding():
    assert model.TINY_CONFIGS["tiny"].num_kv_heads == 4
    assert model.TINY_CONFIGS["tiny"].num_heads > 4  # GQA, not MHA


def test_unknown_model_is_refused():
    with pytest.raises(model.UnknownModelError, match="known: gemma3_270m"):
        model.build_model("gemma4")


def test_fingerprint_is_the_same_on_every_mesh(tiny_params_on):
    config = model.TINY_CONFIGS["tiny"]
    prints = {
        m: model.weights_fingerprint(config, tiny_params_on(m)[1]) for m in ("1", "8", "2x4", "4x2")
    }
    assert len(set(prints.values())) == 1, prints


def test_params_are_created_in_their_target_sharding(tiny_params_on):
    mesh, params = tiny_params_on("2x4")
    q = params["layer_0"]["attn"]["q_einsum"]["w"]
    assert q.sharding.mesh.shape == mesh.shape
    assert tuple(q.sharding.spec) == ("model",)
    emb = params["embedder"]["input_embedding"]
    assert tuple(emb.sharding.spec) == ("model",)


def test_fingerprint_depends_on_seed_config_and_every_bit(tiny_params_on):
    config = model.TINY_CONFIGS["tiny"]
    _, params = tiny_params_on("1")
    base = model.weights_fingerprint(config, params)
    _, other_seed = tiny_params_on("1", seed=1)
    assert model.weights_fingerprint(config, other_seed) != base
    assert model.weights_fingerprint(model.TINY_CONFIGS["tiny_mqa"], params) != base

    flipped = jax.tree.map(lambda x: x, params)
    norm = np.asarray(params["final_norm"]["scale"])
    bits = norm.view(np.uint16).copy()
    bits[3] ^= 1  # one bit of one parameter
    flipped["final_norm"]["scale"] = jax.numpy.asarray(bits.view(norm.dtype))
    assert model.weights_fingerprint(config, flipped) != base


def test_same_seed_same_weights(tiny_params_on):
    module = model.build_model("tiny")
    mesh, params = tiny_params_on("1")
    again, _ = model.init_random_params(module, seed=0, mesh=mesh)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_config_json_is_plain():
    import json

    data = model.config_to_json(model.TINY_CONFIGS["tiny"])
    assert json.loads(json.dumps(data)) == data
    assert data["attention_types"][5] == "GLOBAL"


def test_registry_matches_the_flag_choices():
    from kvgraft_jax.run import config

    assert set(model.MODEL_NAMES) == set(config.MODEL_NAMES)


def test_an_orbax_gemma_checkpoint_loads_sharded_and_unchanged(tiny_params_on, tmp_path):
    """A checkpoint in the layout gemma's `gm.ckpts` reads, written from the tiny model."""
    from gemma import gm

    _, params = tiny_params_on("1")
    path = tmp_path / "ckpt"
    gm.ckpts.save_params(params, path, wait_until_finished=True)
    mesh = sharding.make_mesh(sharding.MeshSpec(data=2, model=4))
    loaded, plan = model.load_checkpoint_params(
        model.build_model("tiny"), str(path), mesh=mesh, model_name="tiny"
    )
    config = model.TINY_CONFIGS["tiny"]
    assert model.weights_fingerprint(config, loaded) == model.weights_fingerprint(config, params)
    for leaf, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(plan.shardings), strict=True):
        assert leaf.sharding == want
    with pytest.raises(model.CheckpointError, match="does not hold tiny_mqa parameters"):
        model.load_checkpoint_params(
            model.build_model("tiny_mqa"), str(path), mesh=mesh, model_name="tiny_mqa"
        )
    with pytest.raises(model.CheckpointError, match="no Orbax Gemma checkpoint"):
        model.load_checkpoint_params(
            model.build_model("tiny"), str(tmp_path / "none"), mesh=mesh, model_name="tiny"
        )
