"""The deterministic engine: jit-compiled `prefill_chunk` and `decode_step` over a sharded KV cache.

Exactness depends on running the *same compiled programs* in the same order, so the engine
- compiles each program ahead of time with explicit in/out shardings and a donated cache,
- prefills in a recorded chunk schedule (a tuple of `Chunk(start, length)`), and
- refuses writes past the cache end (gemma's `dynamic_update_slice` would clamp them silently).

Grafting (a later step) is an insert of a restored prefix followed by the same programs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from gemma import gm
from jax.sharding import Mesh

from kvgraft_jax.core import attention, kvstate, multihost, sharding, weight_layout

# gemma's `Transformer.__call__` without its `nn.jit`: that jit caches traces by module config
# and shapes, so a trace made without `attention.blockwise()` (a plain `model.apply` elsewhere in
# the process) would be reused here silently, and one made with it would skip the layer count
# check. The engine jits its programs itself.
_TRANSFORMER_CALL = gm.nn.Transformer.__call__.__wrapped__

# Picks the next token of every row from that step's logits (host arrays: [batch, vocab]).
Sampler = Callable[[np.ndarray], np.ndarray]


def _stop_set(stop_token: int | Collection[int] | None) -> list[int]:
    if stop_token is None:
        return []
    if isinstance(stop_token, int | np.integer):
        return [int(stop_token)]
    return sorted(int(t) for t in stop_token)


def temperature_sampler(temperature: float, seed: int) -> Sampler:
    """Softmax sampling at `temperature` from a seeded NumPy generator (recorded, repeatable)."""
    if temperature <= 0:
        raise EngineError(f"temperature must be > 0, got {temperature}")
    rng = np.random.default_rng(seed)

    def sample(logits: np.ndarray) -> np.ndarray:
        x = logits.astype(np.float64) / temperature
        x -= x.max(axis=-1, keepdims=True)
        p = np.exp(x)
        p /= p.sum(axis=-1, keepdims=True)
        return np.array([rng.choice(p.shape[-1], p=row) for row in p], np.int32)

    return sample


class EngineError(ValueError):
    """A request the engine refuses (too long for the cache, bad token ids, ragged batch)."""


def valid_token_ids(token_ids: np.ndarray, vocab: int) -> np.ndarray:
    """`token_ids` as int32, or an `EngineError` naming the first id outside [1, vocab)."""
    token_ids = np.asarray(token_ids)
    if not np.issubdtype(token_ids.dtype, np.integer):
        raise EngineError(f"token ids must be integers, got dtype {token_ids.dtype}")
    bad = token_ids[(token_ids < 1) | (token_ids >= vocab)]
    if bad.size:
        raise EngineError(
            f"token id {int(bad[0])} is outside [1, {vocab}) for this model (0 is the pad id, "
            "which gemma treats as padding)"
        )
    return token_ids.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Chunk:
    start: int  # first cache slot (the absolute position, unless the engine has an offset)
    length: int


def chunk_schedule(num_tokens: int, chunk_size: int, *, start: int = 0) -> tuple[Chunk, ...]:
    """Fixed-size chunks from `start`; the last may be shorter. The schedule is part of the contract."""
    if chunk_size < 1:
        raise EngineError(f"chunk size must be >= 1, got {chunk_size}")
    if num_tokens < 1:
        raise EngineError("nothing to prefill: the token sequence is empty")
    return tuple(
        Chunk(start + offset, min(chunk_size, num_tokens - offset))
        for offset in range(0, num_tokens, chunk_size)
    )


@dataclasses.dataclass(frozen=True)
class PrefillResult:
    state: kvstate.KVState
    last_logits: jax.Array  # bf16[batch, vocab], logits after the last prefilled token
    schedule: tuple[Chunk, ...]
    seconds: float


@dataclasses.dataclass(frozen=True)
class Generation:
    """A greedy continuation with the logits that chose every token."""

    prompt_ids: np.ndarray  # int32[batch, prompt]
    token_ids: np.ndarray  # int32[batch, new]; token i is argmax(step_logits[i])
    step_logits: np.ndarray  # bf16[new, batch, vocab]
    schedule: tuple[Chunk, ...]
    state: kvstate.KVState
    timings: Timings


@dataclasses.dataclass(frozen=True)
class Timings:
    compile_s: float
    prefill_s: float
    first_token_s: float  # prefill start to the first new token on the host
    decode_s: float
    decode_steps: int

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")


def greedy_ids(logits: jax.Array) -> jax.Array:
    """`jnp.argmax(logits, axis=-1)` as int32: the first maximum, or the first NaN where there is
    one. As the least index holding the maximum rather than XLA's argmax reduction, which on
    CPU compares (value, index) pairs one at a time: over 8 rows of the 270M's 262,144 bf16
    logits 0.5 ms against 7.4 (`tests/test_engine.py` checks ties, NaN, signed zeros and
    infinities against `jnp.argmax`)."""
    values = weight_layout.widened(logits)  # exact; XLA:CPU's bf16 compares are slow
    vocab = values.shape[-1]
    best = jnp.max(values, axis=-1, keepdims=True)  # NaN if any value is NaN
    hit = (values == best) | jnp.isnan(values)
    index = jax.lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1)
    return jnp.min(jnp.where(hit, index, vocab), axis=-1)


class Engine:
    """One model, its sharded params, one mesh and one cache shape; programs compiled once each."""

    def __init__(
        self,
        model: gm.nn.Transformer,
        params: Any,
        mesh: Mesh,
        *,
        batch_size: int,
        cache_length: int,
        cache_dtype: str = "bfloat16",
        position_offset: int = 0,
        layout: str | None = None,
    ):
        if batch_size < 1 or cache_length < 1:
            raise EngineError(
                f"batch size and cache length must be >= 1, got {batch_size}, {cache_length}"
            )
        if position_offset < 0:
            raise EngineError(f"position offset must be >= 0, got {position_offset}")
        self.model = model
        self.config = model.config
        # Slot i of the cache holds absolute position i + position_offset. Only a relocated graft
        # (an approximate computation) uses a non-zero offset; at 0 the programs are unchanged.
        self.position_offset = position_offset
        self.params = params  # gemma's layout: what callers hand to another engine or hash
        self.mesh = mesh
        # What the compiled programs read: on CPU a contract-last copy of the layer weights
        # (`weight_layout`), made once per parameter tree; `layout` overrides the choice (a
        # batch of rows reads `weight_layout.batch_program`'s, `exact.batch.batch_engine`).
        self.weight_layout = layout or weight_layout.for_mesh(mesh)
        # A batch of rows on CPU runs a batch program (`weight_layout.BATCH_PROGRAMS`: weights
        # in GEMM shapes and the tiled head), replayed by its own reference.
        self.batch_program = self.weight_layout in weight_layout.BATCH_PROGRAMS
        self._program_weights = weight_layout.engine_params(
            params, self.config, self.weight_layout, tiled_head=self.batch_program
        )
        # Chunks of two or more tokens are matrix-matrix products, which XLA:CPU runs on float32
        # weights whatever it is handed: read a float32 copy held once instead of converting
        # every matrix on every call (`weight_layout.for_chunks`; bit-identical, tested).
        self.chunk_layout = weight_layout.for_chunks(self.weight_layout, params, self.config)
        self._chunk_weights = weight_layout.engine_params(params, self.config, self.chunk_layout)
        # Whole attention blocks: a slot's bits then depend on positions, never on the cache length.
        self.kv_shape = kvstate.KVShape(
            num_layers=self.config.num_layers,
            batch_size=batch_size,
            cache_length=attention.cache_slots(cache_length),
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=cache_dtype,
        )
        self.cache_replicated: list[sharding.Replicated] = []
        self._cache_shardings = self.kv_shape.shardings(mesh, replicated=self.cache_replicated)
        self._tokens_sharding = sharding.named_sharding(
            mesh, (sharding.BATCH, sharding.SEQ), (batch_size, 1)
        )
        self._logits_sharding = sharding.named_sharding(
            mesh, (sharding.BATCH, sharding.VOCAB), (batch_size, self.config.num_embed)
        )
        self._scalar_sharding = sharding.replicated_sharding(mesh)
        # Recorded in artifacts: part of the exactness contract. The bf16 weight layouts are
        # not: they change no bit (`weight_layout`; tests/test_engine.py proves it on every run).
        # A batch's float32 layout may, and its batch schedule records it.
        self.attention = attention.ATTENTION
        self._prefill: dict[int, Any] = {}  # chunk length -> program
        self._ragged: dict[int, Any] = {}  # tokens per row -> ragged step program
        self._decode: Any = None
        self.compile_seconds = 0.0

    # -- programs --------------------------------------------------------------------------

    def _weights(self, length: int) -> tuple[str, weight_layout.ProgramWeights]:
        """The layout and weights a single-row program of `length` tokens per row reads."""
        if length > 1 and not self.batch_program:
            return self.chunk_layout, self._chunk_weights
        return self.weight_layout, self._program_weights

    def _prefill_fn(self, params, layers, tokens, start):
        batch, length = tokens.shape
        token_slots = jnp.broadcast_to(start + jnp.arange(length, dtype=jnp.int32), (batch, length))
        positions = token_slots + self.position_offset if self.position_offset else token_slots
        slots = jnp.arange(self.kv_shape.cache_length, dtype=jnp.int32)
        mask = slots[None, None, :] <= token_slots[:, :, None]
        return self._forward(params, layers, tokens, positions, mask)

    def _ragged_fn(self, params, layers, tokens, starts, valid):
        """One step of a ragged batch: row b takes `valid[b]` real tokens (then pad id 0) at its own
        slots `starts[b]...`. gemma reads each row's logits at its last real token (its pad mask);
        a row's pad K/V land past its end, which its mask never shows and its next write replaces."""
        length = tokens.shape[1]
        token_slots = starts[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
        slots = jnp.arange(self.kv_shape.cache_length, dtype=jnp.int32)
        mask = slots[None, None, :] <= token_slots[:, :, None]
        at_starts = tuple(dataclasses.replace(layer, end_index=starts) for layer in layers)
        layers, logits = self._forward(params, at_starts, tokens, token_slots, mask, per_row=True)
        layers = tuple(dataclasses.replace(layer, end_index=starts + valid) for layer in layers)
        return layers, logits, greedy_ids(logits)

    def _forward(self, params, layers, tokens, positions, mask, *, per_row: bool = False):
        """gemma's forward pass over the cache, its attention layers made cache-length invariant."""
        layout, _ = self._weights(tokens.shape[1])
        with (
            attention.blockwise(per_row=per_row) as intercepted,
            weight_layout.einsums(self.config, layout, head_bits=params.head_bits) as relaid,
        ):
            out = self.model.apply(
                {"params": params.params},
                tokens,
                positions=positions,
                cache=kvstate.layers_to_gemma(layers),
                attention_mask=mask,
                return_last_only=True,
                method=_TRANSFORMER_CALL,
            )
        if intercepted.layers != self.config.num_layers:
            raise EngineError(
                f"{intercepted.layers} of {self.config.num_layers} attention layers ran the "
                "cache-length-invariant attention: this gemma version's attention module is not "
                "the one kvgraft_jax.core.attention replaces"
            )
        expected = weight_layout.einsums_per_layer(self.config, layout)
        if relaid.heads != (params.head_bits is not None):
            raise EngineError(
                f"the logits were computed {relaid.heads} times by the tiled head: this "
                "gemma version's `Embedder.decode` is not the one kvgraft_jax.core.weight_layout "
                "replaces"
            )
        if relaid.einsums != expected * self.config.num_layers:
            raise EngineError(
                f"{relaid.einsums} einsums read the {layout} weight copy, expected "
                f"{expected} in each of {self.config.num_layers} layers: this gemma version's "
                "einsums are not the ones kvgraft_jax.core.weight_layout relays"
            )
        return kvstate.layers_from_gemma(out.cache), out.logits

    def _decode_fn(self, params, layers, token, slot):
        batch = token.shape[0]
        position = slot + self.position_offset if self.position_offset else slot
        positions = jnp.full((batch, 1), position, dtype=jnp.int32)
        slots = jnp.arange(self.kv_shape.cache_length, dtype=jnp.int32)
        mask = jnp.broadcast_to(
            slots[None, None, :] <= slot, (batch, 1, self.kv_shape.cache_length)
        )
        layers, logits = self._forward(params, layers, token[:, None], positions, mask)
        return layers, logits, greedy_ids(logits)

    def _compile(self, fn: Callable, args: Sequence[Any], in_shardings, out_shardings, what: str):
        started = time.perf_counter()
        compiled = (
            jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=(1,))
            .lower(*args)
            .compile()
        )
        seconds = time.perf_counter() - started
        self.compile_seconds += seconds
        logging.info("compiled %s in %.2f s", what, seconds)
        return compiled

    def _abstract_params(self, length: int):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            self._weights(length)[1],
        )

    def _param_shardings(self, length: int):
        return jax.tree.map(lambda x: x.sharding, self._weights(length)[1])

    def compile(self, *schedules: Sequence[Chunk], decode: bool = False) -> float:
        """Compiles the prefill program of every chunk length in `schedules` (and the decode step
        with `decode`) ahead of a timed run; returns the seconds this call spent compiling."""
        before = self.compile_seconds
        for length in sorted({c.length for schedule in schedules for c in schedule}):
            self.prefill_program(length)
        if decode:
            self.decode_program()
        return self.compile_seconds - before

    def prefill_program(self, length: int):
        """The compiled `prefill_chunk` for chunks of `length` tokens (compiled on first use)."""
        if length not in self._prefill:
            batch = self.kv_shape.batch_size
            tokens_sharding = self._tokens_sharding
            args = (
                self._abstract_params(length),
                self.kv_shape.abstract(self.mesh),
                jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=tokens_sharding),
                jax.ShapeDtypeStruct((), jnp.int32, sharding=self._scalar_sharding),
            )
            self._prefill[length] = self._compile(
                self._prefill_fn,
                args,
                (
                    self._param_shardings(length),
                    self._cache_shardings,
                    tokens_sharding,
                    self._scalar_sharding,
                ),
                (self._cache_shardings, self._logits_sharding),
                f"prefill_chunk[{batch}x{length}]",
            )
        return self._prefill[length]

    def decode_program(self):
        """The compiled `decode_step` (one token per row, one shared position)."""
        if self._decode is None:
            batch = self.kv_shape.batch_size
            batch_sharding = sharding.named_sharding(self.mesh, (sharding.BATCH,), (batch,))
            args = (
                self._abstract_params(1),
                self.kv_shape.abstract(self.mesh),
                jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=batch_sharding),
                jax.ShapeDtypeStruct((), jnp.int32, sharding=self._scalar_sharding),
            )
            self._decode = self._compile(
                self._decode_fn,
                args,
                (
                    self._param_shardings(1),
                    self._cache_shardings,
                    batch_sharding,
                    self._scalar_sharding,
                ),
                (self._cache_shardings, self._logits_sharding, batch_sharding),
                f"decode_step[{batch}]",
            )
        return self._decode

    def ragged_program(self, length: int):
        """The compiled ragged step for `length` tokens per row (`_ragged_fn`): a batch whose rows
        sit at different positions, prefill and decode alike (compiled on first use)."""
        if self.position_offset:
            raise EngineError("a ragged batch grafts at own positions only (no position offset)")
        if length not in self._ragged:
            batch = self.kv_shape.batch_size
            rows = sharding.named_sharding(self.mesh, (sharding.BATCH,), (batch,))
            args = (
                self._abstract_params(length),
                self.kv_shape.abstract(self.mesh),
                jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=self._tokens_sharding),
                jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows),
                jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows),
            )
            self._ragged[length] = self._compile(
                self._ragged_fn,
                args,
                (
                    self._param_shardings(length),
                    self._cache_shardings,
                    self._tokens_sharding,
                    rows,
                    rows,
                ),
                (self._cache_shardings, self._logits_sharding, rows),
                f"ragged_step[{batch}x{length}]",
            )
        return self._ragged[length]

    def ragged_step(
        self,
        layers: tuple[kvstate.LayerKV, ...],
        tokens: np.ndarray,
        starts: np.ndarray,
        valid: np.ndarray,
    ) -> tuple[tuple[kvstate.LayerKV, ...], jax.Array, jax.Array]:
        """Runs `ragged_program` on host arrays (tokens int32[batch, length], 0 = pad; starts and
        valid int32[batch]); `layers` are donated. Returns the layers, logits and argmax ids."""
        batch, length = tokens.shape
        if batch != self.kv_shape.batch_size:
            raise EngineError(
                f"a ragged step of {batch} rows on an engine of {self.kv_shape.batch_size}"
            )
        if int(np.max(starts)) + length > self.kv_shape.cache_length:
            raise EngineError(
                f"a row at slot {int(np.max(starts))} taking {length} tokens needs "
                f"{int(np.max(starts)) + length} cache slots, the cache has "
                f"{self.kv_shape.cache_length} (XLA would clamp the write and corrupt the row)"
            )
        rows = sharding.named_sharding(self.mesh, (sharding.BATCH,), (batch,))
        return self.ragged_program(length)(
            self._weights(length)[1],
            layers,
            jax.device_put(np.asarray(tokens, np.int32), self._tokens_sharding),
            jax.device_put(np.asarray(starts, np.int32), rows),
            jax.device_put(np.asarray(valid, np.int32), rows),
        )

    # -- state -----------------------------------------------------------------------------

    def empty_state(self) -> kvstate.KVState:
        return kvstate.zeros(self.kv_shape, self.mesh)

    def _check_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        token_ids = np.asarray(token_ids)
        if token_ids.ndim == 1:
            token_ids = token_ids[None, :]
        if token_ids.ndim != 2 or token_ids.shape[0] != self.kv_shape.batch_size:
            raise EngineError(
                f"expected token ids of shape [batch={self.kv_shape.batch_size}, length], got "
                f"{token_ids.shape} (rows of one batch must have the same length)"
            )
        return valid_token_ids(token_ids, self.config.num_embed)

    # -- the verbs -------------------------------------------------------------------------

    def prefill(
        self,
        state: kvstate.KVState,
        token_ids: np.ndarray,
        *,
        chunk_size: int,
        progress: Callable[[int, int], None] | None = None,
    ) -> PrefillResult:
        """Appends `token_ids` at positions `state.length...` in fixed-size chunks.

        The input state is donated: do not use it afterwards.
        """
        token_ids = self._check_tokens(token_ids)
        total = token_ids.shape[1]
        end = state.length + total
        if end > self.kv_shape.cache_length:
            raise EngineError(
                f"{total} tokens after {state.length} cached need {end} cache slots, the cache has "
                f"{self.kv_shape.cache_length}; allocate a longer cache (XLA would clamp the write "
                "silently and corrupt the state)"
            )
        schedule = chunk_schedule(total, chunk_size, start=state.length)
        self.compile(schedule)
        started = time.perf_counter()
        layers, logits = state.layers, None
        for i, chunk in enumerate(schedule):
            offset = chunk.start - state.length
            tokens = jax.device_put(
                token_ids[:, offset : offset + chunk.length],
                self._tokens_sharding,
            )
            start = jax.device_put(np.int32(chunk.start), self._scalar_sharding)
            layers, logits = self._prefill[chunk.length](
                self._weights(chunk.length)[1], layers, tokens, start
            )
            if progress is not None:
                jax.block_until_ready(logits)
                progress(i + 1, len(schedule))
        jax.block_until_ready(logits)
        seconds = time.perf_counter() - started
        return PrefillResult(kvstate.KVState(layers, end), logits, schedule, seconds)

    def decode(
        self,
        state: kvstate.KVState,
        first_token: np.ndarray,
        *,
        steps: int,
        stop_token: int | Collection[int] | None = None,
        sampler: Sampler | None = None,
    ) -> tuple[kvstate.KVState, list[np.ndarray], list[jax.Array], float]:
        """Decode: writes `first_token` at `state.length` and continues for `steps` steps.

        Greedy unless a `sampler` picks each next token from the step's logits (on the host).
        Returns the state, the tokens chosen (one array per step), each step's logits and seconds.
        Stops early once every row has produced a stop token.
        """
        stops = _stop_set(stop_token)
        if state.length + steps > self.kv_shape.cache_length:
            raise EngineError(
                f"decoding {steps} steps after {state.length} cached positions needs "
                f"{state.length + steps} cache slots, the cache has {self.kv_shape.cache_length}"
            )
        program = self.decode_program()
        batch_sharding = sharding.named_sharding(
            self.mesh, (sharding.BATCH,), (self.kv_shape.batch_size,)
        )
        token = jax.device_put(np.asarray(first_token, np.int32), batch_sharding)
        layers, length = state.layers, state.length
        tokens, logits_out = [], []
        done = np.isin(np.asarray(first_token), stops)
        started = time.perf_counter()
        for _ in range(steps):
            if stops and done.all():
                break
            position = jax.device_put(np.int32(length), self._scalar_sharding)
            layers, logits, token = program(self._program_weights, layers, token, position)
            length += 1
            if sampler is None:
                host_token = multihost.host_value(token)
            else:
                host_token = np.asarray(sampler(multihost.host_value(logits)), np.int32)
                token = jax.device_put(host_token, batch_sharding)
            tokens.append(host_token)
            logits_out.append(logits)
            done |= np.isin(host_token, stops)
        jax.block_until_ready(layers)
        return kvstate.KVState(layers, length), tokens, logits_out, time.perf_counter() - started

    def generate(
        self, prompt_ids: np.ndarray, *, max_new_tokens: int, chunk_size: int, **options: Any
    ) -> Generation:
        """A fresh cache, then `continue_from` it (`options`: its `stop_token`, `progress` and
        `sampler`); the programs are compiled first, outside the timings."""
        prompt_ids = self._check_tokens(prompt_ids)
        compile_s = self.compile(chunk_schedule(prompt_ids.shape[1], chunk_size), decode=True)
        gen = self.continue_from(
            self.empty_state(),
            prompt_ids,
            max_new_tokens=max_new_tokens,
            chunk_size=chunk_size,
            **options,
        )
        return dataclasses.replace(
            gen, timings=dataclasses.replace(gen.timings, compile_s=compile_s)
        )

    def continue_from(
        self,
        state: kvstate.KVState,
        token_ids: np.ndarray,
        *,
        max_new_tokens: int,
        chunk_size: int,
        stop_token: int | Collection[int] | None = None,
        progress: Callable[[int, int], None] | None = None,
        sampler: Sampler | None = None,
        after_prefill: Callable[[kvstate.KVState], None] | None = None,
    ) -> Generation:
        """Prefills `token_ids` after `state` (donated) in chunks, then decodes `max_new_tokens`
        (greedy unless a `sampler` is given; until `stop_token` on every row). `after_prefill`
        sees the cache once the tokens are in, before a decode step writes to it."""
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        token_ids = self._check_tokens(token_ids)
        needed = state.length + token_ids.shape[1] + max_new_tokens
        if needed > self.kv_shape.cache_length:
            raise EngineError(
                f"{state.length} cached + {token_ids.shape[1]} prefilled + {max_new_tokens} new "
                f"tokens = {needed} exceeds the cache length {self.kv_shape.cache_length}"
            )
        started = time.perf_counter()
        pre = self.prefill(state, token_ids, chunk_size=chunk_size, progress=progress)
        last_logits = multihost.host_value(pre.last_logits)
        if sampler is None:
            # On the host: an argmax outside a program is an op of its own that XLA compiles on
            # first use (42 ms for the 270M's vocabulary; 0.7 ms here). The same first maximum.
            first = np.argmax(last_logits.astype(np.float32), axis=-1).astype(np.int32)
        else:
            first = np.asarray(sampler(last_logits), np.int32)
        first_token_s = time.perf_counter() - started
        if after_prefill is not None:
            after_prefill(pre.state)
        state, tokens, logits, decode_s = self.decode(
            pre.state, first, steps=max_new_tokens - 1, stop_token=stop_token, sampler=sampler
        )
        # The last decode step's token has no slot written yet; the state holds every token before it.
        return Generation(
            prompt_ids=token_ids,
            token_ids=np.stack([first, *tokens], axis=1),
            step_logits=np.stack([last_logits, *(multihost.host_value(x) for x in logits)]),
            schedule=pre.schedule,
            state=state,
            timings=Timings(
                compile_s=0.0,
                prefill_s=pre.seconds,
                first_token_s=first_token_s,
                decode_s=decode_s,
                decode_steps=len(tokens),
            ),
        )
