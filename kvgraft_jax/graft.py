"""Graft and prove it: restore an artifact into a fresh cache at its own positions, continue, compare.

    eng = engine.Engine(module, params, mesh, batch_size=1, cache_length=prefix + query + new)
    grafted = graft.graft(eng, "runs/doc", query_ids, max_new_tokens=8, expected=...)
    reference = graft.recompute(eng, grafted.manifest, query_ids, max_new_tokens=8)
    verdict = graft.compare(grafted.run, reference)   # bit-identical logits at every step?

The reference replays the artifact's own chunk schedule, then the same query chunks, on the same
engine (same compiled programs, same mesh): one prefill of prefix + query is a different
computation and is not the reference.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from kvgraft_jax import artifact, bits, kvstate
from kvgraft_jax import engine as engine_lib


class GraftError(artifact.ArtifactError):
    """The artifact cannot be grafted into this engine (positions, batch, cache size)."""


@dataclasses.dataclass(frozen=True)
class Continuation:
    """Query prefill and greedy decode after a prefix, with everything a comparison needs."""

    token_ids: np.ndarray  # int32[batch, new]
    step_logits: np.ndarray  # bf16[new, batch, vocab]
    query_schedule: tuple[engine_lib.Chunk, ...]
    state_root_after_query: str  # canonical root of the cache after the query (used length)
    query_prefill_s: float
    first_token_s: float
    decode_s: float
    decode_steps: int


@dataclasses.dataclass(frozen=True)
class Grafted:
    manifest: artifact.Manifest
    run: Continuation
    restore_s: float
    verify_s: float
    insert_s: float


def insert(state: kvstate.KVState, eng: engine_lib.Engine) -> kvstate.KVState:
    """Places a restored prefix at its own positions (slots 0..length-1) of a fresh engine cache."""
    target = eng.kv_shape
    if state.shape.batch_size != target.batch_size:
        raise GraftError(
            f"artifact batch size {state.shape.batch_size} differs from the engine's {target.batch_size}"
        )
    if state.length > target.cache_length:
        raise GraftError(f"prefix of {state.length} does not fit a cache of {target.cache_length}")
    shardings = target.shardings(eng.mesh)

    def place(layers):
        out = []
        for layer in layers:
            fresh = {
                "k": jnp.zeros(
                    (target.batch_size, target.cache_length, target.num_kv_heads, target.head_dim),
                    layer.k.dtype,
                ),
                "v": jnp.zeros(
                    (target.batch_size, target.cache_length, target.num_kv_heads, target.head_dim),
                    layer.v.dtype,
                ),
                "positions": jnp.zeros((target.batch_size, target.cache_length), jnp.int32),
            }
            out.append(
                kvstate.LayerKV(
                    k=jax.lax.dynamic_update_slice(fresh["k"], layer.k, (0, 0, 0, 0)),
                    v=jax.lax.dynamic_update_slice(fresh["v"], layer.v, (0, 0, 0, 0)),
                    positions=jax.lax.dynamic_update_slice(
                        fresh["positions"], layer.positions, (0, 0)
                    ),
                    end_index=layer.end_index,
                )
            )
        return tuple(out)

    return kvstate.KVState(jax.jit(place, out_shardings=shardings)(state.layers), state.length)


def _root_of_used(state: kvstate.KVState, mesh: Mesh) -> str:
    return artifact.digest_state(artifact.used_slice(state, mesh))[1]


def continue_from(
    eng: engine_lib.Engine,
    state: kvstate.KVState,
    query_ids: np.ndarray,
    *,
    chunk_size: int,
    max_new_tokens: int,
) -> Continuation:
    """Prefills the query after `state` (donated) and decodes greedily."""
    query_ids = np.asarray(query_ids, np.int32)
    if query_ids.ndim == 1:
        query_ids = np.tile(query_ids[None, :], (eng.kv_shape.batch_size, 1))
    needed = state.length + query_ids.shape[1] + max_new_tokens
    if needed > eng.kv_shape.cache_length:
        raise engine_lib.EngineError(
            f"prefix {state.length} + query {query_ids.shape[1]} + new {max_new_tokens} = {needed} "
            f"exceeds the cache length {eng.kv_shape.cache_length}"
        )
    started = time.perf_counter()
    pre = eng.prefill(state, query_ids, chunk_size=chunk_size)
    first = np.asarray(jnp.argmax(pre.last_logits, axis=-1)).astype(np.int32)
    first_token_s = time.perf_counter() - started
    root = _root_of_used(pre.state, eng.mesh)
    _, tokens, logits, decode_s = eng.decode(pre.state, first, steps=max_new_tokens - 1)
    return Continuation(
        token_ids=np.stack([first, *tokens], axis=1),
        step_logits=np.stack([np.asarray(x) for x in (pre.last_logits, *logits)]),
        query_schedule=pre.schedule,
        state_root_after_query=root,
        query_prefill_s=pre.seconds,
        first_token_s=first_token_s,
        decode_s=decode_s,
        decode_steps=len(tokens),
    )


def graft(
    eng: engine_lib.Engine,
    path,
    query_ids: np.ndarray,
    *,
    max_new_tokens: int,
    expected: artifact.Expected | None = None,
) -> Grafted:
    """Restore (verified) onto the engine's mesh, insert at own positions, query, decode."""
    restored = artifact.restore(path, eng.mesh, expected=expected)
    manifest = restored.manifest
    if manifest.first_position != 0:
        raise GraftError(
            f"{path} starts at position {manifest.first_position}; it can only be grafted on top of "
            "its parent at its own positions (RoPE is applied to the stored keys)"
        )
    if eng.kv_shape.dtype != manifest.protocol.cache_dtype:
        raise GraftError(
            f"engine cache dtype {eng.kv_shape.dtype} differs from the artifact's "
            f"{manifest.protocol.cache_dtype}"
        )
    # Compile the query and decode programs first, so the timings below are the graft's own.
    query_len = np.asarray(query_ids).shape[-1]
    for length in {
        c.length
        for c in engine_lib.chunk_schedule(
            query_len, manifest.protocol.chunk_size, start=manifest.length
        )
    }:
        eng.prefill_program(length)
    eng.decode_program()
    started = time.perf_counter()
    state = insert(restored.state, eng).block_until_ready()
    insert_s = time.perf_counter() - started
    run = continue_from(
        eng,
        state,
        query_ids,
        chunk_size=manifest.protocol.chunk_size,
        max_new_tokens=max_new_tokens,
    )
    return Grafted(manifest, run, restored.restore_s, restored.verify_s, insert_s)


