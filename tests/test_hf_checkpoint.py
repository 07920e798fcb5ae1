"""Hugging Face Gemma 3 text checkpoints: the layout proven against Hugging Face's own semantics,
sharded reads on every mesh, and one clear refusal per kind of bad
checkpoint. The real-size proof (the 270M written out and read back) is in test_weight_sources."""

import dataclasses
import json
import os
import re

import jax
import numpy as np
import pytest
from cli_runs import ROOT, run_cli
from conftest import MESHES
from gemma import gm
from safetensors.numpy import load_file, save_file

from kvgraft_jax.core import hf_checkpoint, model, sharding

NAME = "tiny"


def _params(name=NAME, config=None):
    module = gm.nn.Transformer(config=config) if config else model.build_model(name)
    mesh = sharding.make_mesh(MESHES["1"])
    params, _ = model.init_random_params(module, seed=3, mesh=mesh)
    return module, params


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    module, params = _params()
    path = tmp_path_factory.mktemp("hf") / "ckpt"
    hf_checkpoint.write(params, module.config, path, shards=2)
    return module, params, path


def _hf_tensors(path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


@pytest.mark.parametrize("variant", ["gemma3", "mha_untransposed_gating"])
def test_the_layout_computes_what_hugging_face_computes(variant, tmp_path):
    """Hugging Face's `Linear` computes x @ W.T with output features ordered (head, head_dim);
    fed one-hot rows, that and gemma's einsum on the mapped leaf both copy weights, so they must
    agree bit for bit. The second variant covers qkv_einsum (as many KV heads as query heads) and
    the untransposed gating einsum."""
    config = model.build_model("tiny").config
    if variant != "gemma3":
        config = dataclasses.replace(
            config, num_kv_heads=config.num_heads, transpose_gating_einsum=False
        )
    module, params = _params(config=config)
    hf_checkpoint.write(params, config, tmp_path / "ck")
    hf = {k: _f32(v) for k, v in _hf_tensors(tmp_path / "ck").items()}
    n, k, h, d = config.num_heads, config.num_kv_heads, config.head_dim, config.embed_dim
    f = config.hidden_dim
    layer = params["layer_1"]
    eye_d, eye_f, eye_nh = np.eye(d, dtype=np.float32), np.eye(f, dtype=np.float32), np.eye(n * h)
    p = "model.layers.1."

    def hf_heads(name, heads):  # x @ W.T, then view(..., heads, head_dim)
        return (eye_d @ hf[p + name].T).reshape(d, heads, h)

    attn = layer["attn"]
    if "qkv_einsum" in attn:
        q_w, k_w, v_w = (_f32(attn["qkv_einsum"]["w"][i]) for i in range(3))
    else:
        q_w = _f32(attn["q_einsum"]["w"])
        k_w, v_w = (_f32(attn["kv_einsum"]["w"][i]) for i in range(2))
    assert np.array_equal(
        hf_heads("self_attn.q_proj.weight", n), np.einsum("td,ndh->tnh", eye_d, q_w)
    )
    assert np.array_equal(
        hf_heads("self_attn.k_proj.weight", k), np.einsum("td,kdh->tkh", eye_d, k_w)
    )
    assert np.array_equal(
        hf_heads("self_attn.v_proj.weight", k), np.einsum("td,kdh->tkh", eye_d, v_w)
    )
    heads_in = eye_nh.reshape(n * h, n, h).astype(np.float32)  # o_proj reads (head, head_dim)
    assert np.array_equal(
        heads_in.reshape(n * h, n * h) @ hf[p + "self_attn.o_proj.weight"].T,
        np.einsum("tnh,nhd->td", heads_in, _f32(attn["attn_vec_einsum"]["w"])),
    )
    gating = _f32(layer["mlp"]["gating_einsum"])
    # gemma: '...F,NHF->...NH' (transposed: [2, mlp, embed]) or '...F,NFH->...NH' ([2, embed, mlp])
    eq = "td,nfd->tnf" if config.transpose_gating_einsum else "td,ndf->tnf"
    ours = np.einsum(eq, eye_d, gating)
    assert np.array_equal(eye_d @ hf[p + "mlp.gate_proj.weight"].T, ours[:, 0])
    assert np.array_equal(eye_d @ hf[p + "mlp.up_proj.weight"].T, ours[:, 1])
    assert np.array_equal(
        eye_f @ hf[p + "mlp.down_proj.weight"].T, eye_f @ _f32(layer["mlp"]["linear"])
    )
    # Both libraries' RMSNorm computes x * (1 + weight): the weights are the same numbers.
    assert np.array_equal(
        hf[p + "input_layernorm.weight"], _f32(layer["pre_attention_norm"]["scale"])
    )
    assert np.array_equal(
        hf["model.embed_tokens.weight"], _f32(params["embedder"]["input_embedding"])
    )
    assert "lm_head.weight" not in hf  # tied
    # And the way back: every leaf read again bit-identical.
    loaded = hf_checkpoint.load(
        tmp_path / "ck", module, sharding.make_mesh(MESHES["8"]), model_name=NAME
    )
    assert loaded.fingerprint == model.weights_fingerprint(config, params)


@pytest.mark.parametrize("mesh_name", ["1", "8", "2x4"])
def test_a_sharded_checkpoint_loads_bit_identical_in_each_mesh_sharding(written, mesh_name):
    module, params, path = written
    mesh = sharding.make_mesh(MESHES[mesh_name])
    loaded = hf_checkpoint.load(path, module, mesh, model_name=NAME)
    assert loaded.fingerprint == model.weights_fingerprint(module.config, params)
    for leaf, want in zip(
        jax.tree.leaves(loaded.params), jax.tree.leaves(loaded.plan.shardings), strict=True
    ):
        assert leaf.sharding == want
    for got, ref in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params), strict=True):
        assert (
            np.asarray(got).view(np.uint16).tobytes() == np.asarray(ref).view(np.uint16).tobytes()
        )


