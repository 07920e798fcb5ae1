"""Ragged batches: each row grafts its own artifact at its own positions, then its own query, and
decodes; a row that finishes takes the next item of the queue (continuous batching).

    eng = batch.batch_engine(module, params, mesh, batch_size=8,
                             cache_length=batch.cache_length(items, chunk_size=512))
    run = batch.run(eng, items, batch.grafted(eng), chunk_size=512)
    single = engine.Engine(module, params, mesh, batch_size=1, cache_length=eng.kv_shape.cache_length)
    reference = batch.run(eng, items, batch.recomputed(single), chunk_size=512, plan=run.schedule)
    verdict = batch.compare(run, reference)          # every row, every step, bit-identical?

Every step is one compiled program over the whole batch (`Engine.ragged_step`): row b takes
`valid[b]` tokens at its own slots `starts[b]...`, a row still reading its query takes up to a
chunk of it, a decoding row its last token, a free row nothing. What a row's bits are depends on
the batch around it (which program ran, with which lengths), so the batch composition is the
contract: `BatchSchedule` records which item was placed in which row before which step, and every
step's lengths. The reference replays exactly that schedule, with every prefix recomputed from
its tokens by its recorded chunk schedule (on a batch-of-one engine, as it was deposited) instead
of restored, and the comparison is over the raw bits (SHA-256) of every logit row that chose a
token. Whether a row also equals the same item run alone (a batch of one row, which is
bit-identical to `graft.graft`) is measured by `--bench=batch`, not assumed: on CPU it does not.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from kvgraft_jax.core import attention as attention_lib
from kvgraft_jax.core import engine as engine_lib
from kvgraft_jax.core import kvstate, multihost, weight_layout
from kvgraft_jax.exact import graft as graft_lib
from kvgraft_jax.store import chain as chain_lib
from kvgraft_jax.store import manifest as manifest_lib


class BatchError(graft_lib.GraftError):
    """A batch that cannot run as asked (an item too long for the cache, a plan that disagrees)."""


class OtherProgramError(BatchError):
    """A recorded batch was computed by another program (attention, batch weights) than this
    build runs: its bits cannot be replayed here, so exactness is not provable (CLI: exit 3)."""


@dataclasses.dataclass(frozen=True)
class BatchItem:
    """One row's work: graft `source` (an artifact path or its resolved chain; None: no prefix, a
    fresh attempt), read `query_ids`, then decode up to `max_new_tokens` (the first included)."""

    source: Sequence[chain_lib.Link] | str | os.PathLike | None
    query_ids: np.ndarray  # int32[query]
    max_new_tokens: int
    # None: greedy (the argmax, chosen on the device). Else each token is drawn on the host from
    # the row's logits (`engine.temperature_sampler`: seeded, so a replay with a fresh sampler of
    # the same seed draws the same tokens from the same bits).
    sampler: engine_lib.Sampler | None = None


@dataclasses.dataclass(frozen=True)
class Placement:
    step: int  # the item's prefix was inserted before this step ran
    row: int
    item: int


@dataclasses.dataclass(frozen=True)
class Step:
    length: int  # tokens per row (one compiled program per length)
    starts: tuple[int, ...]  # per row, the first slot written
    valid: tuple[int, ...]  # per row, the real tokens taken (the rest is pad id 0)


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
    """The batch composition, as the reference must replay it: recorded with every batch run."""

    batch_size: int
    chunk_size: int
    weight_layout: str  # the engine's (`weight_layout`): a batch may read float32 weights
    attention: str  # the engine's attention program (`attention.ATTENTION`)
    placements: tuple[Placement, ...]
    steps: tuple[Step, ...]
    new_tokens: tuple[int, ...]  # per item, the tokens it produced (its row is freed after)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> BatchSchedule:
        try:
            return cls._from_raw(json.loads(text))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise BatchError(f"not a batch schedule: {type(e).__name__}: {e}") from e

    @classmethod
    def _from_raw(cls, raw: dict) -> BatchSchedule:
        return cls(
            batch_size=int(raw["batch_size"]),
            chunk_size=int(raw["chunk_size"]),
            weight_layout=str(raw["weight_layout"]),
            attention=str(raw.get("attention") or _unrecorded_attention(raw["weight_layout"])),
            placements=tuple(Placement(**p) for p in raw["placements"]),
            steps=tuple(
                Step(int(s["length"]), tuple(s["starts"]), tuple(s["valid"])) for s in raw["steps"]
            ),
            new_tokens=tuple(int(n) for n in raw["new_tokens"]),
        )


def _unrecorded_attention(layout: str) -> str:
    """The attention of a schedule recorded before it named one (2026-12-06): the float32 batch
    program's products were v2's already; every other program's were v1's bf16 products (the
    bf16 batch program came later and always names it)."""
    if layout == weight_layout.GEMM_F32:
        return attention_lib.ATTENTION
    return f"kvgraft-blockwise/v1/block={attention_lib.BLOCK}"


@dataclasses.dataclass(frozen=True)
class ItemResult:
    item: int
    row: int
    prefix_length: int
    token_ids: np.ndarray  # int32[new]
    logits_sha256: tuple[str, ...]  # per new token, of the bf16 logits row that chose it
    prefix_s: float  # restore + verify (grafted) or the replay (recomputed)
    first_token_s: float  # from the placement to the first token on the host
    steps: tuple[int, ...] = ()  # the steps in which its row took tokens (cost accounting)


@dataclasses.dataclass(frozen=True)
class BatchRun:
    schedule: BatchSchedule
    items: tuple[ItemResult, ...]  # in item order
    seconds: float  # the whole run, placements included, compiling excluded
    compile_s: float
    # Decode throughput: the tokens of the steps in which no row read query tokens (every row
    # decoding), over those steps' wall time. Steps shared with a refilled row's query are in
    # `seconds` only.
    decode_tokens: int
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


@dataclasses.dataclass(frozen=True)
class Segments:
    """An item's prefix as the row insert takes it: one state per link (batch 1), placed at
    `starts`, local layers of a compacted link shifted by `offsets` (`graft.insert`)."""

    states: tuple[kvstate.KVState, ...]
    starts: tuple[int, ...]
    offsets: tuple[tuple[int, ...], ...]
    length: int
    seconds: float


class PrefixSource(Protocol):
    def __call__(self, links: Sequence[chain_lib.Link]) -> Segments: ...


_NO_PREFIX = Segments(states=(), starts=(), offsets=(), length=0, seconds=0.0)


def _links(item: BatchItem) -> tuple[chain_lib.Link, ...]:
    return () if item.source is None else chain_lib.as_links(item.source)


def grafted(
    eng: engine_lib.Engine, *, expected: manifest_lib.Expected | None = None
) -> PrefixSource:
    """Prefixes restored from their artifacts (verified, compacted links kept compact)."""

    def load(links: Sequence[chain_lib.Link]) -> Segments:
        if not links:
            return _NO_PREFIX
        started = time.perf_counter()
        restored = graft_lib.restore_links(eng, links, expected=expected)
        return Segments(
            states=tuple(r.state for r in restored.links),
            starts=restored.starts,
            offsets=restored.offsets,
            length=links[-1].manifest.end_position,
            seconds=time.perf_counter() - started,
        )

    return load


def recomputed(single: engine_lib.Engine) -> PrefixSource:
    """Prefixes recomputed from their tokens with every link's recorded chunk schedule, on a
    batch-of-one engine (how they were deposited): the reference's prefixes."""
    if single.kv_shape.batch_size != 1:
        raise BatchError(f"prefixes are recomputed one at a time, not {single.kv_shape.batch_size}")

    def load(links: Sequence[chain_lib.Link]) -> Segments:
        if not links:
            return _NO_PREFIX
        started = time.perf_counter()
        pre = graft_lib.replay_prefix(single, links)
        return Segments(
            states=(pre.state,),
            starts=(0,),
            offsets=((0,) * single.kv_shape.num_layers,),
            length=pre.state.length,
            seconds=time.perf_counter() - started,
        )

    return load


