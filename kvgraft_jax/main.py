"""`python -m kvgraft_jax.main --flagfile=configs/tiny_cpu.flags [--mode=...]`: flags in, a mode run, a report out.

Exit codes: 0 success, 2 unknown/inconsistent flags or a mode not built yet, 1 any other failure.
"""

from __future__ import annotations

import json
import os
import re
import sys

from kvgraft_jax.core import xla_flags

# Quiet TensorFlow (imported by kauldron) before anything imports it; raise XLA:CPU's collective
# timeouts before JAX starts (they change no numerics; see xla_flags).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["XLA_FLAGS"] = xla_flags.with_collective_timeouts(os.environ.get("XLA_FLAGS", ""))

from absl import app, flags, logging

from kvgraft_jax.cli import flags as kv_flags
from kvgraft_jax.cli import quiet
from kvgraft_jax.run import config

FLAGS = flags.FLAGS
kv_flags.define_flags(FLAGS)

_PROG = "kvgraft_jax"


def _os_cause(message: str) -> str:
    """The OS error a TensorStore message ends with (`[os_error_code='28']`), named up front so a
    full disk is not cut off by the 500-character message it hides in."""
    found = re.search(r"os_error_code='(\d+)'", message)
    return f"{os.strerror(int(found.group(1)))}: " if found else ""


def _bucket_hint(cfg: config.RunConfig, message: str) -> str:
    """For a storage error in a run that uses Cloud Storage: which paths, and what they need. The
    error TensorStore raises names a host, not the artifact or the fix."""
    storage_words = ("googleapis", "HTTP", "credential", "gs://", "oauth")
    if not any(word.lower() in message.lower() for word in storage_words):
        return ""
    remote = [
        f"--{name}={value}"
        for name in ("artifact", "parent", "library", "library_artifacts")
        if str(value := getattr(cfg, name)).startswith("gs://")
    ]
    if not remote:
        return ""
    return (
        f" [while using {', '.join(remote)}: Cloud Storage needs network access to "
        "storage.googleapis.com and credentials: `gcloud auth application-default login` on a "
        "workstation, the VM's service account on a TPU VM]"
    )


def _usage_error(message: str) -> None:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        rest = FLAGS(argv)
    except flags.Error as e:
        _usage_error(str(e).splitlines()[0])
    if len(rest) > 1:
        _usage_error(f"unexpected positional arguments: {' '.join(rest[1:])}")
    return rest


def _print_generate(report) -> None:
    t = report.timings
    print(
        f"model {report.model['name']} ({report.model['num_params'] / 1e6:.2f}M params) on mesh {report.mesh}"
    )
    print(f"prompt: {len(report.prompt_ids)} tokens, {len(report.schedule)} prefill chunks")
    for i, ids in enumerate(report.new_token_ids):
        text = report.continuation[i] if report.continuation else None
        label = f"row {i}: " if len(report.new_token_ids) > 1 else ""
        print(f"{label}continuation: {text!r}" if text is not None else f"{label}new ids: {ids}")
        if text is not None:
            print(f"{label}new ids: {ids}")
    print(
        f"timings: compile {t['compile_s']:.2f} s, prefill {t['prefill_s'] * 1e3:.1f} ms "
        f"({t['prefill_tokens_per_s']:.0f} tok/s), first token {t['first_token_s'] * 1e3:.1f} ms, "
        f"decode {t['decode_steps']} steps at {t['decode_tokens_per_s']:.1f} tok/s"
    )


def _print_deposit(report) -> None:
    t = report.timings
    print(f"artifact: {report.artifact}")
    print(f"root: {report.root}")
    if report.parent:
        print(
            f"parent: {report.parent} (this artifact holds only positions {report.positions[0]}..)"
        )
    print(
        f"{report.tokens} tokens in {len(report.schedule)} chunks (cache of {report.cache_slots} "
        f"slots), {report.artifact_bytes / 2**20:.2f} MiB; "
        f"prefill {t['prefill_s']:.2f} s, digest {t['digest_s'] * 1e3:.1f} ms, write {t['write_s'] * 1e3:.1f} ms"
    )


