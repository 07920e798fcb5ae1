"""The verified-knowledge flywheel: seed a library from known solutions, then solve problems by
routing each to one artifact (graft it, decode a short answer) or, on a miss, by spending effort
(several generations, verified externally) and depositing the first verified solution.

    seeded = flywheel.seed_library(ctx, records, settings)   # verify known solutions, deposit
    result = flywheel.solve(ctx, problems, settings, "runs/problems.jsonl")   # pass 1, 2, ...

Everything a pass costs is counted: decode and prefill tokens, prefill tokens avoided by a graft,
FLOPs from XLA's cost analysis, and energy estimates under stated assumptions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging

from kvgraft_jax.core import attention
from kvgraft_jax.core import engine as engine_lib
from kvgraft_jax.core import model as model_lib
from kvgraft_jax.core import progress as progress_lib
from kvgraft_jax.exact import batch as batch_lib
from kvgraft_jax.exact import graft
from kvgraft_jax.library import accounting, catalog, dataset, library, verifiers
from kvgraft_jax.run.config import default
from kvgraft_jax.store import errors
from kvgraft_jax.store import manifest as manifest_lib

# Worked examples prefilled before a problem being solved: reasoning first, then the answer line.
SOLVE_EXAMPLES = (
    "Problem: What is 12 + 30?\nSolution: 12 + 30 = 42.\nAnswer: 42\n"
    "Problem: The secret word is plum. What is the secret word?\n"
    "Solution: The problem states the secret word: plum.\nAnswer: plum\n"
)


def solve_prompt(problem: str) -> str:
    return f"{SOLVE_EXAMPLES}Problem: {problem.strip()}\nSolution:"


def hit_query(problem: str) -> str:
    """What follows a grafted item: the problem asked again; the answer is a short continuation."""
    return f"Problem: {problem.strip()}\nAnswer:"


@dataclasses.dataclass(frozen=True)
class Settings:
    """The flywheel's settings: the solve and deposit fields of a `RunConfig`, with its defaults."""

    attempts: int = default("attempts")  # generations per missed problem: greedy, then sampled
    solve_tokens: int = default("solve_tokens")  # token budget of one attempt
    answer_tokens: int = default("answer_tokens")  # decode budget of an answer from a graft
    temperature: float = default("temperature")
    seed: int = default("seed")
    route_threshold: float = default("route_threshold")
    chunk_size: int = default("chunk_size")
    compact: bool = default("compact")
    chapter_items: int = default("chapter_items")  # verified items per artifact when seeding
    allow_unsandboxed_programs: bool = default("allow_unsandboxed_programs")
    passes: int = default("passes")
    batch_size: int = default("batch_size")  # routed problems answered together from grafts
    energy: accounting.EnergyAssumptions = dataclasses.field(
        default_factory=lambda: accounting.EnergyAssumptions(
            default("joules_per_flop"), default("device_watts")
        )
    )


@dataclasses.dataclass
class Context:
    """The live objects a flywheel run needs: model, tokenizer, mesh, library, engines."""

    module: Any
    params: Any
    mesh: Any
    tok: Any
    model: model_lib.ModelInfo
    model_name: str
    versions: dict[str, str]
    library: library.Library
    context_window: int | None = None
    _engines: dict[int, engine_lib.Engine] = dataclasses.field(default_factory=dict)
    _batch_engines: dict[tuple[int, int], engine_lib.Engine] = dataclasses.field(
        default_factory=dict
    )
    flops: accounting.FlopCounter = dataclasses.field(default_factory=accounting.FlopCounter)

    def engine(self, slots: int) -> engine_lib.Engine:
        """An engine with at least `slots` cache slots; lengths are whole attention blocks, so
        programs compile once per block count, not once per problem."""
        length = attention.cache_slots(slots)
        if length not in self._engines:
            self._engines[length] = engine_lib.Engine(
                self.module, self.params, self.mesh, batch_size=1, cache_length=length
            )
        return self._engines[length]

    def batch_engine(self, rows: int, slots: int) -> engine_lib.Engine:
        """A ragged-batch engine of `rows` rows and at least `slots` slots (whole blocks)."""
        length = attention.cache_slots(slots)
        key = (rows, length)
        if key not in self._batch_engines:
            self._batch_engines[key] = batch_lib.batch_engine(
                self.module, self.params, self.mesh, batch_size=rows, cache_length=length
            )
        return self._batch_engines[key]

    def compile_seconds(self) -> float:
        """XLA compile time spent so far by this context's engines (kept out of wall and energy)."""
        engines = [*self._engines.values(), *self._batch_engines.values()]
        return sum(e.compile_seconds for e in engines)

    def expected(self) -> manifest_lib.Expected:
        return manifest_lib.Expected.of(
            self.model, self.tok.info(), trusted_keys=self.library.trusted_keys
        )

    def stop_tokens(self) -> list[int]:
        """EOS, and the newline when the tokenizer has it as one token (answers are one line)."""
        stops = [self.tok.eos_id]
        newline = self.tok.encode("\n", add_bos=False)
        if len(newline) == 1:
            stops.append(newline[0])
        return stops


