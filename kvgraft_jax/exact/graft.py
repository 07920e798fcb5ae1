"""Graft and prove it: restore an artifact into a fresh cache at its own positions, continue, compare.

    eng = engine.Engine(module, params, mesh, batch_size=1, cache_length=prefix + query + new)
    grafted = graft.graft(eng, "runs/doc", query_ids, max_new_tokens=8, expected=...)
    reference = graft.recompute(eng, grafted.links, query_ids, max_new_tokens=8)
    verdict = graft.compare(grafted.run, reference)   # bit-identical logits at every step?

The reference replays the artifact's own chunk schedule (every link's, for a prefix chain), then
the same query chunks, on the same engine (same compiled programs, same mesh): one prefill of
prefix + query is a different computation and is not the reference.

An artifact is grafted at the positions it was computed at. An engine built with a
`position_offset` grafts it elsewhere only with `allow_relocation=True`; the keys are then
re-rotated, which float RoPE makes inexact, and the result is labelled approximate and measured
(KL divergence, argmax agreement) against a recompute at the new offset.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from gemma import gm
from jax.sharding import Mesh

from kvgraft_jax.core import bits, compaction, kvstate
from kvgraft_jax.core import engine as engine_lib
from kvgraft_jax.store import chain as chain_lib
from kvgraft_jax.store import errors, writer
from kvgraft_jax.store import layout as layout_lib
from kvgraft_jax.store import manifest as manifest_lib
from kvgraft_jax.store import restore as restore_lib


class GraftError(errors.ArtifactError):
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
    prefix: Prefix
    run: Continuation
    # Wall time from the `graft` call to the first token (manifest reads and checks, restore,
    # insert, query prefill), less any compiling this call did: what a caller waits for.
    ttft_s: float = 0.0

    @property
    def manifest(self) -> manifest_lib.Manifest:
        return self.prefix.manifest

    @property
    def links(self) -> tuple[chain_lib.Link, ...]:
        return self.prefix.links

    @property
    def exact(self) -> bool:
        """False for a relocated graft: its outputs are approximate and labelled so."""
        return self.prefix.relocated_by == 0


@dataclasses.dataclass(frozen=True)
class Prefix:
    """A restored (verified) prefix chain placed in a fresh engine cache, ready for a query."""

    links: tuple[chain_lib.Link, ...]  # root first; one link unless the artifact has a parent
    # The engine's cache shape, `length` = the chain's end. None in `Grafted`: the query prefill
    # took it (donated); call `load_prefix` to keep a prefix.
    state: kvstate.KVState | None
    restore_s: float
    verify_s: float
    insert_s: float
    relocated_by: int  # 0: grafted at its own positions (exact); else shifted (approximate)

    @property
    def manifest(self) -> manifest_lib.Manifest:
        return self.links[-1].manifest

    @property
    def length(self) -> int:
        """Positions the prefix holds (all links)."""
        return self.manifest.end_position


def insert(
    segments: Sequence[kvstate.KVState],
    eng: engine_lib.Engine,
    *,
    starts: Sequence[int] = (0,),
    offsets: Sequence[Sequence[int]] | None = None,
) -> kvstate.KVState:
    """Places restored segments at their own slots (`starts`) of a fresh engine cache (zero fill).

    A single artifact has one segment at slot 0; a prefix chain has one per link, contiguous.
    `offsets[s][layer]` shifts a segment's K/V within it: a compacted artifact restored without
    expansion stores its local layers from `kept_from` on (`compaction.stored_offsets`), and they
    land there directly, the dropped slots staying the cache's zeros.
    """
    target = eng.kv_shape
    for segment in segments:
        if segment.shape.batch_size != target.batch_size:
            raise GraftError(
                f"artifact batch size {segment.shape.batch_size} differs from the engine's "
                f"{target.batch_size}"
            )
    end = starts[-1] + segments[-1].length
    if end > target.cache_length:
        raise GraftError(f"prefix of {end} positions does not fit a cache of {target.cache_length}")
    if offsets is None:
        offsets = [(0,) * target.num_layers for _ in segments]
    program = _insert_program(target, eng.mesh, tuple(starts), tuple(tuple(o) for o in offsets))
    layers = program(tuple(s.layers for s in segments))
    return kvstate.KVState(layers, end)


@functools.lru_cache(maxsize=64)
def _insert_program(
    target: kvstate.KVShape,
    mesh: Mesh,
    starts: tuple[int, ...],
    offsets: tuple[tuple[int, ...], ...],
):
    """The jitted placement of segments at `starts` in a zero cache: compiled once per layout."""
    kv = (target.batch_size, target.cache_length, target.num_kv_heads, target.head_dim)

    def place(per_segment):
        out = []
        for i in range(target.num_layers):
            k = jnp.zeros(kv, per_segment[0][i].k.dtype)
            v = jnp.zeros(kv, per_segment[0][i].v.dtype)
            positions = jnp.zeros((target.batch_size, target.cache_length), jnp.int32)
            for layers, start, shift in zip(per_segment, starts, offsets, strict=True):
                at = (0, start + shift[i], 0, 0)
                k = jax.lax.dynamic_update_slice(k, layers[i].k, at)
                v = jax.lax.dynamic_update_slice(v, layers[i].v, at)
                positions = jax.lax.dynamic_update_slice(positions, layers[i].positions, (0, start))
            out.append(kvstate.LayerKV(k, v, positions, per_segment[-1][i].end_index))
        return tuple(out)

    return jax.jit(place, out_shardings=target.shardings(mesh))


def relocate(state: kvstate.KVState, eng: engine_lib.Engine, *, by: int) -> kvstate.KVState:
    """Shifts a state `by` positions: keys re-rotated with each layer's RoPE, positions moved.

    RoPE is applied in float32 to keys stored in bf16, so rotating a stored key again is not the
    key computed at the new position: the result is an approximation, never called exact.
    """
    config = eng.config
    local = gm.nn.AttentionType.LOCAL_SLIDING
    used = jnp.arange(state.cache_length) < state.length  # bool[cache]

    def shift(layers):
        out = []
        for layer, kind in zip(layers, config.attention_types, strict=True):
            is_local = kind == local
            delta = jnp.where(used, by, 0)[None, :] * jnp.ones_like(layer.positions)
            k = gm.math.apply_rope(
                kvstate.to_values(layer.k),
                delta,
                base_frequency=config.local_base_frequency
                if is_local
                else config.global_base_frequency,
                scale_factor=config.local_scale_factor if is_local else config.global_scale_factor,
            )
            k = kvstate.to_storage(k, layer.k.dtype)
            out.append(dataclasses.replace(layer, k=k, positions=layer.positions + delta))
        return tuple(out)

    shardings = eng.kv_shape.shardings(eng.mesh)
    return kvstate.KVState(jax.jit(shift, out_shardings=shardings)(state.layers), state.length)


@dataclasses.dataclass(frozen=True)
class RestoredChain:
    """Every link of a chain restored (verified) onto an engine's mesh, compacted links still
    compact, with where `insert` places each: its first slot and per-layer offsets."""

    links: tuple[restore_lib.Restored, ...]
    starts: tuple[int, ...]
    offsets: tuple[tuple[int, ...], ...]


def restore_links(
    eng: engine_lib.Engine,
    links: Sequence[chain_lib.Link],
    *,
    expected: manifest_lib.Expected | None = None,
) -> RestoredChain:
    """Restores every link for `eng` (its cache dtype checked first); shared by a single graft
    and a batch row."""
    for link in links:
        if eng.kv_shape.dtype != link.manifest.protocol.cache_dtype:
            raise GraftError(
                f"engine cache dtype {eng.kv_shape.dtype} differs from {link.path}'s "
                f"{link.manifest.protocol.cache_dtype}"
            )
    # Compacted links stay compact until the insert writes them into the zero cache.
    restored = tuple(
        restore_lib.restore(link, eng.mesh, expected=expected, expand=False) for link in links
    )
    return RestoredChain(
        links=restored,
        starts=tuple(link.manifest.first_position for link in links),
        offsets=tuple(
            compaction.stored_offsets(r.manifest.compaction, eng.kv_shape.num_layers)
            for r in restored
        ),
    )


def load_prefix(
    eng: engine_lib.Engine,
    source: Sequence[chain_lib.Link] | str | os.PathLike,
    *,
    expected: manifest_lib.Expected | None = None,
    allow_relocation: bool = False,
) -> Prefix:
    """Resolves the artifact's chain, restores every link (verified) and inserts it into `eng`.

    The chain lands at the engine's positions: its own (exact) when `eng.position_offset` is 0,
    which every artifact chain starts at; any other offset is refused unless `allow_relocation`.
    """
    links = chain_lib.as_links(source)
    path = links[-1].path
    offset = eng.position_offset
    if offset and not allow_relocation:
        raise GraftError(
            f"{path} holds positions 0..{links[-1].manifest.last_position}; grafting it at "
            f"{offset}..{offset + links[-1].manifest.last_position} would need its keys re-rotated, "
            "and float RoPE makes that inexact. Graft it at its own positions, or pass "
            "--allow_relocation to get an approximate result labelled as such"
        )
    restored = restore_links(eng, links, expected=expected)
    started = time.perf_counter()
    state = insert(
        [r.state for r in restored.links],
        eng,
        starts=restored.starts,
        offsets=restored.offsets,
    )
    if offset:
        state = relocate(state, eng, by=offset)
    state.block_until_ready()
    insert_s = time.perf_counter() - started
    return Prefix(
        links=links,
        state=state,
        restore_s=sum(r.restore_s for r in restored.links),
        verify_s=sum(r.verify_s for r in restored.links),
        insert_s=insert_s,
        relocated_by=offset,
    )


@dataclasses.dataclass(frozen=True)
class Dropped:
    """Slots a compacted chain never stored: local layers' K/V in `ranges` (absolute slots)."""

    local_layers: tuple[int, ...] = ()
    ranges: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, links: Sequence[chain_lib.Link]) -> Dropped:
        layers, ranges = set(), []
        for link in links:
            c = link.manifest.compaction
            if c is not None and c.kept_from:
                layers |= set(c.local_layers)
                start = link.manifest.first_position
                ranges.append((start, start + c.kept_from))
        return cls(tuple(sorted(layers)), tuple(ranges))


