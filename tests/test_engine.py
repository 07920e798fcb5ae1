"""The engine on meshes (1), (8,), (2,4), (4,2): shardings, determinism, chunk schedules, refusals."""

import pathlib
import re
import warnings

import numpy as np
import pytest

from kvgraft_jax.core import attention, bits, engine, kvstate

PROMPT_LEN = 48  # longer than the tiny sliding window (16)


def _prompt(batch=1, length=PROMPT_LEN, seed=0):
    rng = np.random.default_rng(seed)
    return np.tile(rng.integers(4, 1024, size=(1, length)), (batch, 1)).astype(np.int32)


def _machine_type() -> str:
    """The CPU XLA:CPU compiles for, as vendor/family/model/AVX-512 BF16: what changed its
    kernels, and so the chunking table, between the machines measured (CI may run on any)."""
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"

    def field(name: str) -> str:
        found = re.search(rf"^{name}\s*:\s*(\S+)", info, re.MULTILINE)
        return found.group(1) if found else "?"

    bf16 = "avx512_bf16" if " avx512_bf16" in info else "no-avx512_bf16"
    return f"{field('vendor_id')}/{field('cpu family')}/{field('model')}/{bf16}"


def _engine(tiny_params_on, mesh_name, *, batch=1, cache_length=64, name="tiny"):
    mesh, params = tiny_params_on(mesh_name, name)
    from kvgraft_jax.core import model

    return engine.Engine(
        model.build_model(name), params, mesh, batch_size=batch, cache_length=cache_length
    )


def test_greedy_ids_are_jnp_argmax_ties_nan_and_zeros_included():
    """The engine's argmax (the least index of the maximum) picks what `jnp.argmax` picks: the
    first of tied maxima, the first NaN, -0 and +0 as equal, infinities; bf16 and float32."""
    import jax.numpy as jnp
    import ml_dtypes

    rng = np.random.default_rng(3)
    rows = rng.standard_normal((12, 1000)).astype(np.float32)
    rows[1, [7, 500, 999]] = 9.0  # tied maxima
    rows[2, [40, 41]] = np.nan
    rows[3, :] = -np.inf
    rows[4, :] = 0.0
    rows[4, [5, 6]] = -0.0
    rows[4, 3] = -0.0
    rows[5, 900] = np.inf
    rows[6, :] = np.nan
    rows[7, [10, 20]] = [np.inf, np.nan]
    rows[8] = np.round(rows[8])  # many ties among small integers
    for dtype in (np.float32, ml_dtypes.bfloat16):
        x = jnp.asarray(rows.astype(dtype))
        expected = np.asarray(jnp.argmax(x, axis=-1))
        got = np.asarray(engine.greedy_ids(x))
        assert got.dtype == np.int32 and got.tolist() == expected.tolist(), dtype
        assert got[1] == 7 and got[2] == 40 and got[6] == 0 and got[7] == 20
        three = jnp.asarray(rows.astype(dtype)).reshape(3, 4, 1000)
        assert np.asarray(engine.greedy_ids(three)).tolist() == expected.reshape(3, 4).tolist()


def test_chunk_schedule():
    assert engine.chunk_schedule(10, 4) == (
        engine.Chunk(0, 4),
        engine.Chunk(4, 4),
        engine.Chunk(8, 2),
    )
    assert engine.chunk_schedule(3, 8, start=5) == (engine.Chunk(5, 3),)
    with pytest.raises(engine.EngineError):
        engine.chunk_schedule(0, 4)
    with pytest.raises(engine.EngineError):
        engine.chunk_schedule(4, 0)