def _verify_record(record: dataset.Record, settings: Settings) -> verifiers.Verdict:
    """A known solution's program output (when it has a program) or its stated answer must match."""
    if record.program:
        return verifiers.run_program(
            record.program, record.answer, allow_unsandboxed=settings.allow_unsandboxed_programs
        )
    return verifiers.check_answer(record.solution, record.answer)


@dataclasses.dataclass(frozen=True)
class SeedReport:
    records: int
    accepted: list[str]
    rejected: dict[str, str]  # id -> reason
    duplicates: list[str]  # already in the library
    artifacts: list[str]  # roots deposited
    tokens: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def seed_library(
    ctx: Context, records: Sequence[dataset.Record], settings: Settings, *, progress: bool = True
) -> SeedReport:
    """Verifies every record's known solution and deposits what passes (chapters of
    `settings.chapter_items`); every rejection is logged and kept in the catalog."""
    started = time.perf_counter()
    accepted, rejected, duplicates, roots, tokens = [], {}, [], [], 0
    pending: list[library.VerifiedItem] = []

    def flush():
        nonlocal tokens
        if not pending:
            return
        outcome = ctx.library.deposit(
            ctx.engine,
            ctx.tok,
            pending,
            model=ctx.model,
            versions=ctx.versions,
            chunk_size=settings.chunk_size,
            compact=settings.compact,
            source="dataset",
        )
        accepted.extend(outcome.added)
        duplicates.extend(outcome.duplicates)
        if outcome.root:
            roots.append(outcome.root)
        tokens += outcome.tokens
        pending.clear()

    for record in progress_lib.bar(records, desc="seed", unit="record", enabled=progress):
        verdict = _verify_record(record, settings)
        if not verdict.ok:
            rejected[record.id] = f"{verdict.verifier}: {verdict.reason}"
            ctx.library.reject(record.id, record.problem, verdict, "dataset")
            continue
        text = library.item_text(record.problem, record.solution, record.answer)
        pending.append(
            library.VerifiedItem(record.id, record.problem, record.answer, text, verdict)
        )
        if len(pending) >= settings.chapter_items:
            flush()
    flush()
    return SeedReport(
        len(records), accepted, rejected, duplicates, roots, tokens, time.perf_counter() - started
    )


# -------------------------------------------------------------------------------------------
# Solving