def test_the_loader_reads_what_is_on_disk(written, tmp_path):
    """One changed byte of the weights is another model: another fingerprint (nothing cached)."""
    module, params, path = written
    changed = _copy(path, tmp_path)
    shard = sorted(changed.glob("*.safetensors"))[-1]
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].copy()
    tensors[name].reshape(-1)[0] += 1
    save_file(tensors, shard, metadata={"format": "pt"})
    assert _load(path).fingerprint == model.weights_fingerprint(module.config, params)
    assert _load(changed).fingerprint != _load(path).fingerprint


def _copy(path, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    for file in path.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    return out


def _edit_config(path, **changes):
    data = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None and key.startswith("-"):
            data.pop(key[1:], None)
        else:
            data[key] = value
    (path / "config.json").write_text(json.dumps(data))


def _load(path, name=NAME):
    mesh = sharding.make_mesh(MESHES["1"])
    return hf_checkpoint.load(path, model.build_model(name), mesh, model_name=name)


def test_config_differences_are_listed_one_line_each(written, tmp_path):
    _, _, path = written
    copy = _copy(path, tmp_path)
    _edit_config(
        copy,
        num_hidden_layers=5,
        sliding_window=4096,
        rope_theta=10000.0,
        layer_types=["sliding_attention"] * 6,
    )
    with pytest.raises(hf_checkpoint.HFCheckpointError) as e:
        _load(copy)
    lines = str(e.value).splitlines()
    assert "layers: checkpoint 5, tiny 6" in lines[1]
    assert any("sliding window: checkpoint 4096, tiny 16" in x for x in lines)
    assert any("global RoPE base: checkpoint 10000.0, tiny 1000000" in x for x in lines)
    assert any("global layers: checkpoint [], tiny [5]" in x for x in lines)
    assert any("layer_types: 6 entries for num_hidden_layers 5" in x for x in lines)
    assert len(lines) == 6


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "gemma3", "vision_config": {}}, "multimodal Gemma 3 checkpoint"),
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "holds a 'llama' model"),
        ({"-hidden_size": None}, "lacks hidden_size"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "global RoPE type 'yarn'"),
        ({"hidden_activation": "silu"}, "activation: checkpoint silu"),
        ({"query_pre_attn_scalar": 128}, "query scaling (query_pre_attn_scalar): checkpoint 128"),
    ],
)
def test_a_config_of_another_model_is_refused_by_name(written, tmp_path, changes, message):
    _, _, path = written
    copy = _copy(path, tmp_path)
    _edit_config(copy, **changes)
    with pytest.raises(
        hf_checkpoint.HFCheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        _load(copy)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_hidden_layers": "six"}, "malformed field (ValueError"),
        ({"layer_types": 7}, "malformed field (TypeError"),
        ({"rope_scaling": {"rope_type": "linear"}}, "malformed field (KeyError: 'factor')"),
        ({"rope_parameters": {"full_attention": {}}}, "malformed field (KeyError: 'rope_theta')"),
        ({"num_attention_heads": [8]}, "query heads: checkpoint [8], tiny 8"),
    ],
)
def test_a_malformed_config_is_refused_in_one_line(written, tmp_path, changes, message):
    _, _, path = written
    copy = _copy(path, tmp_path)
    _edit_config(copy, **changes)
    with pytest.raises(hf_checkpoint.HFCheckpointError, match=re.escape(message)):
        _load(copy)