def _root_of_used(state: kvstate.KVState, mesh: Mesh, dropped: Dropped = Dropped()) -> str:
    """The root after a query; slots a compacted prefix dropped are hashed as zeros on both sides."""
    used = writer.used_slice(state, mesh)
    if dropped.ranges:
        zeroed = _zero_dropped_program(used.shape, mesh, dropped)(used.layers)
        used = kvstate.KVState(zeroed, used.length)
    return layout_lib.digest_state(used)[1]


@functools.lru_cache(maxsize=64)
def _zero_dropped_program(shape: kvstate.KVShape, mesh: Mesh, dropped: Dropped):
    """The jitted zeroing of dropped slots, compiled once per layout (not once per graft)."""
    local = set(dropped.local_layers)

    def zero(layers):
        out = []
        for i, layer in enumerate(layers):
            if i in local:
                slots = jnp.arange(layer.k.shape[1])
                keep = jnp.ones_like(slots, dtype=bool)
                for start, stop in dropped.ranges:
                    keep &= (slots < start) | (slots >= stop)
                mask = keep[None, :, None, None]
                layer = dataclasses.replace(
                    layer,
                    k=jnp.where(mask, layer.k, jnp.zeros_like(layer.k)),
                    v=jnp.where(mask, layer.v, jnp.zeros_like(layer.v)),
                )
            out.append(layer)
        return tuple(out)

    return jax.jit(zero, out_shardings=shape.shardings(mesh))