def bucket(tokens: int, chunk_size: int) -> int:
    """The step length that reads `tokens` query tokens of a row: the next power of two, at most
    the chunk. Each length is a compiled program (about 3.5 s for the 270M), so remainders share
    a few lengths instead of each compiling its own; the schedule records every step's length."""
    return min(chunk_size, 1 << max(tokens - 1, 0).bit_length())


def step_length(items: Sequence[BatchItem], chunk_size: int) -> int:
    """The longest step a batch of `items` runs: a chunk of the longest query (bucketed)."""
    longest = max(len(np.asarray(i.query_ids).reshape(-1)) for i in items)
    return bucket(min(chunk_size, longest), chunk_size)


def cache_length(
    items: Sequence[BatchItem],
    chunk_size: int,
    *,
    links: Sequence[Sequence[chain_lib.Link]] | None = None,
) -> int:
    """Cache slots a batch of `items` needs: its longest prefix + query + answer, plus the pad
    slots a decoding row writes past its end while another row reads a query chunk. `links`:
    the items' resolved chains, if already read (else every manifest is read here)."""
    if links is None:
        links = [_links(item) for item in items]
    longest = max(
        (ls[-1].manifest.end_position if ls else 0)
        + len(np.asarray(i.query_ids).reshape(-1))
        + i.max_new_tokens
        for i, ls in zip(items, links, strict=True)
    )
    return longest - 1 + step_length(items, chunk_size)