@pytest.mark.parametrize("mesh_name", ["1", "8", "2x4", "4x2"])
def test_generate_on_mesh_keeps_cache_sharded_and_is_deterministic(tiny_params_on, mesh_name):
    eng = _engine(tiny_params_on, mesh_name, batch=2)
    first = eng.generate(_prompt(batch=2), max_new_tokens=6, chunk_size=16)
    second = eng.generate(_prompt(batch=2), max_new_tokens=6, chunk_size=16)

    kvstate.assert_shardings(first.state, eng.mesh)
    spec = first.state.layers[0].k.sharding.spec
    expected = {
        "1": (),
        "8": (),  # 4 KV heads do not divide model=8: replicated (and logged)
        "2x4": ("data", None, "model"),
        "4x2": (None, None, "model"),  # batch 2 does not divide data=4
    }[mesh_name]
    assert tuple(spec) == expected
    assert first.state.length == PROMPT_LEN + 5
    assert first.token_ids.shape == (2, 6)
    assert first.step_logits.shape == (6, 2, 1024)
    # Greedy decoding is a pure function of weights, prompt, schedule and program: run twice, same bits.
    assert bits.first_mismatch(first.step_logits, second.step_logits) is None
    np.testing.assert_array_equal(first.token_ids, second.token_ids)
    # Identical rows of a batch give identical tokens.
    np.testing.assert_array_equal(first.token_ids[0], first.token_ids[1])
    # The tokens are the argmax of the returned logits.
    np.testing.assert_array_equal(
        first.token_ids, np.argmax(first.step_logits.astype(np.float32), axis=-1).T
    )


def test_cache_shardings_are_reported_when_replicated(tiny_params_on):
    eng = _engine(tiny_params_on, "8")
    assert {r.logical_axis for r in eng.cache_replicated} == {"kv_heads"}


# Measured on XLA:CPU with jax/jaxlib 0.9.2 and the blockwise attention (`kvgraft_jax.core.attention`):
# prefilling the same 48 tokens with each chunk size, compared bit for bit with one 48-token
# prefill (logits after the last token, and K/V of every layer), per mesh. Which schedules agree
# with the one-shot prefill depends on the mesh and on the CPU XLA compiles for (its GEMM
# kernels differ by CPU): a property of the compiler, not a promise. The exactness protocol
# replays the artifact's own schedule instead. Measured with attention v2 (float32 products) on
# 2026-12-06, an AMD EPYC (family 26, Zen 5) with AVX-512 BF16; v1's tables differed per machine
# type (BUILD.md). On a CPU not measured with v2 the table is reported as a warning, not
# asserted: add it here and to BUILD.md.
_ZEN5_V2 = {48: True, 32: False, 24: True, 16: True, 12: True, 8: True, 7: True, 1: False}
CHUNKINGS_BIT_IDENTICAL_TO_ONE_SHOT = {  # the same table on both meshes, measured on each
    ("AuthenticAMD/26/2/avx512_bf16", "1"): _ZEN5_V2,
    ("AuthenticAMD/26/2/avx512_bf16", "2x4"): _ZEN5_V2,
}
CHUNK_SIZES = (48, 32, 24, 16, 12, 8, 7, 1)


@pytest.mark.parametrize("mesh_name", ["1", "2x4"])
def test_chunk_schedules_against_one_shot_prefill(tiny_params_on, mesh_name):
    eng = _engine(tiny_params_on, mesh_name)
    prompt = _prompt()
    results = {}
    for chunk_size in CHUNK_SIZES:
        out = eng.prefill(eng.empty_state(), prompt, chunk_size=chunk_size)
        kv = [
            np.asarray(getattr(layer, n))[:, :PROMPT_LEN]
            for layer in out.state.layers
            for n in "kv"
        ]
        results[chunk_size] = (np.asarray(out.last_logits), kv, out.schedule)
    ref_logits, ref_kv, _ = results[48]
    measured = {}
    for chunk_size, (logits, kv, schedule) in results.items():
        assert sum(c.length for c in schedule) == PROMPT_LEN
        same_logits = bits.bits_equal(logits, ref_logits)
        same_kv = all(bits.bits_equal(a, b) for a, b in zip(kv, ref_kv, strict=True))
        assert same_logits == same_kv, f"chunk {chunk_size}: logits and KV disagree on exactness"
        measured[chunk_size] = same_logits
    known = CHUNKINGS_BIT_IDENTICAL_TO_ONE_SHOT.get((_machine_type(), mesh_name))
    if known is None:
        warnings.warn(
            f"no chunking table recorded for this machine on mesh {mesh_name}: {measured}",
            stacklevel=1,
        )
    else:
        assert measured == known, f"the table changed on mesh {mesh_name}: {measured}"
    assert measured[48] and not measured[1]  # token by token never matched a chunked prefill

    # The same schedule replayed is always bit-identical, whatever the schedule.
    again = eng.prefill(eng.empty_state(), prompt, chunk_size=24)
    assert bits.bits_equal(again.last_logits, results[24][0])