def continue_from(
    eng: engine_lib.Engine,
    state: kvstate.KVState,
    query_ids: np.ndarray,
    *,
    chunk_size: int,
    max_new_tokens: int,
    dropped: Dropped = Dropped(),
    stop_token: int | Sequence[int] | None = None,
) -> Continuation:
    """Prefills the query after `state` (donated) and decodes greedily (until a stop token, if
    given, on every row); records the canonical root of the cache after the query."""
    query_ids = np.asarray(query_ids, np.int32)
    if query_ids.ndim == 1:
        query_ids = np.tile(query_ids[None, :], (eng.kv_shape.batch_size, 1))
    roots = []
    gen = eng.continue_from(
        state,
        query_ids,
        max_new_tokens=max_new_tokens,
        chunk_size=chunk_size,
        stop_token=stop_token,
        after_prefill=lambda prefilled: roots.append(_root_of_used(prefilled, eng.mesh, dropped)),
    )
    t = gen.timings
    return Continuation(
        token_ids=gen.token_ids,
        step_logits=gen.step_logits,
        query_schedule=gen.schedule,
        state_root_after_query=roots[0],
        query_prefill_s=t.prefill_s,
        first_token_s=t.first_token_s,
        decode_s=t.decode_s,
        decode_steps=t.decode_steps,
    )


