"""Many processes, one mesh: `jax.distributed` set-up and the few agreements kvgraft needs.

Every helper is a no-op on one process, so single-host code pays nothing. On several processes
each helper is a collective: every process must call it, in the same order, which is why a
failure on one process is first *agreed* (`agree`) before anyone raises: no process is left
waiting in a collective that the others abandoned.

Process 0 is the primary: it alone writes manifests, commit markers and catalog rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np
from absl import logging

T = TypeVar("T")


class MultihostError(RuntimeError):
    """Another process failed a step that every process had to pass."""


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    """How this process joins the others (`--distributed`, `--coordinator_address`, ...).

    With `coordinator_address` empty and `enabled`, JAX detects the cluster itself (TPU VMs,
    GKE, SLURM). On CPU the collectives are gloo's.
    """

    enabled: bool = False
    coordinator_address: str = ""
    num_processes: int = 0  # 0: detected
    process_id: int = -1  # -1: detected
    initialization_timeout_s: int = 300


_initialized = False


def initialize(spec: DistributedSpec) -> None:
    """`jax.distributed.initialize` once, before any computation; a no-op when not enabled."""
    global _initialized
    if not spec.enabled or _initialized:
        return
    # CPU processes exchange data through gloo; harmless where the backend is not CPU.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {}
    if spec.coordinator_address:
        kwargs["coordinator_address"] = spec.coordinator_address
    if spec.num_processes:
        kwargs["num_processes"] = spec.num_processes
    if spec.process_id >= 0:
        kwargs["process_id"] = spec.process_id
    jax.distributed.initialize(initialization_timeout=spec.initialization_timeout_s, **kwargs)
    _initialized = True
    logging.info(
        "joined %d processes as process %d (%d local / %d global devices)",
        jax.process_count(),
        jax.process_index(),
        jax.local_device_count(),
        jax.device_count(),
    )


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_primary() -> bool:
    return jax.process_index() == 0


def allgather(local: np.ndarray) -> np.ndarray:
    """`local` from every process, stacked: shape [process_count, *local.shape]."""
    local = np.asarray(local)
    if not is_multiprocess():
        return local[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(local, tiled=False))


def broadcast_int(value: int) -> int:
    """Process 0's `value` on every process (a uint32)."""
    if not is_multiprocess():
        return int(value)
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.uint32(value)))


def agree(what: str, fn: Callable[[], T], *, error: type[Exception] = MultihostError) -> T:
    """Runs `fn` on every process; all of them succeed, or all of them raise.

    The process whose `fn` failed re-raises its own exception; the others raise `error` naming
    it, so every process reaches the same verdict without waiting on a dead collective.
    """
    try:
        result, failure = fn(), None
    except Exception as e:  # re-raised below, after the others have heard of it
        result, failure = None, e
    if not is_multiprocess():
        if failure is not None:
            raise failure
        return result
    failed = np.flatnonzero(allgather(np.int32(failure is not None)))
    if failure is not None:
        raise failure
    if failed.size:
        raise error(f"{what}: process {int(failed[0])} failed (its log says why)")
    return result


def on_primary(what: str, fn: Callable[[], T], *, error: type[Exception] = MultihostError):
    """Runs `fn` on process 0 only; every process learns whether it succeeded.

    Returns `fn`'s result on process 0 and None elsewhere.
    """
    return agree(what, fn if is_primary() else (lambda: None), error=error)


def host_value(x) -> np.ndarray:
    """A global array's whole value on this host (an all-gather when it spans processes)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