def test_prefill_then_continue_matches_replayed_schedule(tiny_params_on):
    """P then Q in two calls equals the same chunks in one call: the schedule, not the call, matters."""
    eng = _engine(tiny_params_on, "2x4")
    prompt = _prompt()
    split = eng.prefill(eng.empty_state(), prompt[:, :32], chunk_size=16)
    split = eng.prefill(split.state, prompt[:, 32:], chunk_size=16)
    whole = eng.prefill(eng.empty_state(), prompt, chunk_size=16)
    assert split.state.length == whole.state.length == PROMPT_LEN
    assert bits.bits_equal(split.last_logits, whole.last_logits)
    for a, b in zip(split.state.layers, whole.state.layers, strict=True):
        assert bits.bits_equal(a.k, b.k) and bits.bits_equal(a.v, b.v)
        assert bits.bits_equal(a.positions, b.positions)


def test_refuses_writes_past_the_cache(tiny_params_on):
    eng = _engine(tiny_params_on, "1", cache_length=40)
    # Whole attention blocks: 40 requested slots become one block of 256.
    assert eng.kv_shape.cache_length == attention.cache_slots(40) == attention.BLOCK
    with pytest.raises(engine.EngineError, match="cache"):
        eng.prefill(eng.empty_state(), _prompt(length=attention.BLOCK + 1), chunk_size=16)
    with pytest.raises(engine.EngineError, match="exceeds the cache length"):
        eng.generate(_prompt(length=attention.BLOCK - 4), max_new_tokens=8, chunk_size=16)


def test_refuses_bad_token_ids(tiny_params_on):
    eng = _engine(tiny_params_on, "1")
    with pytest.raises(engine.EngineError, match="pad id"):
        eng.prefill(eng.empty_state(), np.array([[2, 0, 5]]), chunk_size=4)
    with pytest.raises(engine.EngineError, match="outside"):
        eng.prefill(eng.empty_state(), np.array([[2, 5000]]), chunk_size=4)
    with pytest.raises(engine.EngineError, match="shape"):
        eng.prefill(eng.empty_state(), np.ones((3, 4), np.int32), chunk_size=4)


def test_stop_token_ends_decoding_early(tiny_params_on):
    eng = _engine(tiny_params_on, "1")
    free = eng.generate(_prompt(), max_new_tokens=8, chunk_size=16)
    stop = int(free.token_ids[0, 2])
    stopped = eng.generate(_prompt(), max_new_tokens=8, chunk_size=16, stop_token=stop)
    first_stop = list(free.token_ids[0]).index(stop)
    assert stopped.token_ids.shape[1] == first_stop + 1
    np.testing.assert_array_equal(stopped.token_ids[0], free.token_ids[0, : first_stop + 1])


def test_mqa_tiny_model_runs_sharded(tiny_params_on):
    eng = _engine(tiny_params_on, "2x4", name="tiny_mqa")
    out = eng.generate(_prompt(), max_new_tokens=3, chunk_size=16)
    kvstate.assert_shardings(out.state, eng.mesh)
    assert out.state.layers[0].k.shape[2] == 1


def _program_text(eng, program: str) -> str:
    return (eng.decode_program() if program == "decode" else eng.prefill_program(16)).as_text()


_WHOLE = re.compile(r"=\s*(\w+)\[([\d,]*)\](?:\{[^}]*\})?\s+(copy|convert|transpose)\(")


@pytest.mark.parametrize("program", ["decode", "prefill"])
def test_the_cache_is_donated_and_written_in_place(tiny_params_on, program):
    """Every cache array of the compiled program is aliased to its output: XLA updates the
    donated buffers, it does not allocate a second cache."""
    import jax

    eng = _engine(tiny_params_on, "1", cache_length=512)
    header = _program_text(eng, program).splitlines()[0]
    leaves = jax.tree.leaves(eng.empty_state().layers)
    assert header.count("may-alias") + header.count("must-alias") == len(leaves), header[:300]


def _computations(hlo: str) -> dict[str, list[str]]:
    """The program's computations by name, each as its instruction lines."""
    out: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header and not line.startswith(" "):
            current = out.setdefault(header.group(1), [])
        elif current is not None and "=" in line:
            current.append(line.strip())
    return out