@dataclasses.dataclass(frozen=True)
class Attempt:
    index: int
    sampling: str  # "greedy" or "temperature=T seed=S"
    decode_tokens: int
    prefill_tokens: int
    answer: str
    verified: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class ProblemResult:
    """One problem in one pass: a line of problems.jsonl."""

    id: str
    pass_: int
    hit: bool
    wrong_route: bool  # the hit's answer failed verification: attempted instead, route barred
    quarantined: str  # why the routed artifact was quarantined ("" if it was not)
    route: str  # "exact", "search" or "miss"
    route_score: float
    root: str | None  # the artifact grafted (hit) or deposited (miss solved)
    matched_item: str | None
    correct: bool
    answer: str
    expected: str
    attempts: list[Attempt]
    deposited: bool
    decode_tokens: int
    prefill_tokens: int
    prefill_tokens_avoided: int
    restore_ms: float
    wall_ms: float  # XLA compilation excluded (compile_ms)
    compile_ms: float
    # `--batch_size` it was solved with (1: alone); in a batch, its wall and compile times
    # include its even share of the batch's routing and grafted answers.
    batch_rows: int
    graft_correct: bool  # a hit whose grafted answer verified
    greedy_correct: bool  # attempted, and the greedy attempt verified
    # Estimates (XLA cost analysis; energy under the run's stated assumptions), named so.
    flops_estimate: float
    prefill_flops_avoided_estimate: float
    energy_from_flops_j_estimate: float
    energy_from_wall_j_estimate: float

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["pass"] = out.pop("pass_")
        return out


