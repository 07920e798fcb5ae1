"""The real 270M from every place users keep weights: the GGUF, a Hugging Face checkpoint in the
Hub's exact naming and sharding, and Orbax checkpoints in the gemma package's layouts. The same
numbers give the same parameter tree, the same fingerprint and the same greedy continuation."""

import json

import numpy as np
import orbax.checkpoint as ocp
import pytest
from cli_runs import run_cli
from gemma import gm
from safetensors.numpy import load_file

from kvgraft_jax.core import conversion, hf_checkpoint, model, sharding

NAME = "gemma3_270m"
# google/gemma-3-270m's config.json (the fields that define the network).
PUBLISHED_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-06,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
# Its model.safetensors: per layer these 13 tensors, plus the embedding and the final norm.
PUBLISHED_LAYER = {
    "input_layernorm.weight": [640],
    "mlp.down_proj.weight": [640, 2048],
    "mlp.gate_proj.weight": [2048, 640],
    "mlp.up_proj.weight": [2048, 640],
    "post_attention_layernorm.weight": [640],
    "post_feedforward_layernorm.weight": [640],
    "pre_feedforward_layernorm.weight": [640],
    "self_attn.k_norm.weight": [256],
    "self_attn.k_proj.weight": [256, 640],
    "self_attn.o_proj.weight": [640, 1024],
    "self_attn.q_norm.weight": [256],
    "self_attn.q_proj.weight": [1024, 640],
    "self_attn.v_proj.weight": [256, 640],
}


@pytest.fixture(scope="module")
def real(gemma3_270m_gguf, tmp_path_factory):
    """The GGUF's parameters, and the same numbers written as HF and as Orbax checkpoints."""
    _, _, converted = gemma3_270m_gguf
    module = model.build_model(NAME)
    mesh = sharding.make_mesh(sharding.MeshSpec(1, 1))
    params, _, fingerprint = conversion.load_params(converted, module, mesh)
    root = tmp_path_factory.mktemp("weights")
    hf_checkpoint.write(
        params, module.config, root / "hf", tokenizer_proto=converted.tokenizer_proto(), shards=2
    )
    gm.ckpts.save_params(params, root / "orbax_nested", wait_until_finished=True)
    # The published Flax release's layout: flat 'transformer/<module path>' keys.
    flat = {}
    for layer, tree in params.items():
        for key, leaf in _modules(tree, f"transformer/{layer}"):
            flat.setdefault(key[0], {})[key[1]] = leaf
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(root / "orbax_flat", flat)
    checkpointer.wait_until_finished()
    return module, params, fingerprint, root, converted


def _modules(tree, prefix):
    """(module path, parameter name) -> leaf, as the published checkpoints key them: the MLP's
    two einsums are modules of their own there (`mlp/linear` holds `w`)."""
    for name, value in tree.items():
        if isinstance(value, dict) and any(isinstance(v, dict) for v in value.values()):
            yield from _modules(value, f"{prefix}/{name}")
        elif isinstance(value, dict):
            for leaf_name, leaf in value.items():
                if name == "mlp":
                    yield (f"{prefix}/{name}/{leaf_name}", "w"), leaf
                else:
                    yield (f"{prefix}/{name}", leaf_name), leaf
        else:
            yield (prefix, name), value


def test_the_hugging_face_copy_has_the_hubs_names_shapes_and_config(real):
    _, _, _, root, _ = real
    config = json.loads((root / "hf" / "config.json").read_text())
    assert {k: config[k] for k in PUBLISHED_CONFIG} == PUBLISHED_CONFIG
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    index = json.loads((root / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    shapes = {}
    for file in (root / "hf").glob("model-*.safetensors"):
        shapes.update({n: list(t.shape) for n, t in load_file(file).items()})
    want = {"model.embed_tokens.weight": [262144, 640], "model.norm.weight": [640]}
    for i in range(18):
        want.update({f"model.layers.{i}.{n}": s for n, s in PUBLISHED_LAYER.items()})
    assert shapes == want


def test_every_source_gives_the_same_parameter_tree(real):
    module, params, fingerprint, root, _ = real
    mesh = sharding.make_mesh(sharding.MeshSpec(1, 8))
    first = hf_checkpoint.load(root / "hf", module, mesh, model_name=NAME)
    fingerprints = {"gguf": fingerprint, "hf": first.fingerprint}
    for layout in ("orbax_nested", "orbax_flat"):
        loaded, _ = model.load_checkpoint_params(
            module, str(root / layout), mesh=mesh, model_name=NAME
        )
        fingerprints[layout] = model.weights_fingerprint(module.config, loaded)
    assert set(fingerprints.values()) == {fingerprint}, fingerprints
    # Bit for bit, leaf by leaf (the fingerprint hashes the same bytes; this names a leaf if not).
    for (path, got), ref in zip(
        _leaves(first.params), [x for _, x in _leaves(params)], strict=True
    ):
        assert (
            np.asarray(got).view(np.uint16).tobytes() == np.asarray(ref).view(np.uint16).tobytes()
        ), path


def _leaves(tree):
    import jax

    return jax.tree_util.tree_leaves_with_path(tree)


def test_the_cli_continues_identically_from_every_format(real, tmp_path):
    _, _, fingerprint, root, _ = real
    common = (
        f"--model={NAME}",
        "--prompt=The capital of France is",
        "--max_new_tokens=4",
        "--mesh=data:1,model:1",
    )
    reports = {}
    for source, extra in {
        "gguf": (),
        "hf": (f"--weights={root / 'hf'}",),
        "orbax": (
            f"--weights={root / 'orbax_flat'}",
            f"--tokenizer={root / 'hf' / 'tokenizer.model'}",
        ),
    }.items():
        path = tmp_path / f"{source}.json"
        result = run_cli(*common, *extra, f"--report={path}")
        assert result.returncode == 0, result.stderr
        reports[source] = json.loads(path.read_text())
    assert {r["model"]["fingerprint"] for r in reports.values()} == {fingerprint}
    assert len({json.dumps(r["new_token_ids"]) for r in reports.values()}) == 1
    assert len({json.dumps(r["step_logits_sha256"]) for r in reports.values()}) == 1
    # The HF run read the checkpoint's own tokenizer.model: the GGUF's vocabulary, same bytes.
    assert len({r["tokenizer"]["fingerprint"] for r in reports.values()}) == 1


def test_the_weights_benchmark_times_every_source_with_the_same_numbers(real, tmp_path):
    from kvgraft_jax.bench import weights_bench
    from kvgraft_jax.run import config

    _, _, fingerprint, _, _ = real
    cfg = config.RunConfig(mode="bench", bench="weights", model=NAME, mesh="data:1,model:1")
    result = weights_bench.run(cfg, workdir=tmp_path).to_json()
    assert result["same_fingerprint"] and result["fingerprint"] == fingerprint
    assert set(result["seconds"]) == {
        "gguf_first_s",
        "gguf_cached_s",
        "hf_first_s",
        "hf_again_s",
        "orbax_s",
        "plain_read_s",
    }
    assert all(v > 0 for v in result["seconds"].values())
    assert result["source_bytes"]["gguf"] == 253113024
    assert "hf_again_over_gguf_cached" in result["ratios"]
    assert list(tmp_path.iterdir()) == []  # the scratch copies are gone
    with pytest.raises(config.ConfigError, match="starts from a Gemma 3 GGUF"):
        weights_bench.run(config.RunConfig(mode="bench", bench="weights", model="tiny"))