_INSTRUCTION = re.compile(r"=\s*(\w+)\[([\d,]*)\]\S*\s+([\w\-]+)\(")
_CALLS = re.compile(r"calls=%([\w.\-]+)")


def _size(dims: str) -> int:
    return int(np.prod([int(d) for d in dims.split(",") if d]))


def test_no_step_rewrites_the_cache_or_the_weights(tiny_params_on):
    """#20's finding, fixed: the decode step writes one slot in place, reads the cache a block at a
    time, and reads each weight as stored.

    Before, XLA:CPU widened every layer's whole bf16 cache to f32 and back to write one slot
    (the cache is now held as bits: `kvstate`), and walked gemma's weight layouts with a stride
    (the engine now reads a contract-last copy: `weight_layout`). Checked on the compiled
    program: no materialized instruction (outside fusions) produces a whole cache array except
    in-place dynamic-update-slice fusions, and none produces an f32 weight."""
    import jax

    # 768 slots: a cache array's size (1x768x4x32) is no weight's and no block's.
    eng = _engine(tiny_params_on, "1", cache_length=768)
    state = eng.empty_state()
    cache_sizes = {x.size for layer in state.layers for x in (layer.k, layer.v)}
    weight_sizes = {x.size for x in jax.tree.leaves(eng.params) if x.size > 1024}
    assert not cache_sizes & weight_sizes
    computations = _computations(eng.decode_program().as_text())
    roots = {
        name: next((line for line in lines if line.startswith("ROOT")), "")
        for name, lines in computations.items()
    }
    rewritten = []
    for name, lines in computations.items():
        if name.startswith(("fused_computation", "wrapped_")):
            continue  # inside a fusion: computed element by element, not materialized
        for line in lines:
            m = _INSTRUCTION.search(line)
            if m is None:
                continue
            dtype, size, op = m.group(1), _size(m.group(2)), m.group(3)
            if size in cache_sizes and op not in ("parameter", "get-tuple-element", "bitcast"):
                calls = _CALLS.search(line)
                called = roots.get(calls.group(1), "") if calls else ""
                if not (op == "fusion" and "dynamic-update-slice(" in called):
                    rewritten.append(line[:160])
            # Attention v2 widens each K/V block to f32 inside its loop (a block of the tiny
            # model, 4x256x32, has a weight's size); no weight flows into that loop.
            if size in weight_sizes and dtype == "f32" and "/attn/while/body/" not in line:
                rewritten.append(line[:160])
    assert rewritten == [], rewritten[:4]


def test_contract_last_puts_every_contracted_weight_axis_last():
    from kvgraft_jax.core import model, weight_layout

    config = model.build_model("tiny").config
    table = weight_layout.transpositions(config, weight_layout.CONTRACT_LAST)
    want = {
        "q_einsum": ((0, 2, 1), "BTD,NHD->BTNH"),
        "kv_einsum": ((0, 1, 3, 2), "BSD,CKHD->CBSKH"),
        "qkv_einsum": ((0, 1, 3, 2), "BTD,SNHD->SBTNH"),
        "attn_vec_einsum": ((2, 0, 1), "BTNH,DNH->BTD"),
        # Gemma 3's gating already contracts its last axis: read as stored, not copied.
        "gating_einsum": ((0, 1, 2), "...F,NHF->...NH"),
        "linear": ((1, 0), "...H,FH->...F"),
    }
    assert {k: (t.perm, t.equation) for k, t in table.items()} == want
    # The other gating layout is relaid.
    assert weight_layout.contract_last("...F,NFH->...NH").perm == (0, 2, 1)
    # A batch's float32 copy is laid out as its GEMMs read it: a right operand contracted axes
    # first, a left operand (the output names a weight axis first) contracted axes last, two
    # weights as XLA:CPU reads them in a bf16 chunk.
    gemm = weight_layout.transpositions(config, weight_layout.GEMM_F32)
    assert {k: (t.perm, t.equation) for k, t in gemm.items()} == {
        "q_einsum": ((1, 0, 2), "BTD,DNH->BTNH"),
        "kv_einsum": ((0, 1, 3, 2), "BSD,CKHD->CBSKH"),
        "qkv_einsum": ((0, 1, 3, 2), "BTD,SNHD->SBTNH"),
        "attn_vec_einsum": ((1, 0, 2), "BTNH,HND->BTD"),  # as the attention output is laid out
        "gating_einsum": ((2, 0, 1), "...F,FNH->...NH"),
        "linear": ((1, 0), "...H,FH->...F"),  # as a bf16 chunk's product reads it
    }


