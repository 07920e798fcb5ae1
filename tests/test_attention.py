"""Cache-length-invariant attention: the same prefix gives the same bits in any cache, blocks past
the visible ones are never read, and the math is softmax attention (gemma's, with its window)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvgraft_jax.core import attention, bits, engine, model

PREFIX = 300  # crosses a 256-slot block; the tiny model's 16-token window leaves block 0 behind


def _prompt(length=PREFIX, seed=0):
    return np.random.default_rng(seed).integers(4, 1024, size=(1, length)).astype(np.int32)


@pytest.mark.parametrize("mesh_name", ["1", "2x4"])
def test_prefix_bits_do_not_depend_on_the_cache_length(tiny_params_on, mesh_name):
    mesh, params = tiny_params_on(mesh_name)
    module = model.build_model("tiny")
    prompt = np.tile(_prompt(), (mesh.shape["data"], 1))
    seen = []
    for slots in (PREFIX, 700, 2000):
        eng = engine.Engine(module, params, mesh, batch_size=prompt.shape[0], cache_length=slots)
        assert eng.kv_shape.cache_length == attention.cache_slots(slots)
        out = eng.prefill(eng.empty_state(), prompt, chunk_size=64)
        kv = [np.asarray(getattr(layer, n))[:, :PREFIX] for layer in out.state.layers for n in "kv"]
        seen.append((eng.kv_shape.cache_length, np.asarray(out.last_logits), kv))
    assert [s[0] for s in seen] == [512, 768, 2048]
    _, logits, kv = seen[0]
    for slots, other_logits, other_kv in seen[1:]:
        assert bits.bits_equal(logits, other_logits), f"logits differ in a {slots}-slot cache"
        for a, b in zip(kv, other_kv, strict=True):
            assert bits.bits_equal(a, b), f"K/V differ in a {slots}-slot cache"


def _reference(q, k, v, mask):
    """Softmax attention in float64 with NumPy: [B,T,N,H] queries over [B,S,K,H] keys."""
    b, t, n, h = q.shape
    groups = n // k.shape[2]
    q = q.astype(np.float64).reshape(b, t, k.shape[2], groups, h)
    scores = np.einsum("btkgh,bskh->btkgs", q, k.astype(np.float64))
    scores = np.where(mask[:, :, None, None, :], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("btkgs,bskh->btkgh", weights, v.astype(np.float64)).reshape(b, t, n, h)


def _inputs(slots=768, q_len=5, first=500, window=None, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, q_len, 4, 16)).astype(np.float32)
    k = rng.standard_normal((2, slots, 2, 16)).astype(np.float32)
    v = rng.standard_normal((2, slots, 2, 16)).astype(np.float32)
    at = first + np.arange(q_len)
    cols = np.arange(slots)
    mask = cols[None, :] <= at[:, None]
    if window is not None:
        mask &= cols[None, :] > at[:, None] - window
    return q, k, v, np.broadcast_to(mask, (2, q_len, slots)).copy()


@pytest.mark.parametrize("window", [None, 40])
def test_attend_is_softmax_attention(window):
    q, k, v, mask = _inputs(window=window)
    got = np.asarray(attention.attend(*map(jnp.asarray, (q, k, v, mask))))
    # Float32 against float64: a tolerance on the math, not an exactness claim.
    np.testing.assert_allclose(got, _reference(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_blocks_no_query_sees_are_never_read():
    # Queries at 500..504 with a 40-slot window see slots 461..504: block 1 (256..511) only.
    q, k, v, mask = _inputs(window=40)
    out = attention.attend(*map(jnp.asarray, (q, k, v, mask)))
    for block in (0, 2):  # before the window and after the last used slot
        poisoned_k, poisoned_v = k.copy(), v.copy()
        span = slice(block * attention.BLOCK, (block + 1) * attention.BLOCK)
        poisoned_k[:, span] = np.nan
        poisoned_v[:, span] = np.inf
        again = attention.attend(*map(jnp.asarray, (q, poisoned_k, poisoned_v, mask)))
        assert bits.bits_equal(out, again), f"block {block} was read"


def test_a_cache_that_is_not_whole_blocks_is_refused():
    q, k, v, mask = _inputs(slots=300)
    with pytest.raises(ValueError, match="multiple of the block size"):
        attention.attend(*map(jnp.asarray, (q, k, v, mask)))


def test_cache_slots_are_whole_blocks():
    assert [attention.cache_slots(n) for n in (0, 1, 256, 257, 1000)] == [256, 256, 256, 512, 1024]
    assert str(attention.BLOCK) in attention.ATTENTION


def test_engine_runs_every_layer_through_it_and_stays_close_to_gemma(tiny_params_on):
    """Every attention layer is intercepted (the engine counts them), and the result is gemma's
    attention up to rounding: gemma scores in bf16, this in float32."""
    mesh, params = tiny_params_on("1")
    module = model.build_model("tiny")
    eng = engine.Engine(module, params, mesh, batch_size=1, cache_length=PREFIX)
    ours = eng.prefill(eng.empty_state(), _prompt(), chunk_size=64).last_logits
    slots = jnp.arange(eng.kv_shape.cache_length)

    @jax.jit
    def gemma_forward(params, tokens):
        positions = jnp.arange(PREFIX)[None, :]
        out = module.apply(
            {"params": params},
            tokens,
            positions=positions,
            cache=module.config.init_cache(
                batch_size=1, dtype=jnp.bfloat16, cache_length=eng.kv_shape.cache_length
            ),
            attention_mask=slots[None, None, :] <= positions[:, :, None],
            return_last_only=True,
        )
        return out.logits

    theirs = gemma_forward(params, jnp.asarray(_prompt()))
    ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
    assert np.argmax(ours) == np.argmax(theirs)
    assert np.max(np.abs(ours - theirs)) < 0.05 * np.max(np.abs(theirs))