def _print_inspect(report) -> None:
    s = report.summary
    if s:
        print(f"artifact: {report.artifact}")
        print(f"root: {s['root']}")
        print(
            f"model {s['model']} (weights {s['weights_fingerprint'][:16]}), positions "
            f"{s['positions'][0]}..{s['positions'][1]}, batch {s['batch_size']}, chunk size "
            f"{s['chunk_size']} ({s['chunks']} chunks), deposited on {s['deposit_mesh']}, "
            f"{s['arrays']} arrays, {s['bytes'] / 2**20:.2f} MiB, created {s['created']}"
        )
    if report.intact:
        t = report.timings
        print(
            f"intact: restored on {report.restored_on} in {t['restore_s'] * 1e3:.1f} ms; every state "
            f"file and every digest re-verified in {t['verify_s'] * 1e3:.1f} ms"
        )
    else:
        print(f"NOT INTACT: {report.error}")


def _print_graft(report) -> None:
    t = report.timings
    first, last = report.positions
    chain = f", a chain of {len(report.chain)} artifacts" if len(report.chain) > 1 else ""
    print(
        f"artifact: {report.artifact} (root {report.root[:16]}{chain}, {report.prefix_tokens} "
        f"tokens at positions {first}..{last}), grafted into a cache of {report.cache_slots} slots"
    )
    label = "" if report.exact else "APPROXIMATE "
    if report.relocation:
        r = report.relocation
        print(
            f"APPROXIMATE: relocated from position {r['from_position']} to {r['to_position']} "
            f"(keys re-rotated); against a recompute there: KL mean {r['mean_kl_divergence']:.3g} "
            f"max {r['max_kl_divergence']:.3g}, argmax agreement {r['argmax_agreement']:.3f}"
        )
    for i, ids in enumerate(report.new_token_ids):
        text = report.continuation[i] if report.continuation else None
        print(f"{label}continuation: {text!r}" if text is not None else f"{label}new ids: {ids}")
    print(
        f"timings: restore {t['restore_s'] * 1e3:.1f} ms, verify {t['verify_s'] * 1e3:.1f} ms, insert "
        f"{t['insert_s'] * 1e3:.1f} ms, query prefill {t['query_prefill_s'] * 1e3:.1f} ms, first token "
        f"{t['first_token_s'] * 1e3:.1f} ms, decode {t['decode_tokens_per_s']:.1f} tok/s"
    )


def _print_verify(report) -> None:
    _print_graft(report.graft)
    c = report.comparison
    print(f"reference {report.reference}")
    matched = [t["name"] for t in report.contract if t["matched"]]
    print(f"contract matched: {', '.join(matched)}")
    for t in report.contract:
        if not t["matched"]:
            print(
                f"contract differs: {t['name']}: artifact {t['deposited']}, this run {t['here']} ({t['if_not']})"
            )
    for note in report.notes:
        print(f"note: {note}")
    if c["bit_identical"]:
        print(
            f"BIT-IDENTICAL: {c['steps']} decode steps, logits SHA-256 equal at every step; KV root after query equal"
        )
    else:
        print(
            f"DIFFERS: first mismatch at step {c['first_mismatch_step']} index {c['first_mismatch_index']}, "
            f"argmax agreement {c['argmax_agreement']:.3f}, max |delta logit| {c['max_abs_logit_diff']:.4g}, "
            f"KL mean {c['mean_kl_divergence']:.3g}"
        )
    n = report.natural
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
        print(
            f"natural recompute (prefix + query as one text in chunks of {n['chunk_size']}, "
            f"{chunks}, on {n['mesh']}, cache of {n['cache_slots']} slots): {verdict}"
        )


def _print_seed(report) -> None:
    s = report.seed
    print(f"library: {report.library}")
    print(
        f"{s['records']} records: {len(s['accepted'])} verified and deposited in "
        f"{len(s['artifacts'])} artifacts ({s['tokens']} tokens), {len(s['rejected'])} rejected, "
        f"{len(s['duplicates'])} already in the library; catalog now holds {report.catalog_items} items"
    )
    for item_id, reason in s["rejected"].items():
        print(f"rejected {item_id}: {reason}")


def _print_any_deposit(report) -> None:
    (_print_seed if hasattr(report, "seed") else _print_deposit)(report)