def batch_engine(
    module,
    params,
    mesh: Mesh,
    *,
    batch_size: int,
    cache_length: int,
    program: str | None = None,
) -> engine_lib.Engine:
    """An engine for ragged batches: with more than one row on CPU it runs the batch program
    (`weight_layout.batch_program`: the layer weights in GEMM shapes, float32 or, on a CPU with
    bf16 dot instructions, bf16; the 270M's 4-row decode step 440 -> 113 ms in float32), with one
    row the layout a single graft reads (so a batch of one is bit-identical to `graft.graft`).

    `program`: a schedule's recorded batch program, to replay it with that one where this host
    can (the float32 program on any CPU mesh; the bf16 one where the CPU has bf16 dot
    instructions, since elsewhere XLA converts its operands and sums other bits). Otherwise the
    host's own choice, which `check_program` then refuses as another program."""
    layout = weight_layout.for_mesh(mesh, rows=batch_size)
    if layout in weight_layout.BATCH_PROGRAMS and program in _replayable_programs():
        layout = program
    return engine_lib.Engine(
        module, params, mesh, batch_size=batch_size, cache_length=cache_length, layout=layout
    )


def _replayable_programs() -> tuple[str, ...]:
    if weight_layout.cpu_has_bf16_dot():
        return weight_layout.BATCH_PROGRAMS
    return (weight_layout.GEMM_F32,)


@functools.lru_cache(maxsize=64)
def _row_insert_program(
    target: kvstate.KVShape,
    mesh: Mesh,
    starts: tuple[int, ...],
    offsets: tuple[tuple[int, ...], ...],
):
    """Clears one row of the batch cache and places a prefix's segments in it (the rest of the
    batch untouched, the cache donated): compiled once per segment layout."""
    row_kv = (1, target.cache_length, target.num_kv_heads, target.head_dim)

    def place(layers, per_segment, row, end):
        out = []
        for i, layer in enumerate(layers):
            k = jax.lax.dynamic_update_slice(
                layer.k, jnp.zeros(row_kv, layer.k.dtype), (row, 0, 0, 0)
            )
            v = jax.lax.dynamic_update_slice(
                layer.v, jnp.zeros(row_kv, layer.v.dtype), (row, 0, 0, 0)
            )
            positions = jax.lax.dynamic_update_slice(
                layer.positions, jnp.zeros((1, target.cache_length), jnp.int32), (row, 0)
            )
            for segment, start, shift in zip(per_segment, starts, offsets, strict=True):
                k = jax.lax.dynamic_update_slice(k, segment[i].k, (row, start + shift[i], 0, 0))
                v = jax.lax.dynamic_update_slice(v, segment[i].v, (row, start + shift[i], 0, 0))
                positions = jax.lax.dynamic_update_slice(
                    positions, segment[i].positions, (row, start)
                )
            end_index = jax.lax.dynamic_update_slice(layer.end_index, end[None], (row,))
            out.append(kvstate.LayerKV(k, v, positions, end_index))
        return tuple(out)

    return jax.jit(place, out_shardings=target.shardings(mesh), donate_argnums=(0,))


