"""Forces 8 host devices before JAX is imported, and provides the tiny model on a few meshes."""

import os

from kvgraft_jax.core import xla_flags  # stdlib only: JAX is not imported yet

os.environ["XLA_FLAGS"] = xla_flags.with_collective_timeouts(
    (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib
import json
import signal
import subprocess

import jax
import pytest

from kvgraft_jax.core import model, sharding

MESHES = {
    "1": sharding.MeshSpec(data=1, model=1),
    "8": sharding.MeshSpec(data=1, model=8),
    "2x4": sharding.MeshSpec(data=2, model=4),
    "4x2": sharding.MeshSpec(data=4, model=2),
}


def pytest_configure(config):
    assert jax.device_count() == 8, (
        "tests need 8 forced host devices; is JAX imported before conftest?"
    )


@pytest.fixture(scope="session")
def tiny_model():
    return model.build_model("tiny")


@pytest.fixture(scope="session")
def tiny_params_on():
    """Returns `(mesh, params)` for a mesh name, cached across the session."""
    cache = {}

    def get(mesh_name: str, name: str = "tiny", seed: int = 0):
        key = (mesh_name, name, seed)
        if key not in cache:
            mesh = sharding.make_mesh(MESHES[mesh_name])
            params, _ = model.init_random_params(model.build_model(name), seed=seed, mesh=mesh)
            cache[key] = (mesh, params)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def gemma3_270m_gguf(tmp_path_factory):
    """`(gguf path, cache root, Conversion)` of the embedded 270M, converted once per session."""
    from kvgraft_jax.core import gguf_import

    root = tmp_path_factory.mktemp("gguf_cache")
    path = gguf_import.embedded_gguf()
    name = "gemma3_270m"
    return (
        path,
        root,
        gguf_import.prepare(path, model.build_model(name), model_name=name, root=root),
    )


def kill_at_pause_point(argv, *, env, stage: str, cwd) -> None:
    """Runs argv until it reports pausing at `stage` (faults.pause_point), then SIGKILLs it."""
    env = dict(env, KVGRAFT_FAULT_PAUSE_AT=stage)
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"KVGRAFT_PAUSED {stage}"), line
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def reseal(path, **changes):
    """Rewrites an artifact's manifest and its commit marker as a forger would: the manifest's
    own SHA-256 in the marker stays consistent, so only the invariants can refuse it."""
    from kvgraft_jax.store import files
    from kvgraft_jax.store import manifest as manifest_lib

    data = json.loads((path / files.MANIFEST).read_text())
    data.update(changes)
    (path / files.MANIFEST).write_text(json.dumps(data))
    marker = json.loads((path / files.COMMIT_MARKER).read_text())
    marker["manifest_sha256"] = manifest_lib.Manifest.from_json(data).sha256()
    (path / files.COMMIT_MARKER).write_text(json.dumps(marker))


@contextlib.contextmanager
def compiles():
    """The XLA compilations inside the block, as a list of their durations (jax's listener)."""
    compiled = []

    def listen(event, duration_secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(duration_secs)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