def test_an_index_cannot_point_outside_its_directory(written, tmp_path):
    _, _, path = written
    copy = _copy(path, tmp_path)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = "../../outside.safetensors"
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        hf_checkpoint.HFCheckpointError, match=r"must be \.safetensors files beside it"
    ):
        _load(copy)
    index["weight_map"][name] = {"not": "a name"}
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        hf_checkpoint.HFCheckpointError, match=r"must be \.safetensors files beside it"
    ):
        _load(copy)


def test_a_transformers_5_config_reads_the_same(written, tmp_path):
    module, params, path = written
    copy = _copy(path, tmp_path)
    data = json.loads((copy / "config.json").read_text())
    data["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": data.pop("rope_theta")},
        "sliding_attention": {
            "rope_type": "default",
            "rope_theta": data.pop("rope_local_base_freq"),
        },
    }
    data.pop("rope_scaling")
    data.pop("layer_types")
    data["sliding_window_pattern"] = 6
    (copy / "config.json").write_text(json.dumps(data))
    assert _load(copy).fingerprint == model.weights_fingerprint(module.config, params)


def _rewrite_shard(path, edit):
    shard = sorted(path.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda p: sorted(p.glob("model-*.safetensors"))[1].unlink(),
            r"names model-00002-of-00002\.safetensors, missing",
        ),
        (
            lambda p: (p / "model.safetensors.index.json").unlink(),
            "has neither model.safetensors nor",
        ),
        (lambda p: (p / "config.json").unlink(), "it has no config.json"),
        (  # a forged index of gigabytes (sparse here) is refused before it is read
            lambda p: os.truncate(p / "model.safetensors.index.json", 3 << 30),
            r"is 3,221,225,472 bytes: not checkpoint metadata",
        ),
        (
            lambda p: sorted(p.glob("model-*"))[0].write_bytes(
                sorted(p.glob("model-*"))[0].read_bytes()[:1000]
            ),
            "not a readable safetensors file",
        ),
        (
            lambda p: _rewrite_shard(p, lambda t: t.pop("model.embed_tokens.weight")),
            r"places model\.embed_tokens\.weight in model-00001-of-00002\.safetensors, which does not hold it",
        ),
    ],
)
def test_an_incomplete_checkpoint_is_refused_by_name(written, tmp_path, damage, message):
    _, _, path = written
    copy = _copy(path, tmp_path)
    damage(copy)
    with pytest.raises(hf_checkpoint.HFCheckpointError, match=message):
        _load(copy)