def insert_row(
    layers: tuple[kvstate.LayerKV, ...], segments: Segments, row: int, eng: engine_lib.Engine
) -> tuple[kvstate.LayerKV, ...]:
    """`layers` (donated) with row `row` holding exactly `segments` (zeros elsewhere in it)."""
    target = eng.kv_shape
    for state in segments.states:
        if state.shape.batch_size != 1:
            raise BatchError(f"a row takes a prefix of batch size 1, got {state.shape.batch_size}")
    if segments.length > target.cache_length:
        raise BatchError(
            f"a prefix of {segments.length} positions does not fit a cache of {target.cache_length}"
        )
    program = _row_insert_program(target, eng.mesh, segments.starts, segments.offsets)
    return program(
        layers, tuple(s.layers for s in segments.states), np.int32(row), np.int32(segments.length)
    )


@dataclasses.dataclass
class _Row:
    item: int
    query: np.ndarray
    budget: int
    end: int  # the next slot this row writes
    prefix_length: int
    prefix_s: float
    placed_at: float
    taken: int = 0  # query tokens read so far
    tokens: list[int] = dataclasses.field(default_factory=list)
    digests: list[str | None] = dataclasses.field(default_factory=list)
    steps: list[int] = dataclasses.field(default_factory=list)
    first_token_s: float = 0.0

    @property
    def reading_query(self) -> bool:
        return self.taken < len(self.query)


def _stops(stop_token: int | Collection[int] | None) -> frozenset[int]:
    if stop_token is None:
        return frozenset()
    if isinstance(stop_token, int | np.integer):
        return frozenset({int(stop_token)})
    return frozenset(int(t) for t in stop_token)


def _check_items(eng: engine_lib.Engine, items: Sequence[BatchItem]) -> list[np.ndarray]:
    queries = []
    for n, item in enumerate(items):
        query = np.asarray(item.query_ids)
        if query.ndim != 1 or query.size == 0:
            raise BatchError(
                f"item {n}: a query is one non-empty row of token ids, got {query.shape}"
            )
        if item.max_new_tokens < 1:
            raise BatchError(f"item {n}: max_new_tokens must be >= 1, got {item.max_new_tokens}")
        queries.append(engine_lib.valid_token_ids(query, eng.config.num_embed))
    return queries


