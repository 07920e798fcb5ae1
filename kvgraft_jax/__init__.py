"""kvgraft_jax: byte-exact KV-cache grafting for Gemma 3 on JAX.

The public API, one name per concept (see the README's "Python API"):

    import kvgraft_jax as kv

    mesh = kv.make_mesh(kv.MeshSpec(data=2, model=4))
    eng = kv.Engine(kv.build_model("tiny"), params, mesh, batch_size=2, cache_length=128)
    result = kv.deposit(eng, ids, chunk_size=16, path="runs/doc", model=..., tokenizer=...,
                        versions=kv.versions())
    grafted = kv.graft(eng, "runs/doc", query_ids, max_new_tokens=8)
    kv.compare(grafted.run, kv.recompute(eng, grafted.links, query_ids, max_new_tokens=8))

Names load on first use, so `import kvgraft_jax` does not start JAX (the CLI sets XLA flags
first). The sub-packages draw the architecture, each importing only those before it:
`core` (model, KV state, engine, digests) -> `store` (artifacts on disk) -> `exact` (deposit,
graft, the contract) -> `library` (verifiers, catalog, flywheel); `run` (settings to live objects),
`bench` and `cli` on top.
"""

from __future__ import annotations

import importlib

# Load Python's SQLite (and the system libsqlite3 it links) before anything imports TensorFlow:
# TensorFlow loads its own SQLite build, without FTS5, into the global symbol scope, and a
# `sqlite3` first imported after that binds to it. The library catalog needs FTS5.
import sqlite3 as _sqlite3  # noqa: F401

_EXPORTS = {
    # the model and its KV state
    "MeshSpec": "core.sharding",
    "make_mesh": "core.sharding",
    "build_model": "core.model",
    "init_random_params": "core.model",
    "load_checkpoint_params": "core.model",
    "load_hf_checkpoint": "core.hf_checkpoint",
    "write_hf_checkpoint": "core.hf_checkpoint",
    "weights_fingerprint": "core.model",
    "describe_model": "core.model",
    "Tokenizer": "core.tokenizer",
    "KVState": "core.kvstate",
    "Engine": "core.engine",
    "versions": "core.environment",
    "bits_equal": "core.bits",
    # artifacts on disk
    "Manifest": "store.manifest",
    "Expected": "store.manifest",
    "read_manifest": "store.manifest",
    "resolve_chain": "store.chain",
    "restore": "store.restore",
    "Restored": "store.restore",
    "ArtifactError": "store.errors",
    "CorruptArtifactError": "store.errors",
    "IncompatibleArtifactError": "store.errors",
    "UntrustedArtifactError": "store.errors",
    "load_signer": "store.signing",
    "load_trusted": "store.signing",
    # the exactness protocol
    "deposit": "exact.deposit",
    "graft": "exact.graft",
    "recompute": "exact.graft",
    "compare": "exact.graft",
    "BatchItem": "exact.batch",
    "batch_engine": "exact.batch",
    "batch_cache_length": "exact.batch",
    "run_batch": "exact.batch",
    "grafted_prefixes": "exact.batch",
    "recomputed_prefixes": "exact.batch",
    "compare_batches": "exact.batch",
    # verified knowledge
    "Library": "library.library",
    "VerifiedItem": "library.library",
    # a run from settings
    "RunConfig": "run.config",
    "build_mesh": "run.runtime",
    "load_model": "run.runtime",
    "load_tokenizer": "run.runtime",
}
_RENAMED = {  # module-level names
    "load_hf_checkpoint": "load",
    "write_hf_checkpoint": "write",
    "batch_cache_length": "cache_length",
    "run_batch": "run",
    "grafted_prefixes": "grafted",
    "recomputed_prefixes": "recomputed",
    "compare_batches": "compare",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvgraft_jax' has no attribute {name!r}")
    module = importlib.import_module(f"kvgraft_jax.{_EXPORTS[name]}")
    value = getattr(module, _RENAMED.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
