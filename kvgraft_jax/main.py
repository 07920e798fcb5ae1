"""`python -m kvgraft_jax.main --flagfile=configs/tiny_cpu.flags [--mode=...]`: flags in, a mode run, a report out.

Exit codes: 0 success, 2 unknown/inconsistent flags or a mode not built yet, 1 any other failure.
"""

from __future__ import annotations

import os
import re
import sys

from kvgraft_jax.core import host_memory, xla_flags

# Quiet TensorFlow (imported by kauldron) before anything imports it; raise XLA:CPU's collective
# timeouts before JAX starts (they change no numerics; see xla_flags). TensorFlow computes nothing
# here: its oneDNN kernels are turned off only because on CPUs with AVX-512 its import announces
# them at INFO, before absl's logging starts, past TF_CPP_MIN_LOG_LEVEL.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
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
    # Freed buffers stay with the process, so each restore and graft reuses the last one's pages
    # (`host_memory`): before any model, cache or artifact is allocated.
    host_memory.keep_freed_pages()
    try:
        cfg = kv_flags.config_from_flags(FLAGS)
        _join_processes(cfg)
        # Imports gemma and TensorFlow: only once the flags are known to be valid.
        from kvgraft_jax.cli import modes, reports
        from kvgraft_jax.core import engine, multihost
        from kvgraft_jax.exact import batch
        from kvgraft_jax.library import catalog, dataset, library, verifiers
        from kvgraft_jax.store import errors, signing

        try:
            report = modes.run(cfg)
        except batch.OtherProgramError as e:  # not a difference: nothing here can prove it
            print(f"{_PROG}: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(3)
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
    print("\n".join(report.lines()))
    path = modes.report_path(cfg)
    if path is not None and multihost.is_primary():  # one report per run, not per process
        reports.write(report, path)
        if cfg.mode != "solve":  # solve's outputs (this path among them) are in its lines
            print(f"report: {path}")
    if report.exit_code:
        sys.exit(report.exit_code)
    logging.info("done")


def run() -> None:
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