def recompute(
    eng: engine_lib.Engine,
    manifest: artifact.Manifest,
    query_ids: np.ndarray,
    *,
    max_new_tokens: int,
) -> Continuation:
    """Reference (a): the prefix replayed with the artifact's schedule on this engine, then the query."""
    prefix = np.asarray(manifest.token_ids, np.int32)
    pre = eng.prefill(eng.empty_state(), prefix, chunk_size=manifest.protocol.chunk_size)
    replayed = [[c.start, c.length] for c in pre.schedule]
    if replayed != manifest.protocol.schedule:
        raise GraftError(
            f"replayed schedule {replayed} differs from the recorded {manifest.protocol.schedule}"
        )
    return continue_from(
        eng,
        pre.state,
        query_ids,
        chunk_size=manifest.protocol.chunk_size,
        max_new_tokens=max_new_tokens,
    )


def reshard(state: kvstate.KVState, eng: engine_lib.Engine) -> kvstate.KVState:
    """Moves a live state onto another engine's mesh (pure data movement), for reference (b)."""
    shardings = eng.kv_shape.shardings(eng.mesh)
    return kvstate.KVState(jax.device_put(state.layers, shardings), state.length)


def prefill_elsewhere_then_continue(
    source: engine_lib.Engine,
    target: engine_lib.Engine,
    manifest: artifact.Manifest,
    query_ids: np.ndarray,
    *,
    max_new_tokens: int,
) -> Continuation:
    """Reference (b): prefill on the deposit mesh, move the live state to the target mesh, continue."""
    prefix = np.asarray(manifest.token_ids, np.int32)
    pre = source.prefill(source.empty_state(), prefix, chunk_size=manifest.protocol.chunk_size)
    moved = reshard(pre.state, target)
    return continue_from(
        target,
        moved,
        query_ids,
        chunk_size=manifest.protocol.chunk_size,
        max_new_tokens=max_new_tokens,
    )


@dataclasses.dataclass(frozen=True)
class Comparison:
    bit_identical: bool
    steps: int
    first_mismatch_step: int | None
    first_mismatch_index: list[int] | None  # [batch, vocab] inside that step
    argmax_agreement: float
    max_abs_logit_diff: float
    grafted_step_sha256: list[str]
    reference_step_sha256: list[str]
    state_root_after_query: dict[str, str]


def compare(grafted: Continuation, reference: Continuation) -> Comparison:
    steps = min(len(grafted.step_logits), len(reference.step_logits))
    first_step, first_index = None, None
    for i in range(steps):
        where = bits.first_mismatch(grafted.step_logits[i], reference.step_logits[i])
        if where is not None:
            first_step, first_index = i, list(where)
            break
    g = grafted.step_logits[:steps].astype(np.float32)
    r = reference.step_logits[:steps].astype(np.float32)
    agreement = float(np.mean(np.argmax(g, -1) == np.argmax(r, -1))) if steps else 1.0
    identical = (
        first_step is None
        and len(grafted.step_logits) == len(reference.step_logits)
        and grafted.state_root_after_query == reference.state_root_after_query
    )
    return Comparison(
        bit_identical=identical,
        steps=steps,
        first_mismatch_step=first_step,
        first_mismatch_index=first_index,
        argmax_agreement=agreement,
        max_abs_logit_diff=float(np.max(np.abs(g - r))) if steps else 0.0,
        grafted_step_sha256=[bits.sha256(x) for x in grafted.step_logits],
        reference_step_sha256=[bits.sha256(x) for x in reference.step_logits],
        state_root_after_query={
            "grafted": grafted.state_root_after_query,
            "reference": reference.state_root_after_query,
        },
    )
