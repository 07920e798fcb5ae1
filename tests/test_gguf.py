"""The real Gemma 3 270M from its GGUF: conversion, cache, tokenizer, a sensible greedy answer; and
a clear refusal for every kind of bad GGUF."""

import shutil

import gguf
import numpy as np
import pytest

from kvgraft_jax.core import conversion, engine, gguf_import, model, sharding, tokenizer

NAME = "gemma3_270m"
TEXTS = [
    "The verified solution is stored once and grafted later.",
    "def f(x):\n    return x * 2\n\tpass",
    "12345 + 678 = 13023",
    "a  b   c    d\n\n\n  e",
    "速度与精确。日本語のテキスト。 مرحبا بالعالم",
    "emoji 🙂👍🏽 and 👩‍💻",
    "<start_of_turn>user\nHi<end_of_turn>",
]


@pytest.fixture(scope="module")
def converted(gemma3_270m_gguf):
    return gemma3_270m_gguf


def test_the_embedded_gguf_is_the_published_file(converted):
    path, _, first = converted
    assert first.source_sha256 == (
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    )
    assert conversion.sha256_file(path) == first.source_sha256


def test_conversion_is_cached_and_loads_identically_on_any_mesh(converted):
    path, root, first = converted
    module = model.build_model(NAME)
    again = gguf_import.prepare(path, module, model_name=NAME, root=root)
    assert first.convert_s > 0 and again.convert_s == 0.0
    assert again.params_sha256 == first.params_sha256
    fingerprints = set()
    for spec in (sharding.MeshSpec(1, 1), sharding.MeshSpec(1, 8)):
        _, _, fingerprint = conversion.load_params(again, module, sharding.make_mesh(spec))
        fingerprints.add(fingerprint)
    assert fingerprints == {first.params_sha256}


def test_the_real_model_answers_sensibly(converted):
    _, _, conv = converted
    module = model.build_model(NAME)
    mesh = sharding.make_mesh(sharding.MeshSpec(1, 1))
    params, _, _ = conversion.load_params(conv, module, mesh)
    tok = tokenizer.Tokenizer(conv.tokenizer_proto(), source="gguf")
    prompt = tok.encode("Paris is the capital of France. Berlin is the capital of", add_bos=True)
    eng = engine.Engine(module, params, mesh, batch_size=1, cache_length=len(prompt) + 2)
    gen = eng.generate(np.asarray([prompt]), max_new_tokens=2, chunk_size=64)
    assert tok.decode(gen.token_ids[0][:1]) == " Germany"


def test_the_rebuilt_tokenizer_round_trips_and_keeps_gemma_ids(converted):
    _, _, conv = converted
    tok = tokenizer.Tokenizer(conv.tokenizer_proto(), source="gguf")
    assert tok.vocab_size == 262_144
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text, text
        assert 3 not in ids, f"<unk> in {text!r}"  # byte fallback covers everything
    assert tok.encode("<start_of_turn>user")[0] == 105
    assert tok.encode("<end_of_turn>") == [106]
    # Runs of spaces are single user-defined pieces in Gemma's vocabulary.
    assert len(tok.encode("    ")) == 1
    assert tok.encode("12345") == [tok.piece_to_id(d) for d in "12345"]  # digits split


def _write(path, arch="gemma3", *, layers=18, tensors=()):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_uint32(f"{arch}.embedding_length", 640)
    for name, array, raw_dtype in tensors:
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_another_architecture_is_refused(tmp_path):
    path = _write(tmp_path / "llama.gguf", "llama")
    with pytest.raises(gguf_import.GGUFError, match="holds a 'llama' model"):
        gguf_import.open_gguf(path)


def test_a_truncated_gguf_is_refused(converted, tmp_path):
    path, _, _ = converted
    cut = tmp_path / "cut.gguf"
    with open(path, "rb") as f:
        cut.write_bytes(f.read(3_000_000))
    with pytest.raises(gguf_import.GGUFError, match="not a readable GGUF"):
        gguf_import.open_gguf(cut)
    with pytest.raises(gguf_import.GGUFError, match="no GGUF file"):
        gguf_import.open_gguf(tmp_path / "missing.gguf")


def test_a_gguf_of_another_shape_is_refused_naming_the_fields(tmp_path):
    reader = gguf_import.open_gguf(_write(tmp_path / "small.gguf", layers=5))
    with pytest.raises(gguf_import.GGUFError, match=r"layers: GGUF 5, gemma3_270m 18"):
        gguf_import.check_config(reader, model.build_model(NAME).config, model_name=NAME)


def test_an_unsupported_tensor_type_is_refused_by_name(tmp_path):
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q2_K]
    raw = np.zeros((4, 2 * size), np.uint8)  # 4 rows of 2 * 256 Q2_K weights
    q2k = gguf.GGMLQuantizationType.Q2_K
    path = _write(tmp_path / "q2.gguf", tensors=[("blk.0.attn_q.weight", raw, q2k)])
    with pytest.raises(gguf_import.GGUFError, match="type Q2_K"):
        gguf_import.dequantized(gguf_import.open_gguf(path))
    assert block == 256


def test_missing_tensors_are_refused(tmp_path):
    weights = {"token_embd.weight": np.zeros((4, 4), np.float32)}
    with pytest.raises(gguf_import.GGUFError, match=r"lacks tensor output_norm\.weight"):
        gguf_import.to_gemma_params(weights, model.build_model(NAME).config)


def test_a_damaged_cache_is_refused(converted, tmp_path):
    _, _, conv = converted
    copy = tmp_path / conv.directory.name
    shutil.copytree(conv.directory, copy)
    data = sorted((copy / "params").rglob("*"), key=lambda p: p.stat().st_size)[-1]
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    damaged = conversion.Conversion(copy, conv.source_sha256, conv.params_sha256, 0.0)
    mesh = sharding.make_mesh(sharding.MeshSpec(1, 1))
    with pytest.raises(conversion.WeightsError, match="damaged"):
        conversion.load_params(damaged, model.build_model(NAME), mesh)