def _print_solve(report) -> None:
    lib = report.library
    print(
        f"library: {lib['items']} items in {lib['artifacts']} artifacts, {lib['tokens_stored']} "
        f"tokens stored; one query attends at most {lib['max_tokens_attended_per_query']} "
        f"(model window {lib['context_window']})"
    )

    def share(x) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    for p in report.passes:
        print(
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
    for name, path in report.outputs.items():
        print(f"{name}: {path}")


def _print_reindex(report) -> None:
    print(
        f"library {report.library}: {report.artifacts} committed artifacts, catalog rebuilt "
        f"with {report.items} items"
    )
    for why in report.skipped:
        print(f"skipped {why}")


def _print_cycle(report) -> None:
    print("== deposit (as `--mode=deposit` does)")
    _print_deposit(report.deposit)
    print("== graft and verify from disk in a new engine (as a later `--mode=verify` does)")
    _print_verify(report.verify)


def _print_json(report) -> None:
    print(json.dumps(report.to_json(), indent=2, sort_keys=True))


def _join_processes(cfg: config.RunConfig) -> None:
    """`--distributed`: join the other processes before anything touches a device."""
    from kvgraft_jax.core import multihost

    spec = multihost.DistributedSpec(
        enabled=cfg.distributed,
        coordinator_address=cfg.coordinator_address,
        num_processes=cfg.num_processes,
        process_id=cfg.process_id,
    )
    try:
        multihost.initialize(spec)
    except Exception as e:  # the coordinator is unreachable, a process id is taken, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"{_PROG}: cannot join the distributed run: {first}", file=sys.stderr)
        sys.exit(1)


def main(argv: list[str]) -> None:
    del argv
    quiet.install(logging.get_absl_handler(), verbose=logging.get_verbosity() >= logging.DEBUG)
    try:
        cfg = kv_flags.config_from_flags(FLAGS)
        _join_processes(cfg)
        # Imports gemma and TensorFlow: only once the flags are known to be valid.
        from kvgraft_jax.cli import modes
        from kvgraft_jax.core import engine, multihost
        from kvgraft_jax.library import catalog, dataset, library, verifiers
        from kvgraft_jax.store import errors, signing

        runners = {
            "generate": (modes.run_generate, _print_generate),
            "deposit": (modes.run_deposit, _print_any_deposit),
            "inspect": (modes.run_inspect, _print_inspect),
            "bench": (modes.run_bench, _print_json),
            "graft": (modes.run_graft, _print_graft),
            "verify": (modes.run_verify, _print_verify),
            "cycle": (modes.run_cycle, _print_cycle),
            "solve": (modes.run_solve, _print_solve),
            "reindex": (modes.run_reindex, _print_reindex),
        }
        run_mode, print_report = runners[cfg.mode]
        try:
            report = run_mode(cfg)
        except errors.ArtifactError as e:
            print(f"{_PROG}: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(1)
        except (
            engine.EngineError,
            FileNotFoundError,
            dataset.DatasetError,
            library.LibraryError,
            verifiers.SandboxRequired,
            signing.SigningError,
        ) as e:
            _usage_error(str(e))
        except catalog.CatalogError as e:
            print(f"{_PROG}: CatalogError: {e}", file=sys.stderr)
            sys.exit(1)
        except OSError as e:  # a read-only directory, a full disk
            print(f"{_PROG}: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(1)
        except config.ConfigError:
            raise  # exit 2, below
        except Exception as e:  # storage without credentials, anything not foreseen: one line
            if logging.get_verbosity() >= logging.DEBUG:
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            print(
                f"{_PROG}: {type(e).__name__}: {_os_cause(str(e))}{first[:500]}"
                f"{_bucket_hint(cfg, str(e))} (--verbosity=1 shows the traceback)",
                file=sys.stderr,
            )
            sys.exit(1)
    except config.ConfigError as e:
        _usage_error(str(e))
    print_report(report)
    if cfg.mode == "solve":
        modes.write_report(report, str(modes.solve_report_path(cfg)))
    elif cfg.report and multihost.is_primary():  # one report per run, not per process
        modes.write_report(report, cfg.report)
        print(f"report: {cfg.report}")
    if cfg.mode == "inspect" and not report.intact:
        sys.exit(1)
    if cfg.mode in ("verify", "cycle") and report.exit_code:
        sys.exit(report.exit_code)
    logging.info("done")


def run() -> None:
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