def _seed_of(base: int, problem_id: str, pass_: int, attempt: int) -> int:
    """A sampling seed per (run seed, problem, pass, attempt): recorded, and fresh in each pass, so
    a later pass spends new effort on what is still unsolved."""
    digest = hashlib.sha256(f"{base}:{problem_id}:{pass_}:{attempt}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def _answer_hit(ctx: Context, record, match: catalog.Match, settings: Settings):
    # The row's root is pinned: a 64-hex name, a chain inside the library, the same root restored.
    links = ctx.library.chain(match.item.root)
    path, manifest = links[-1].path, links[-1].manifest
    query = ctx.tok.encode(hit_query(record.problem), add_bos=False)
    eng = ctx.engine(manifest.end_position + len(query) + settings.answer_tokens)
    grafted = graft.graft(
        eng,
        path,
        np.asarray([query], np.int32),
        max_new_tokens=settings.answer_tokens,
        expected=ctx.expected(),
        stop_token=ctx.stop_tokens(),
    )
    prefix = grafted.prefix
    return _hit_outcome(
        ctx,
        record,
        manifest,
        query,
        [int(t) for t in grafted.run.token_ids[0]],
        grafted.run.query_schedule,
        (prefix.restore_s + prefix.verify_s + prefix.insert_s) * 1e3,
    )


def _hit_outcome(
    ctx: Context, record, manifest, query, token_ids, schedule, restore_ms, batch_flops=None
):
    """A grafted answer checked by the problem's verifier, with its cost estimates: from the
    single-row programs (`schedule`: its query's chunks), or in a batch from the programs that
    ran (`batch_flops`: its share of its steps, `accounting.FlopCounter.batch_items`), where a
    prefill token is estimated at the row's mean cost per token."""
    tokens = _until_stop(token_ids, ctx.stop_tokens())
    text = ctx.tok.decode(tokens)
    integer = verifiers.is_integer_answer(record.answer)
    candidate = verifiers.extract_answer(_first_line(text), integer=integer)
    verdict = verifiers.check_answer(candidate, record.answer)
    if batch_flops is None:
        eng = ctx.engine(manifest.end_position + len(query) + len(token_ids))  # one row's cost
        flops = ctx.flops.prefill(eng, schedule) + ctx.flops.decode(eng, len(tokens) - 1)
        per_token = ctx.flops.per_prefill_token(eng, schedule)
    else:
        flops, per_token = batch_flops, batch_flops / (len(query) + len(token_ids))
    avoided = manifest.end_position * per_token
    return {
        "correct": verdict.ok,
        "answer": candidate,
        "decode_tokens": len(tokens),
        "prefill_tokens": len(query),
        "prefill_tokens_avoided": manifest.end_position,
        "restore_ms": restore_ms,
        "flops": flops,
        "prefill_flops_avoided": avoided,
    }


def _rows(settings: Settings, items: int) -> int:
    """Rows for a batch of `items`: the fewest powers of two that hold them, at most
    `settings.batch_size`. A step costs its rows whether they work or not (the 270M's 8-row step
    163 ms, one row 45), so two misses do not run in eight rows; one runs alone, on the single
    graft's bf16 weights."""
    return min(settings.batch_size, 1 << max(items - 1, 0).bit_length())


class _RefusedItem(Exception):
    """A batch row's artifact was refused at its restore: which row, and why."""

    def __init__(self, index: int, cause: Exception):
        super().__init__(str(cause))
        self.index, self.cause = index, cause


def _answer_hits(
    ctx: Context,
    records: Sequence[dataset.Record],
    matches: Sequence[catalog.Match],
    settings: Settings,
) -> list[dict[str, Any] | Exception]:
    """The routed problems' grafted answers from one ragged batch (`exact.batch`): each row its
    own artifact, query and stop; per problem its outcome, or the refusal of its artifact (which
    leaves the other rows to a new batch without it)."""
    outcomes: dict[int, dict[str, Any] | Exception] = {}
    chains = {}
    for i, match in enumerate(matches):
        try:
            chains[i] = ctx.library.chain(match.item.root)
        except (errors.ArtifactError, library.LibraryError) as e:
            outcomes[i] = e
    queries = {i: ctx.tok.encode(hit_query(records[i].problem), add_bos=False) for i in chains}
    pending = sorted(chains)
    while pending:
        items = [
            batch_lib.BatchItem(chains[i], np.asarray(queries[i], np.int32), settings.answer_tokens)
            for i in pending
        ]
        slots = batch_lib.cache_length(
            items, settings.chunk_size, links=[chains[i] for i in pending]
        )
        eng = ctx.batch_engine(_rows(settings, len(items)), slots)
        grafted = batch_lib.grafted(eng, expected=ctx.expected())

        def restore(links, pending=pending, grafted=grafted):
            try:
                return grafted(links)
            except (errors.ArtifactError, library.LibraryError) as e:
                # The first waiting row on this artifact (rows sharing it all fail in turn).
                row = next(i for i in pending if chains[i][-1].path == links[-1].path)
                raise _RefusedItem(row, e) from e

        try:
            run = batch_lib.run(
                eng, items, restore, chunk_size=settings.chunk_size, stop_token=ctx.stop_tokens()
            )
        except _RefusedItem as refused:
            outcomes[refused.index] = refused.cause
            pending = [i for i in pending if i != refused.index]
            continue
        costs = ctx.flops.batch_items(eng, run)
        for i, result, cost in zip(pending, run.items, costs, strict=True):
            outcomes[i] = _hit_outcome(
                ctx,
                records[i],
                chains[i][-1].manifest,
                queries[i],
                [int(t) for t in result.token_ids],
                None,
                result.prefix_s * 1e3,
                batch_flops=cost,
            )
        break
    return [outcomes[i] for i in range(len(matches))]


def _until_stop(tokens: list[int], stops: Sequence[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


def _solution_text(generated: str) -> str:
    """The generated solution with its answer line (the model tends to start another problem)."""
    return generated.split("Problem:")[0].strip()


def _reasoning(solution: str) -> str:
    """The solution without its answer line(s): the item states the verified answer itself."""
    kept = [line for line in solution.splitlines() if not line.strip().lower().startswith("answer")]
    return "\n".join(kept).strip() or solution.strip()


def _sampling(record, index: int, settings: Settings, pass_: int):
    """Attempt `index`'s sampler (None: greedy, the first) and its description."""
    if index == 0:
        return None, "greedy"
    seed = _seed_of(settings.seed, record.id, pass_, index)
    sampler = engine_lib.temperature_sampler(settings.temperature, seed)
    return sampler, f"temperature={settings.temperature} seed={seed}"


def _attempt_outcome(
    ctx: Context, record, index, sampling, prompt, token_ids, settings, batch_flops=None
):
    """An attempt's generated tokens checked by the problem's verifier, with its cost estimate
    (from the single-row programs, or `batch_flops`: its share of the batch steps it ran in)."""
    tokens = _until_stop(token_ids, [ctx.tok.eos_id])
    solution = _solution_text(ctx.tok.decode(tokens))
    verdict = verifiers.check_answer(solution, record.answer)
    if batch_flops is None:
        eng = ctx.engine(len(prompt) + settings.solve_tokens)  # one row's cost
        schedule = engine_lib.chunk_schedule(len(prompt), settings.chunk_size)
        flops = ctx.flops.prefill(eng, schedule) + ctx.flops.decode(eng, len(tokens) - 1)
    else:
        flops = batch_flops
    attempt = Attempt(
        index, sampling, len(tokens), len(prompt), verdict.candidate, verdict.ok, verdict.reason
    )
    return attempt, solution, verdict, flops


def solve_attempt(ctx: Context, record, index: int, settings: Settings, pass_: int = 1):
    """One attempt at a problem (greedy for index 0, sampled after): decode, extract, verify."""
    prompt = ctx.tok.encode(solve_prompt(record.problem), add_bos=True)  # a sequence from 0
    eng = ctx.engine(len(prompt) + settings.solve_tokens)
    sampler, sampling = _sampling(record, index, settings, pass_)
    gen = eng.generate(
        np.asarray([prompt], np.int32),
        max_new_tokens=settings.solve_tokens,
        chunk_size=settings.chunk_size,
        stop_token=[ctx.tok.eos_id],
        sampler=sampler,
    )
    token_ids = [int(t) for t in gen.token_ids[0]]
    return _attempt_outcome(ctx, record, index, sampling, prompt, token_ids, settings)


def _attempt_batches(
    ctx: Context, records: dict[int, dataset.Record], pass_: int, settings: Settings
) -> tuple[dict[int, list], dict[int, float]]:
    """Attempts in rounds: round k runs attempt k (greedy, then sampled with its own seed) of
    every problem not yet verified, together in one ragged batch. Per problem: its attempts up
    to the first verified one, and its even share of the rounds' wall time (compiling excluded)."""
    tries: dict[int, list] = {i: [] for i in records}
    seconds = dict.fromkeys(records, 0.0)
    prompts = {i: ctx.tok.encode(solve_prompt(r.problem), add_bos=True) for i, r in records.items()}
    waiting = sorted(records)
    for index in range(settings.attempts):
        if not waiting:
            break
        started, compiled_before = time.perf_counter(), ctx.compile_seconds()
        sampling = {i: _sampling(records[i], index, settings, pass_) for i in waiting}
        items = [
            batch_lib.BatchItem(
                None, np.asarray(prompts[i], np.int32), settings.solve_tokens, sampling[i][0]
            )
            for i in waiting
        ]
        eng = ctx.batch_engine(
            _rows(settings, len(items)), batch_lib.cache_length(items, settings.chunk_size)
        )
        run = batch_lib.run(
            eng,
            items,
            batch_lib.grafted(eng),
            chunk_size=settings.chunk_size,
            stop_token=[ctx.tok.eos_id],
        )
        costs = ctx.flops.batch_items(eng, run)
        for i, result, cost in zip(waiting, run.items, costs, strict=True):
            token_ids = [int(t) for t in result.token_ids]
            tries[i].append(
                _attempt_outcome(
                    ctx,
                    records[i],
                    index,
                    sampling[i][1],
                    prompts[i],
                    token_ids,
                    settings,
                    batch_flops=cost,
                )
            )
        spent = time.perf_counter() - started - (ctx.compile_seconds() - compiled_before)
        for i in waiting:
            seconds[i] += spent / len(waiting)
        waiting = [i for i in waiting if not tries[i][-1][2].ok]
    return tries, seconds


@dataclasses.dataclass(frozen=True)
class _Routed:
    """A problem routed and, if it hit, answered from its graft in a batch (`solve_batch`)."""

    match: catalog.Match | None
    outcome: dict[str, Any] | Exception | None
    share_s: float  # its even share of the batch's wall time, compiling excluded
    share_compile_s: float
    rows: int
    # Its attempts from the batched rounds (`_attempt_batches`), up to the first verified one;
    # None: not attempted in a batch (a hit answered correctly)
    attempts: list | None = None


def solve_batch(
    ctx: Context, records: Sequence[dataset.Record], pass_: int, settings: Settings
) -> list[ProblemResult]:
    """Routes every problem, answers the hits together in one ragged batch of
    `settings.batch_size` rows, attempts the misses and wrong routes in batched rounds
    (`_attempt_batches`), then finishes each problem as `solve_one` does (rejections, wrong
    routes, deposits one artifact per verified item). Routing sees the library as it was before
    the batch: a problem deposited here is found from the next batch."""
    started, compiled_before = time.perf_counter(), ctx.compile_seconds()
    matches = [
        ctx.library.route(r.problem, ctx.model.fingerprint, threshold=settings.route_threshold)
        for r in records
    ]
    hits = [i for i, m in enumerate(matches) if m is not None]
    answered = _answer_hits(ctx, [records[i] for i in hits], [matches[i] for i in hits], settings)
    outcomes = dict(zip(hits, answered, strict=True))
    compile_s = ctx.compile_seconds() - compiled_before
    share = (time.perf_counter() - started - compile_s) / len(records)
    # What solve_one attempts: misses, refused artifacts and grafted answers that failed.
    unsolved = {
        i: r
        for i, r in enumerate(records)
        if not isinstance(outcomes.get(i), dict) or not outcomes[i]["correct"]
    }
    compiled_before = ctx.compile_seconds()
    tries, seconds = _attempt_batches(ctx, unsolved, pass_, settings)
    attempts_compile_s = ctx.compile_seconds() - compiled_before
    return [
        solve_one(
            ctx,
            record,
            pass_,
            settings,
            routed=_Routed(
                matches[i],
                outcomes.get(i),
                share + seconds.get(i, 0.0),
                (compile_s + attempts_compile_s) / len(records),
                settings.batch_size,
                tries.get(i),
            ),
        )
        for i, record in enumerate(records)
    ]


def solve_one(
    ctx: Context,
    record: dataset.Record,
    pass_: int,
    settings: Settings,
    *,
    routed: _Routed | None = None,
) -> ProblemResult:
    started, compiled_before = time.perf_counter(), ctx.compile_seconds()
    attempts: list[Attempt] = []
    deposited, root, wrong_route, quarantined = False, None, False, ""
    hit, refused = None, None
    if routed is None:
        match = ctx.library.route(
            record.problem, ctx.model.fingerprint, threshold=settings.route_threshold
        )
        if match is not None:
            try:
                hit = _answer_hit(ctx, record, match, settings)
            except (errors.ArtifactError, library.LibraryError) as e:
                refused = e
    else:
        match = routed.match
        if isinstance(routed.outcome, Exception):
            refused = routed.outcome
        else:
            hit = routed.outcome
    if refused is not None:
        # A damaged or refused artifact: quarantined (reindex skips it until it verifies again),
        # and this problem is attempted as a miss; the run goes on.
        quarantined = f"{type(refused).__name__}: {refused}"
        ctx.library.catalog.quarantine(match.item.root, quarantined)
        logging.warning("quarantined %s: %s", match.item.root[:16], quarantined)
        match = None
    if match is not None:
        root = match.item.root
        if not hit["correct"]:
            # The grafted answer failed this problem's verifier: a wrong route, never taken again
            # for this key, and the problem is attempted in this pass as if it had missed.
            wrong_route = True
            ctx.library.catalog.record_wrong_route(
                record.problem,
                match.item,
                ctx.model.fingerprint,
                f"pass {pass_}: grafted answer {hit['answer']!r} failed the verifier",
            )
    else:
        hit = {
            "correct": False,
            "answer": "",
            "decode_tokens": 0,
            "prefill_tokens": 0,
            "prefill_tokens_avoided": 0,
            "restore_ms": 0.0,
            "flops": 0.0,
            "prefill_flops_avoided": 0.0,
        }
    if match is None or wrong_route:
        if routed is not None and routed.attempts is not None:
            tries = iter(routed.attempts)  # already run in batched rounds
        else:
            tries = (
                solve_attempt(ctx, record, index, settings, pass_)
                for index in range(settings.attempts)
            )
        for attempt, solution, verdict, flops in tries:
            attempts.append(attempt)
            hit["decode_tokens"] += attempt.decode_tokens
            hit["prefill_tokens"] += attempt.prefill_tokens
            hit["flops"] += flops
            if not verdict.ok:
                ctx.library.reject(record.id, record.problem, verdict, f"solve pass {pass_}")
                continue
            hit["correct"], hit["answer"] = True, verdict.candidate
            item = library.VerifiedItem(
                record.id,
                record.problem,
                record.answer,
                library.item_text(record.problem, _reasoning(solution), verdict.candidate),
                verdict,
            )
            outcome = ctx.library.deposit(
                ctx.engine,
                ctx.tok,
                [item],
                model=ctx.model,
                versions=ctx.versions,
                chunk_size=settings.chunk_size,
                compact=settings.compact,
                source=f"solve pass {pass_} attempt {attempt.index}",
            )
            deposited, root = bool(outcome.added), outcome.root
            if outcome.tokens:  # the deposit's own prefill is work this problem cost
                schedule = engine_lib.chunk_schedule(outcome.tokens, settings.chunk_size)
                hit["prefill_tokens"] += outcome.tokens
                hit["flops"] += ctx.flops.prefill(ctx.engine(outcome.tokens), schedule)
            break
    compile_s = ctx.compile_seconds() - compiled_before
    wall_s = time.perf_counter() - started - compile_s
    if routed is not None:
        wall_s += routed.share_s
        compile_s += routed.share_compile_s
    e = settings.energy
    return ProblemResult(
        id=record.id,
        pass_=pass_,
        hit=match is not None,
        wrong_route=wrong_route,
        quarantined=quarantined,
        route=match.how if match else "miss",
        route_score=match.score if match else 0.0,
        root=root,
        matched_item=match.item.item_id if match else None,
        correct=hit["correct"],
        answer=hit["answer"],
        expected=record.answer,
        attempts=attempts,
        deposited=deposited,
        decode_tokens=hit["decode_tokens"],
        prefill_tokens=hit["prefill_tokens"],
        prefill_tokens_avoided=hit["prefill_tokens_avoided"],
        restore_ms=hit["restore_ms"],
        wall_ms=wall_s * 1e3,
        compile_ms=compile_s * 1e3,
        batch_rows=routed.rows if routed is not None else 1,
        graft_correct=match is not None and not wrong_route,
        greedy_correct=bool(attempts) and attempts[0].verified,
        flops_estimate=hit["flops"],
        prefill_flops_avoided_estimate=hit["prefill_flops_avoided"],
        energy_from_flops_j_estimate=hit["flops"] * e.joules_per_flop,
        energy_from_wall_j_estimate=wall_s * e.device_watts,
    )


def summarize_pass(results: Sequence[ProblemResult]) -> dict[str, Any]:
    n = len(results)
    hits = [r for r in results if r.hit]
    attempted = [r for r in results if r.attempts]
    return {
        "problems": n,
        "hits": len(hits),
        "wrong_routes": sum(r.wrong_route for r in results),
        "quarantined": sum(bool(r.quarantined) for r in results),
        "correct": sum(r.correct for r in results),
        "accuracy": sum(r.correct for r in results) / n if n else 0.0,
        # Kept apart: answers grafted from the library, and the model's own attempts.
        "hit_accuracy": sum(r.graft_correct for r in hits) / len(hits) if hits else None,
        "attempted": len(attempted),
        "greedy_accuracy": sum(r.greedy_correct for r in attempted) / len(attempted)
        if attempted
        else None,
        "pass_at_k": sum(any(a.verified for a in r.attempts) for r in attempted) / len(attempted)
        if attempted
        else None,
        "compile_s": sum(r.compile_ms for r in results) / 1e3,
        "deposited": sum(r.deposited for r in results),
        "decode_tokens": sum(r.decode_tokens for r in results),
        "decode_tokens_per_problem": sum(r.decode_tokens for r in results) / n if n else 0.0,
        "prefill_tokens": sum(r.prefill_tokens for r in results),
        "prefill_tokens_avoided": sum(r.prefill_tokens_avoided for r in results),
        "restore_ms_per_hit": sum(r.restore_ms for r in hits) / len(hits) if hits else None,
        "wall_s": sum(r.wall_ms for r in results) / 1e3,
        "flops_estimate": sum(r.flops_estimate for r in results),
        "prefill_flops_avoided_estimate": sum(r.prefill_flops_avoided_estimate for r in results),
        "energy_from_flops_j_estimate": sum(r.energy_from_flops_j_estimate for r in results),
        "energy_from_wall_j_estimate": sum(r.energy_from_wall_j_estimate for r in results),
    }


def plot(results: Sequence[ProblemResult], path: str | Path) -> None:
    """flywheel.png: correctness and decode tokens per problem, one series per pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = sorted({r.pass_ for r in results})
    ids = list(dict.fromkeys(r.id for r in results))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, len(ids) * 0.45), 7), sharex=True)
    width = 0.8 / len(passes)
    for k, p in enumerate(passes):
        by_id = {r.id: r for r in results if r.pass_ == p}
        xs = np.arange(len(ids)) + (k - (len(passes) - 1) / 2) * width
        correct = [by_id[i].correct if i in by_id else 0 for i in ids]
        tokens = [by_id[i].decode_tokens if i in by_id else 0 for i in ids]
        acc = np.mean(correct) if correct else 0.0
        top.bar(xs, correct, width, label=f"pass {p} (accuracy {acc:.2f})")
        bottom.bar(xs, tokens, width, label=f"pass {p} ({sum(tokens)} tokens)")
    top.set_ylabel("correct")
    top.set_yticks([0, 1])
    top.legend()
    top.set_title("Verified-knowledge flywheel: per problem, pass by pass")
    bottom.set_ylabel("decode tokens")
    bottom.set_yscale("symlog")
    bottom.legend()
    bottom.set_xticks(np.arange(len(ids)), ids, rotation=60, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclasses.dataclass(frozen=True)
class SolveResult:
    passes: list[dict[str, Any]]
    library: dict[str, Any]
    results: list[ProblemResult]


def solve(
    ctx: Context,
    records: Sequence[dataset.Record],
    settings: Settings,
    problems_jsonl: str | Path | None = None,
    *,
    progress: bool = True,
) -> SolveResult:
    """Every problem, `settings.passes` times; each result is appended to `problems_jsonl` as it
    completes (a crash keeps what was done)."""
    results: list[ProblemResult] = []
    sink = open(problems_jsonl, "w", encoding="utf-8") if problems_jsonl else None  # noqa: SIM115
    try:
        for p in range(1, settings.passes + 1):
            bar = progress_lib.bar(records, desc=f"pass {p}", unit="problem", enabled=progress)
            done: list[ProblemResult] = []
            waiting: list[dataset.Record] = []
            for n, record in enumerate(bar):
                waiting.append(record)
                if len(waiting) < settings.batch_size and n + 1 < len(records):
                    continue
                if settings.batch_size == 1:
                    finished = [solve_one(ctx, record, p, settings)]
                else:
                    finished = solve_batch(ctx, waiting, p, settings)
                waiting = []
                for result in finished:
                    done.append(result)
                    if sink:
                        sink.write(json.dumps(result.to_json(), sort_keys=True) + "\n")
                        sink.flush()
                bar.set_postfix(hits=sum(r.hit for r in done), correct=sum(r.correct for r in done))
            logging.info("pass %d: %s", p, summarize_pass(done))
            results.extend(done)
    finally:
        if sink:
            sink.close()
    stats = ctx.library.stats(ctx.model.fingerprint)
    attended = (
        stats.largest_artifact_tokens
        + settings.answer_tokens
        + max(
            (len(ctx.tok.encode(hit_query(r.problem), add_bos=False)) for r in records), default=0
        )
    )
    return SolveResult(
        passes=[
            {"pass": p} | summarize_pass([r for r in results if r.pass_ == p])
            for p in range(1, settings.passes + 1)
        ],
        library={
            "items": stats.items,
            "artifacts": stats.artifacts,
            "tokens_stored": stats.tokens_stored,
            "largest_artifact_tokens": stats.largest_artifact_tokens,
            "max_tokens_attended_per_query": attended,
            "context_window": ctx.context_window,
            "stored_over_attended": stats.tokens_stored / attended if attended else None,
        },
        results=results,
    )