def test_missing_extra_or_misshapen_tensors_are_each_named(tmp_path):
    module, params = _params()
    hf_checkpoint.write(params, module.config, tmp_path / "ck")
    single = tmp_path / "ck" / "model.safetensors"
    tensors = load_file(single)
    tensors.pop("model.layers.0.mlp.up_proj.weight")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1]
    tensors["model.layers.2.self_attn.k_proj.weight"] = tensors[
        "model.layers.2.self_attn.k_proj.weight"
    ].astype(np.int32)
    save_file(tensors, single, metadata={"format": "pt"})
    with pytest.raises(hf_checkpoint.HFCheckpointError) as e:
        _load(tmp_path / "ck")
    text = str(e.value)
    assert "4 problem(s)" in text
    assert "lacks model.layers.0.mlp.up_proj.weight" in text
    assert "model.norm.weight is [127], the model needs [128]" in text
    assert "model.layers.2.self_attn.k_proj.weight is I32" in text
    assert "lm_head.weight: an untied output head" in text


def test_writing_refuses_to_overwrite_and_keeps_the_hub_layout(written, tmp_path):
    module, params, path = written
    with pytest.raises(hf_checkpoint.HFCheckpointError, match="not empty"):
        hf_checkpoint.write(params, module.config, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {f.name: load_file(f) for f in sorted(path.glob("model-*.safetensors"))}
    assert sorted(tensors) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert index["weight_map"] == {n: f for f, held in tensors.items() for n in held}
    sizes = [sum(t.nbytes for t in held.values()) for held in tensors.values()]
    assert index["metadata"]["total_size"] == sum(sizes) and max(sizes) < 2 * min(sizes)


def test_the_cli_loads_a_checkpoint_and_refuses_a_broken_one_in_one_line(written, tmp_path):
    module, params, path = written
    report = tmp_path / "r.json"
    ok = run_cli(
        f"--model={NAME}",
        f"--weights={path}",
        "--prompt_ids=2,300,301",
        "--max_new_tokens=2",
        f"--report={report}",
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(report.read_text())["model"]["fingerprint"] == model.weights_fingerprint(
        module.config, params
    )
    copy = _copy(path, tmp_path)
    _edit_config(copy, num_key_value_heads=2)
    bad = run_cli(f"--model={NAME}", f"--weights={copy}", "--prompt_ids=2,300")
    assert bad.returncode == 2 and bad.stdout == ""
    errors = [line for line in bad.stderr.splitlines() if line.startswith("kvgraft_jax: error:")]
    assert len(errors) == 1 and "does not match --model=tiny" in errors[0], bad.stderr
    assert "  KV heads: checkpoint 2, tiny 4" in bad.stderr.splitlines()


def test_the_checkpoints_tokenizer_is_used_and_a_forged_one_refused(written, tmp_path):
    from kvgraft_jax.core import tokenizer
    from kvgraft_jax.run import config, runtime

    _, _, path = written
    copy = _copy(path, tmp_path)
    shipped = ROOT / "kvgraft_jax" / "assets" / tokenizer.TINY_TOKENIZER_ASSET
    (copy / "tokenizer.model").write_bytes(shipped.read_bytes())  # as a release ships its own
    proto = tokenizer.tiny_tokenizer().info()
    cfg = config.RunConfig(model="gemma3_270m", weights=str(copy), prompt="hi")
    assert runtime.load_tokenizer(cfg).info() == proto
    (copy / "tokenizer.model").write_bytes(b"\x00not a sentencepiece model" * 10)
    with pytest.raises(config.ConfigError, match="is not a SentencePiece model"):
        runtime.load_tokenizer(cfg)
