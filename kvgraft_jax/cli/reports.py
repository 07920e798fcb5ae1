"""What each `--mode` returns: typed reports that know their JSON, their lines for people and
their exit code, so `main` only parses, runs, prints and exits."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvgraft_jax.core import atomic


class Report:
    """A mode's result. `to_json` goes to `--report`; `lines` to stdout; `exit_code` to the shell
    (0 unless the report says otherwise)."""

    exit_code = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def lines(self) -> Iterator[str]:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class ModeReport(Report):
    """A mode's report; the resolved config travels inside it, so a run can be repeated."""

    config: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class BenchReport(Report):
    """A benchmark's result (`bench/`): printed as its JSON."""

    result: Any  # artifact_bench.ArtifactBench | graft_bench.GraftBench | weights_bench.WeightsBench | batch_bench.BatchBench

    def to_json(self) -> dict[str, Any]:
        return self.result.to_json()

    def lines(self) -> Iterator[str]:
        yield json.dumps(self.to_json(), indent=2, sort_keys=True)


def write(report: Report, path: str | Path) -> None:
    """Writes the report JSON atomically; the resolved config travels inside it."""
    atomic.replace_file(path, json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n")


@dataclasses.dataclass(frozen=True)
class GenerateReport(ModeReport):
    """The JSON report of `--mode=generate`."""

    model: dict[str, Any]
    tokenizer: dict[str, Any] | None
    mesh: str
    num_devices: int
    versions: dict[str, str]
    prompt_ids: list[int]
    schedule: list[list[int]]  # [start, length] per prefill chunk
    new_token_ids: list[list[int]]  # per batch row
    continuation: list[str] | None  # per batch row, when a tokenizer is known
    step_logits_sha256: list[str]  # SHA-256 of each step's logits bytes (all rows)
    timings: dict[str, float]

    def lines(self) -> Iterator[str]:
        t = self.timings
        yield (
            f"model {self.model['name']} ({self.model['num_params'] / 1e6:.2f}M params) on mesh {self.mesh}"
        )
        yield (f"prompt: {len(self.prompt_ids)} tokens, {len(self.schedule)} prefill chunks")
        for i, ids in enumerate(self.new_token_ids):
            text = self.continuation[i] if self.continuation else None
            label = f"row {i}: " if len(self.new_token_ids) > 1 else ""
            yield (
                f"{label}continuation: {text!r}" if text is not None else f"{label}new ids: {ids}"
            )
            if text is not None:
                yield (f"{label}new ids: {ids}")
        yield (
            f"timings: compile {t['compile_s']:.2f} s, prefill {t['prefill_s'] * 1e3:.1f} ms "
            f"({t['prefill_tokens_per_s']:.0f} tok/s), first token {t['first_token_s'] * 1e3:.1f} ms, "
            f"decode {t['decode_steps']} steps at {t['decode_tokens_per_s']:.1f} tok/s"
        )


@dataclasses.dataclass(frozen=True)
class DepositReport(ModeReport):
    """The JSON report of `--mode=deposit`."""

    artifact: str
    root: str
    tokens: int
    positions: list[int]  # [first, last]
    parent: str | None  # the parent's root for a prefix-chain child
    schedule: list[list[int]]
    cache_slots: (
        int  # the deposit's cache (not part of the contract: attention is length-invariant)
    )
    artifact_bytes: int
    timings: dict[str, float]

    def lines(self) -> Iterator[str]:
        t = self.timings
        yield (f"artifact: {self.artifact}")
        yield (f"root: {self.root}")
        if self.parent:
            yield (
                f"parent: {self.parent} (this artifact holds only positions {self.positions[0]}..)"
            )
        yield (
            f"{self.tokens} tokens in {len(self.schedule)} chunks (cache of {self.cache_slots} "
            f"slots), {self.artifact_bytes / 2**20:.2f} MiB; "
            f"prefill {t['prefill_s']:.2f} s, digest {t['digest_s'] * 1e3:.1f} ms, write {t['write_s'] * 1e3:.1f} ms"
        )


@dataclasses.dataclass(frozen=True)
class InspectReport(ModeReport):
    """The JSON report of `--mode=inspect`; `intact` decides the exit code."""

    artifact: str
    intact: bool
    error: str | None
    summary: dict[str, Any] | None
    restored_on: str
    timings: dict[str, float]

    def lines(self) -> Iterator[str]:
        s = self.summary
        if s:
            yield (f"artifact: {self.artifact}")
            yield (f"root: {s['root']}")
            yield (
                f"model {s['model']} (weights {s['weights_fingerprint'][:16]}), positions "
                f"{s['positions'][0]}..{s['positions'][1]}, batch {s['batch_size']}, chunk size "
                f"{s['chunk_size']} ({s['chunks']} chunks), deposited on {s['deposit_mesh']}, "
                f"{s['arrays']} arrays, {s['bytes'] / 2**20:.2f} MiB, created {s['created']}"
            )
        if self.intact:
            t = self.timings
            yield (
                f"intact: restored on {self.restored_on} in {t['restore_s'] * 1e3:.1f} ms; every state "
                f"file and every digest re-verified in {t['verify_s'] * 1e3:.1f} ms"
            )
        else:
            yield (f"NOT INTACT: {self.error}")

    @property
    def exit_code(self) -> int:
        return 0 if self.intact else 1


@dataclasses.dataclass(frozen=True)
class GraftReport(ModeReport):
    """The JSON report of `--mode=graft` (and the grafted side of `--mode=verify`)."""

    artifact: str
    root: str
    chain: list[str]  # roots of the prefix chain, root first (one entry without a parent)
    prefix_tokens: int
    cache_slots: int  # this run's cache (not part of the contract: attention is length-invariant)
    positions: list[int]  # [first, last] positions the prefix occupies in this run
    exact: bool  # False when relocated: every output is then approximate
    relocation: dict[str, Any] | None  # relocated: from/to and the measured KL and agreement
    query_ids: list[int]
    query_schedule: list[list[int]]
    new_token_ids: list[list[int]]
    continuation: list[str] | None
    step_logits_sha256: list[str]
    state_root_after_query: str
    timings: dict[str, float]

    def lines(self) -> Iterator[str]:
        t = self.timings
        first, last = self.positions
        chain = f", a chain of {len(self.chain)} artifacts" if len(self.chain) > 1 else ""
        yield (
            f"artifact: {self.artifact} (root {self.root[:16]}{chain}, {self.prefix_tokens} "
            f"tokens at positions {first}..{last}), grafted into a cache of {self.cache_slots} slots"
        )
        label = "" if self.exact else "APPROXIMATE "
        if self.relocation:
            r = self.relocation
            yield (
                f"APPROXIMATE: relocated from position {r['from_position']} to {r['to_position']} "
                f"(keys re-rotated); against a recompute there: KL mean {r['mean_kl_divergence']:.3g} "
                f"max {r['max_kl_divergence']:.3g}, argmax agreement {r['argmax_agreement']:.3f}"
            )
        for i, ids in enumerate(self.new_token_ids):
            text = self.continuation[i] if self.continuation else None
            yield (
                f"{label}continuation: {text!r}" if text is not None else f"{label}new ids: {ids}"
            )
        yield (
            f"timings: restore {t['restore_s'] * 1e3:.1f} ms, verify {t['verify_s'] * 1e3:.1f} ms, insert "
            f"{t['insert_s'] * 1e3:.1f} ms, query prefill {t['query_prefill_s'] * 1e3:.1f} ms, first token "
            f"{t['first_token_s'] * 1e3:.1f} ms ({t['graft_call_to_first_token_s'] * 1e3:.1f} ms from "
            f"the call, manifests included), decode {t['decode_tokens_per_s']:.1f} tok/s"
        )


@dataclasses.dataclass(frozen=True)
class VerifyReport(ModeReport):
    """The JSON report of `--mode=verify`; `exit_code` 0 bit-identical, 1 differs, 3 not proven here."""

    graft: GraftReport
    reference: str  # "a: ..." | "b: ..." | "c: ..." | "r: ..." (relocated, approximate)
    deposit_mesh: str
    run_mesh: str
    comparison: dict[str, Any]
    contract: list[
        dict[str, Any]
    ]  # contract.Term per setting: artifact's value, this run's, matched
    natural: dict[str, Any] | None  # the recompute a user would write, compared with the graft
    notes: list[str]
    exit_code: int

    def lines(self) -> Iterator[str]:
        yield from self.graft.lines()
        c = self.comparison
        yield (f"reference {self.reference}")
        matched = [t["name"] for t in self.contract if t["matched"]]
        yield (f"contract matched: {', '.join(matched)}")
        for t in self.contract:
            if not t["matched"]:
                yield (
                    f"contract differs: {t['name']}: artifact {t['deposited']}, this run {t['here']} ({t['if_not']})"
                )
        for note in self.notes:
            yield (f"note: {note}")
        if c["bit_identical"]:
            yield (
                f"BIT-IDENTICAL: {c['steps']} decode steps, logits SHA-256 equal at every step; KV root after query equal"
            )
        else:
            yield (
                f"DIFFERS: first mismatch at step {c['first_mismatch_step']} index {c['first_mismatch_index']}, "
                f"argmax agreement {c['argmax_agreement']:.3f}, max |delta logit| {c['max_abs_logit_diff']:.4g}, "
                f"KL mean {c['mean_kl_divergence']:.3g}"
            )
        n = self.natural
        if n is not None:
            if n["same_computation_as_reference"]:
                verdict = "the same computation as the reference"
            elif n["bit_identical"]:
                verdict = "BIT-IDENTICAL to the graft"
            else:
                verdict = (
                    f"differs from the graft (argmax agreement {n['argmax_agreement']:.3f}, "
                    f"max |delta logit| {n['max_abs_logit_diff']:.4g})"
                )
            chunks = "the same chunks" if n["same_schedule_as_graft"] else "other chunks"
            yield (
                f"natural recompute (prefix + query as one text in chunks of {n['chunk_size']}, "
                f"{chunks}, on {n['mesh']}, cache of {n['cache_slots']} slots): {verdict}"
            )


@dataclasses.dataclass(frozen=True)
class BatchGraftReport(ModeReport):
    """The JSON report of `--mode=graft --batch_file`: every item's tokens and logits digests, and
    the batch schedule that is their contract (`--mode=verify --batch_report` replays it)."""

    batch_file: str
    model: dict[str, Any]  # name and weights fingerprint
    mesh: str
    processes: int  # jax.process_count(): collectives sum in another order across processes
    cache_slots: int
    items: list[dict[str, Any]]  # per item, in file order: id, artifact, chain, tokens, digests
    schedule: dict[str, Any]  # exact.batch.BatchSchedule
    timings: dict[str, float]

    def lines(self) -> Iterator[str]:
        rows, t = self.schedule["batch_size"], self.timings
        yield (
            f"batch: {len(self.items)} items from {self.batch_file} through {rows} rows "
            f"({self.schedule['weight_layout']} weights) on mesh {self.mesh}"
            f"{f' over {self.processes} processes' if self.processes > 1 else ''}, "
            f"{len(self.schedule['steps'])} steps, cache of {self.cache_slots} slots"
        )
        for item in self.items:
            prefix = (
                f"{item['prefix_tokens']} grafted tokens (root {item['chain'][-1][:16]})"
                if item["chain"]
                else "no prefix"
            )
            text = item["continuation"]
            out = repr(text) if text is not None else str(item["new_token_ids"])
            yield f"item {item['id']} (row {item['row']}, {prefix}): {out}"
        yield (
            f"timings: {t['seconds']:.2f} s for the batch ({t['items_per_s']:.2f} items/s, "
            f"manifests, restores and queries included), decode {t['decode_tokens_per_s']:.1f} "
            f"tok/s, compile {t['compile_s']:.1f} s"
        )


@dataclasses.dataclass(frozen=True)
class BatchVerifyReport(ModeReport):
    """The JSON report of `--mode=verify` on a batch; `exit_code` 0 bit-identical, 1 differs, 3
    not provable here (a prefix deposited on another mesh)."""

    graft: BatchGraftReport | None  # None: the results checked are an earlier run's
    checked_report: str | None  # --batch_report: the earlier run's report
    reference: str
    deposit_meshes: list[str]
    run_mesh: str
    comparison: dict[str, Any]  # exact.batch.BatchComparison
    notes: list[str]
    exit_code: int

    def lines(self) -> Iterator[str]:
        if self.graft is not None:
            yield from self.graft.lines()
        else:
            yield f"checking the recorded results of {self.checked_report}"
        yield f"reference: {self.reference}"
        for note in self.notes:
            yield f"note: {note}"
        c = self.comparison
        if c["bit_identical"]:
            yield (
                f"BIT-IDENTICAL: {c['items']} items, the same schedule, the logits SHA-256 equal "
                "at every token of every item"
            )
        else:
            where = c["first_mismatch"]
            first = f"first at item {where[0]} token {where[1]}, " if where else ""
            yield (
                f"DIFFERS: {c['identical_items']} of {c['items']} items identical ({first}argmax "
                f"agreement {c['argmax_agreement']:.3f})"
            )


@dataclasses.dataclass(frozen=True)
class CycleReport(ModeReport):
    """The JSON report of `--mode=cycle`: deposit, then graft and verify it in the same run."""

    deposit: DepositReport
    verify: VerifyReport
    exit_code: int  # the verify's

    def lines(self) -> Iterator[str]:
        yield ("== deposit (as `--mode=deposit` does)")
        yield from self.deposit.lines()
        yield ("== graft and verify from disk in a new engine (as a later `--mode=verify` does)")
        yield from self.verify.lines()


@dataclasses.dataclass(frozen=True)
class SeedReport(ModeReport):
    """The JSON report of `--mode=deposit --library --dataset`."""

    library: str
    seed: dict[str, Any]  # flywheel.SeedReport
    catalog_items: int

    def lines(self) -> Iterator[str]:
        s = self.seed
        yield (f"library: {self.library}")
        yield (
            f"{s['records']} records: {len(s['accepted'])} verified and deposited in "
            f"{len(s['artifacts'])} artifacts ({s['tokens']} tokens), {len(s['rejected'])} rejected, "
            f"{len(s['duplicates'])} already in the library; catalog now holds {self.catalog_items} items"
        )
        for item_id, reason in s["rejected"].items():
            yield (f"rejected {item_id}: {reason}")


@dataclasses.dataclass(frozen=True)
class SolveReport(ModeReport):
    """summary.json of `--mode=solve` (problems.jsonl and flywheel.png lie beside it)."""

    dataset: str
    library: dict[str, Any]
    passes: list[dict[str, Any]]
    assumptions: dict[str, Any]
    versions: dict[str, str]
    machine: dict[str, Any]
    outputs: dict[str, str]

    def lines(self) -> Iterator[str]:
        lib = self.library
        yield (
            f"library: {lib['items']} items in {lib['artifacts']} artifacts, {lib['tokens_stored']} "
            f"tokens stored; one query attends at most {lib['max_tokens_attended_per_query']} "
            f"(model window {lib['context_window']})"
        )

        def share(x) -> str:
            return "n/a" if x is None else f"{x:.3f}"

        for p in self.passes:
            yield (
                f"pass {p['pass']}: accuracy {p['accuracy']:.3f} ({p['correct']}/{p['problems']}): "
                f"grafted hits {p['hits']} (verified {share(p['hit_accuracy'])}, wrong routes "
                f"{p['wrong_routes']}, quarantined {p['quarantined']}), attempted {p['attempted']} "
                f"(greedy {share(p['greedy_accuracy'])}, pass@k {share(p['pass_at_k'])}); deposited "
                f"{p['deposited']}, decode tokens {p['decode_tokens']} "
                f"({p['decode_tokens_per_problem']:.1f}/problem), prefill tokens avoided "
                f"{p['prefill_tokens_avoided']}, wall {p['wall_s']:.1f} s + compile "
                f"{p['compile_s']:.1f} s, ~{p['flops_estimate']:.3g} FLOPs, "
                f"~{p['energy_from_flops_j_estimate']:.3g} J (estimates)"
            )
        for name, path in self.outputs.items():
            yield (f"{name}: {path}")


@dataclasses.dataclass(frozen=True)
class ReindexReport(ModeReport):
    library: str
    artifacts: int
    items: int
    skipped: list[str]

    def lines(self) -> Iterator[str]:
        yield (
            f"library {self.library}: {self.artifacts} committed artifacts, catalog rebuilt "
            f"with {self.items} items"
        )
        for why in self.skipped:
            yield (f"skipped {why}")