def graft(
    eng: engine_lib.Engine,
    source: Sequence[chain_lib.Link] | str | os.PathLike,
    query_ids: np.ndarray,
    *,
    max_new_tokens: int,
    expected: manifest_lib.Expected | None = None,
    allow_relocation: bool = False,
    stop_token: int | Sequence[int] | None = None,
) -> Grafted:
    """Restore (verified) onto the engine's mesh, insert at own positions, query, decode.

    `source` is an artifact path or its resolved chain (`chain.resolve_chain`): every manifest is
    read and checked once per graft.
    """
    called = time.perf_counter()
    links = chain_lib.as_links(source)
    manifest = links[-1].manifest
    # Compile the query and decode programs first, so the timings below are the graft's own.
    query_len = np.asarray(query_ids).shape[-1]
    compile_s = eng.compile(
        engine_lib.chunk_schedule(
            query_len, manifest.protocol.chunk_size, start=manifest.end_position
        ),
        decode=True,
    )
    prefix = load_prefix(eng, links, expected=expected, allow_relocation=allow_relocation)
    before_query = time.perf_counter()
    run = continue_from(
        eng,
        prefix.state,
        query_ids,
        chunk_size=prefix.manifest.protocol.chunk_size,
        max_new_tokens=max_new_tokens,
        dropped=Dropped.of(prefix.links),
        stop_token=stop_token,
    )
    ttft_s = before_query - called - compile_s + run.first_token_s
    return Grafted(dataclasses.replace(prefix, state=None), run, ttft_s)


def replay_prefix(
    eng: engine_lib.Engine, links: Sequence[chain_lib.Link]
) -> engine_lib.PrefillResult:
    """Prefills every link's tokens on `eng` with its recorded chunk size, checking the schedule."""
    state, pre = eng.empty_state(), None
    for link in links:
        m = link.manifest
        pre = eng.prefill(
            state, np.asarray(m.token_ids, np.int32), chunk_size=m.protocol.chunk_size
        )
        replayed = [[c.start, c.length] for c in pre.schedule]
        if replayed != m.protocol.schedule:
            raise GraftError(
                f"{link.path}: replayed schedule {replayed} differs from the recorded "
                f"{m.protocol.schedule}"
            )
        state = pre.state
    return pre


def recompute(
    eng: engine_lib.Engine,
    links: Sequence[chain_lib.Link],
    query_ids: np.ndarray,
    *,
    max_new_tokens: int,
) -> Continuation:
    """Reference (a): the chain replayed with its recorded schedules on this engine, then the query.

    On an engine with a position offset this is the recompute at the new offset that a relocated
    graft is measured against.
    """
    pre = replay_prefix(eng, links)
    return continue_from(
        eng,
        pre.state,
        query_ids,
        chunk_size=links[-1].manifest.protocol.chunk_size,
        max_new_tokens=max_new_tokens,
        dropped=Dropped.of(links),
    )


def reshard(state: kvstate.KVState, eng: engine_lib.Engine) -> kvstate.KVState:
    """Moves a live state onto another engine's mesh (pure data movement), for reference (b)."""
    shardings = eng.kv_shape.shardings(eng.mesh)
    return kvstate.KVState(jax.device_put(state.layers, shardings), state.length)


def prefill_elsewhere_then_continue(
    source: engine_lib.Engine,
    target: engine_lib.Engine,
    links: Sequence[chain_lib.Link],
    query_ids: np.ndarray,
    *,
    max_new_tokens: int,
) -> Continuation:
    """Reference (b): prefill on the deposit mesh, move the live state to the target mesh, continue."""
    pre = replay_prefix(source, links)
    moved = reshard(pre.state, target)
    return continue_from(
        target,
        moved,
        query_ids,
        chunk_size=links[-1].manifest.protocol.chunk_size,
        max_new_tokens=max_new_tokens,
        dropped=Dropped.of(links),
    )


@dataclasses.dataclass(frozen=True)
class Comparison:
    bit_identical: bool
    steps: int
    first_mismatch_step: int | None
    first_mismatch_index: list[int] | None  # [batch, vocab] inside that step
    argmax_agreement: float
    max_abs_logit_diff: float
    mean_kl_divergence: (
        float  # KL(reference || grafted) of the float32 softmax, mean over rows/steps
    )
    max_kl_divergence: float
    grafted_step_sha256: list[str]
    reference_step_sha256: list[str]
    state_root_after_query: dict[str, str]


def _kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(p || q) per [step, row] from float32 logits, computed stably in float64."""
    p_log = _log_softmax(p_logits.astype(np.float64))
    q_log = _log_softmax(q_logits.astype(np.float64))
    return np.maximum(np.sum(np.exp(p_log) * (p_log - q_log), axis=-1), 0.0)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - np.max(x, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


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
    kl = _kl_divergence(r, g) if steps else np.zeros(1)
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
        mean_kl_divergence=float(np.mean(kl)),
        max_kl_divergence=float(np.max(kl)),
        grafted_step_sha256=[bits.sha256(x) for x in grafted.step_logits],
        reference_step_sha256=[bits.sha256(x) for x in reference.step_logits],
        state_root_after_query={
            "grafted": grafted.state_root_after_query,
            "reference": reference.state_root_after_query,
        },
    )
