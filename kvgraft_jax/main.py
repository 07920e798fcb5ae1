"""`python -m kvgraft_jax.main --flagfile=configs/tiny_cpu.flags [--mode=...]`: flags in, a mode run, a report out.

Exit codes: 0 success, 2 unknown/inconsistent flags or a mode not built yet, 1 any other failure.
"""

from __future__ import annotations

import os
import sys

# Quiet TensorFlow (imported by kauldron) before anything imports it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging

from kvgraft_jax import config
from kvgraft_jax import flags as kv_flags

FLAGS = flags.FLAGS
kv_flags.define_flags(FLAGS)

_PROG = "kvgraft_jax"


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


def main(argv: list[str]) -> None:
    del argv
    try:
        cfg = kv_flags.config_from_flags(FLAGS)
        cfg.require_built()
        from kvgraft_jax import modes  # imports gemma and TensorFlow: only once flags are valid

        report = modes.run_generate(cfg)
    except config.ConfigError as e:
        _usage_error(str(e))
    _print_generate(report)
    if cfg.report:
        modes.write_report(report, cfg.report)
        print(f"report: {cfg.report}")
    logging.info("done")


def run() -> None:
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