@pytest.mark.parametrize(("mesh_name", "name"), [("1", "tiny"), ("2x4", "tiny"), ("8", "tiny_mqa")])
def test_the_contract_last_weight_copy_changes_no_bit(tiny_params_on, monkeypatch, mesh_name, name):
    """The CPU engine reads a transposed copy of the layer weights for one token (12x the
    matrix-vector bandwidth) and a float32 copy for chunks of two or more (no conversion per
    call); every logit and every cache bit equals gemma's layout's, prefill chunks of 64, 8 and
    1 tokens and decode, so the layouts are not a term of the exactness contract. Should XLA
    ever sum in another order, this fails, and the layout must be recorded in
    `Engine.attention`."""
    import jax

    from kvgraft_jax.core import weight_layout

    eng = _engine(tiny_params_on, mesh_name, cache_length=300, name=name)
    if eng.mesh.shape["model"] > 1:
        # Measured to change bits with the weights split over `model` (a 2-core AVX2 host):
        # there the engine reads gemma's own layout, no copy.
        assert eng.weight_layout == eng.chunk_layout == weight_layout.GEMMA
        assert eng._program_weights.params is eng.params
        return
    assert eng.weight_layout == weight_layout.CONTRACT_LAST
    assert eng.chunk_layout == weight_layout.GEMM_F32 and not eng.batch_program
    assert eng._chunk_weights.head_bits is None  # gemma's head: the logits of the last position
    chunk_q = eng._chunk_weights.params["layer_0"]["attn"]
    chunk_q = chunk_q["qkv_einsum" if "qkv_einsum" in chunk_q else "q_einsum"]["w"]
    assert chunk_q.dtype == np.float32
    q = eng._program_weights.params["layer_0"]["attn"]
    q = q["qkv_einsum" if "qkv_einsum" in q else "q_einsum"]["w"]
    assert q.shape[-1] == eng.config.embed_dim  # contracted axis last
    again = _engine(tiny_params_on, mesh_name, cache_length=64, name=name)
    assert again._program_weights is eng._program_weights  # one copy per parameter tree
    kvstate.assert_shardings(eng.empty_state(), eng.mesh)

    def run(e):
        digests = []
        for length in (200, 129):  # chunks of 64, 64, 64, 8; then 64, 64, 1
            out = e.generate(_prompt(length=length), max_new_tokens=6, chunk_size=64)
            digests.append(bits.sha256(out.step_logits))
            digests += [bits.sha256(jax.device_get(x)) for x in jax.tree.leaves(out.state.layers)]
        return digests

    relaid = run(eng)
    monkeypatch.setattr(weight_layout, "for_mesh", lambda mesh: weight_layout.GEMMA)
    gemma_layout = _engine(tiny_params_on, mesh_name, cache_length=300, name=name)
    assert gemma_layout._program_weights.params is gemma_layout.params
    assert gemma_layout._chunk_weights.params is gemma_layout.params
    assert run(gemma_layout) == relaid


def test_chunks_read_the_float32_copy_only_where_it_fits(tiny_params_on, monkeypatch):
    """The float32 chunk copy costs the layer weights' bytes twice over: held where it fits in
    `CHUNK_COPY_MEMORY_SHARE` of memory, else chunks read the one-token layout (the same bits)."""
    from kvgraft_jax.core import model, weight_layout

    _, params = tiny_params_on("1", "tiny")
    config = model.build_model("tiny").config
    chunks = weight_layout.for_chunks(weight_layout.CONTRACT_LAST, params, config)
    assert chunks == weight_layout.GEMM_F32
    assert weight_layout.for_chunks(weight_layout.GEMMA, params, config) == weight_layout.GEMMA
    monkeypatch.setattr(weight_layout, "CHUNK_COPY_MEMORY_SHARE", 1e-9)
    layout = weight_layout.for_chunks(weight_layout.CONTRACT_LAST, params, config)
    assert layout == weight_layout.CONTRACT_LAST