def run(
    eng: engine_lib.Engine,
    items: Sequence[BatchItem],
    prefixes: PrefixSource,
    *,
    chunk_size: int,
    stop_token: int | Collection[int] | None = None,
    plan: BatchSchedule | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> BatchRun:
    """Runs `items` through the engine's batch, a free row taking the next item in order (or, with
    `plan`, exactly where and when the plan placed it, each item producing as many tokens).

    Greedy decode, or each item's own sampler; an item ends at a stop token or its
    `max_new_tokens`. Every manifest is read once, before the first step; an item too long for
    the cache is refused before any step.
    """
    if not items:
        raise BatchError("a batch needs at least one item")
    if chunk_size < 1:
        raise BatchError(f"chunk size must be >= 1, got {chunk_size}")
    batch = eng.kv_shape.batch_size
    queries = _check_items(eng, items)
    links = [_links(item) for item in items]
    needed = cache_length(items, chunk_size, links=links)
    if needed > eng.kv_shape.cache_length:
        raise BatchError(
            f"this batch needs {needed} cache slots (longest prefix + query + answer, plus "
            f"{step_length(items, chunk_size) - 1} pad slots), the engine has "
            f"{eng.kv_shape.cache_length}; size it with batch.cache_length(items, chunk_size)"
        )
    if plan is not None:
        _check_plan(plan, eng, chunk_size, len(items))
    stops = _stops(stop_token)
    compile_before = eng.compile_seconds
    for length in sorted({step_length(items, chunk_size), 1}):
        eng.ragged_program(length)

    queue = collections.deque(range(len(items)))
    planned = collections.defaultdict(list)
    if plan is not None:
        for p in plan.placements:
            planned[p.step].append(p)
    rows: list[_Row | None] = [None] * batch
    finished: dict[int, _Row] = {}
    placements: list[Placement] = []
    steps: list[Step] = []
    layers = eng.empty_state().layers
    unhashed: tuple[jax.Array, list[tuple[_Row, int, int]]] | None = None
    decode_tokens, decode_s = 0, 0.0
    started = time.perf_counter()

    def hash_logits(pending) -> None:
        logits, producers = pending
        host = multihost.host_value(logits)
        for row_state, b, k in producers:
            row_state.digests[k] = hashlib.sha256(
                np.ascontiguousarray(host[b]).tobytes()
            ).hexdigest()

    def place(b: int, n: int) -> None:
        segments = prefixes(links[n])
        nonlocal layers
        layers = insert_row(layers, segments, b, eng)
        rows[b] = _Row(
            item=n,
            query=queries[n],
            budget=items[n].max_new_tokens if plan is None else plan.new_tokens[n],
            end=segments.length,
            prefix_length=segments.length,
            prefix_s=segments.seconds,
            placed_at=time.perf_counter(),
        )
        placements.append(Placement(len(steps), b, n))

    while True:
        step = len(steps)
        if plan is None:
            for b in range(batch):
                if rows[b] is None and queue:
                    place(b, queue.popleft())
        else:
            for p in planned.pop(step, []):
                if rows[p.row] is not None:
                    raise BatchError(
                        f"the plan places item {p.item} in row {p.row} at step {step}, "
                        f"which still holds item {rows[p.row].item}"
                    )
                place(p.row, p.item)
        active = [b for b in range(batch) if rows[b] is not None]
        if not active:
            if plan is not None and planned:
                raise BatchError(f"the plan places items after step {step}, when every row is free")
            break
        reading = [rows[b].query.size - rows[b].taken for b in active if rows[b].reading_query]
        length = bucket(min(chunk_size, max(reading)), chunk_size) if reading else 1
        tokens = np.zeros((batch, length), np.int32)
        starts = np.zeros(batch, np.int32)
        valid = np.zeros(batch, np.int32)
        for b in active:
            r = rows[b]
            starts[b] = r.end
            if r.reading_query:
                part = r.query[r.taken : r.taken + length]
                tokens[b, : part.size] = part
                valid[b] = part.size
            else:
                tokens[b, 0] = r.tokens[-1]
                valid[b] = 1
        step_started = time.perf_counter()
        layers, logits, ids = eng.ragged_step(layers, tokens, starts, valid)
        if unhashed is not None:  # the host hashes the last step while the device runs this one
            hash_logits(unhashed)
        host_ids = multihost.host_value(ids)
        drawing = [
            b
            for b in active
            if items[rows[b].item].sampler is not None
            and rows[b].taken + (valid[b] if rows[b].reading_query else 0) >= rows[b].query.size
        ]
        host_logits = multihost.host_value(logits) if drawing else None
        if not reading:
            decode_s += time.perf_counter() - step_started
        steps.append(Step(length, tuple(int(s) for s in starts), tuple(int(v) for v in valid)))
        producers = []
        for b in active:
            r = rows[b]
            r.steps.append(step)
            r.end += int(valid[b])
            if r.reading_query:
                r.taken += int(valid[b])
                if r.reading_query:
                    continue
                r.first_token_s = time.perf_counter() - r.placed_at
            elif not reading:
                decode_tokens += 1
            sampler = items[r.item].sampler
            token = int(sampler(host_logits[b][None])[0]) if sampler else int(host_ids[b])
            r.tokens.append(token)
            r.digests.append(None)
            producers.append((r, b, len(r.tokens) - 1))
            if len(r.tokens) >= r.budget or (plan is None and token in stops):
                finished[r.item] = r  # its last digest is filled in below
                rows[b] = None
                if progress is not None:
                    progress(len(finished), len(items))
        unhashed = (logits, producers)
    if unhashed is not None:
        hash_logits(unhashed)
    seconds = time.perf_counter() - started
    done = tuple(
        ItemResult(
            item=n,
            row=next(p.row for p in reversed(placements) if p.item == n),
            prefix_length=finished[n].prefix_length,
            token_ids=np.asarray(finished[n].tokens, np.int32),
            logits_sha256=tuple(finished[n].digests),
            prefix_s=finished[n].prefix_s,
            first_token_s=finished[n].first_token_s,
            steps=tuple(finished[n].steps),
        )
        for n in range(len(items))
    )
    schedule = BatchSchedule(
        batch_size=batch,
        chunk_size=chunk_size,
        weight_layout=eng.weight_layout,
        attention=eng.attention,
        placements=tuple(placements),
        steps=tuple(steps),
        new_tokens=tuple(len(r.token_ids) for r in done),
    )
    if plan is not None and schedule.steps != plan.steps:
        raise BatchError("the replayed batch ran other steps than the plan records")
    return BatchRun(
        schedule=schedule,
        items=done,
        seconds=seconds,
        compile_s=eng.compile_seconds - compile_before,
        decode_tokens=decode_tokens,
        decode_s=decode_s,
    )


def check_program(plan: BatchSchedule, eng: engine_lib.Engine) -> None:
    """Refuses (`OtherProgramError`) a schedule answered by another batch program or attention
    than `eng` runs: replaying it here would compute other bits, proving nothing either way."""
    for what, recorded, here in (
        ("batch program", plan.weight_layout, eng.weight_layout),
        ("attention", plan.attention, eng.attention),
    ):
        if recorded != here:
            raise OtherProgramError(
                f"the batch was answered by the {what} {recorded!r}; {plan.batch_size} rows here "
                f"run {here!r} (another kvgraft_jax version or platform): its bits cannot be "
                "replayed here, so exactness is not provable here"
            )


def _check_plan(
    plan: BatchSchedule, eng: engine_lib.Engine, chunk_size: int, num_items: int
) -> None:
    check_program(plan, eng)
    mine = (eng.kv_shape.batch_size, chunk_size)
    theirs = (plan.batch_size, plan.chunk_size)
    if mine != theirs:
        raise BatchError(
            "the plan is for {} rows in chunks of {}; this batch has {} rows in chunks of "
            "{}".format(*theirs, *mine)
        )
    placed = sorted(p.item for p in plan.placements)
    if placed != list(range(num_items)) or len(plan.new_tokens) != num_items:
        raise BatchError(f"the plan does not place each of the {num_items} items exactly once")
    bad = [p for p in plan.placements if not (0 <= p.row < plan.batch_size and p.step >= 0)]
    if bad or min(plan.new_tokens) < 1:
        raise BatchError(f"the plan places items outside its rows or steps: {bad[:3]}")


@dataclasses.dataclass(frozen=True)
class BatchComparison:
    bit_identical: bool  # same schedule, and every item's every logits row has the same SHA-256
    items: int
    identical_items: int
    first_mismatch: tuple[int, int] | None  # (item, token index)
    argmax_agreement: float  # over every token both runs produced


def compare(run_: BatchRun, reference: BatchRun) -> BatchComparison:
    """Bit-identity of every item's every logits row (SHA-256 of the raw bf16 bits)."""
    identical, first, agree, total = 0, None, 0, 0
    for mine, theirs in zip(run_.items, reference.items, strict=True):
        same = mine.logits_sha256 == theirs.logits_sha256
        identical += same
        if not same and first is None:
            index = next(
                (
                    k
                    for k, (a, b) in enumerate(
                        zip(mine.logits_sha256, theirs.logits_sha256, strict=False)
                    )
                    if a != b
                ),
                min(len(mine.logits_sha256), len(theirs.logits_sha256)),
            )
            first = (mine.item, index)
        steps = min(len(mine.token_ids), len(theirs.token_ids))
        agree += int(np.sum(mine.token_ids[:steps] == theirs.token_ids[:steps]))
        total += max(len(mine.token_ids), len(theirs.token_ids))
    return BatchComparison(
        bit_identical=identical == len(run_.items) and run_.schedule == reference.schedule,
        items=len(run_.items),
        identical_items=identical,
        first_mismatch=first,
        argmax_agreement=agree / total if total else 1.0,
    )
