"""Deposit: prefill a text with a recorded chunk schedule and persist the KV state as an artifact.

    from kvgraft_jax.exact import deposit
    result = deposit.deposit(
        engine, ids, chunk_size=64, path="runs/doc", model=..., tokenizer=..., versions=...
    )
    result.root  # the Merkle root of the state; the same bytes give the same root on any mesh

`--mode=deposit` (`modes.run_deposit`) is this call with the flags' engine, schedule and paths.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import time
from collections.abc import Callable

import numpy as np
from etils import epath
from gemma import gm

from kvgraft_jax.core import compaction as compaction_lib
from kvgraft_jax.core import engine as engine_lib
from kvgraft_jax.core import environment, kvstate, sharding
from kvgraft_jax.core import model as model_lib
from kvgraft_jax.core import tokenizer as tokenizer_lib
from kvgraft_jax.store import chain as chain_lib
from kvgraft_jax.store import layout, signing, writer
from kvgraft_jax.store import manifest as manifest_lib


@dataclasses.dataclass(frozen=True)
class DepositResult:
    path: epath.Path
    root: str
    manifest: manifest_lib.Manifest
    state: kvstate.KVState  # the prefill's state sliced to the new positions (before compaction)
    prefill_s: float
    digest_s: float
    write_s: float


def deposit(
    eng: engine_lib.Engine,
    token_ids: np.ndarray,
    *,
    chunk_size: int,
    path: str | os.PathLike | Callable[[str], str | os.PathLike],
    model: model_lib.ModelInfo,
    tokenizer: tokenizer_lib.TokenizerInfo | None,
    versions: dict[str, str],
    text: str = "",
    source: str = "",
    parent: str | os.PathLike | None = None,
    overwrite: bool = False,
    compact: bool = False,
    knowledge: manifest_lib.Knowledge | None = None,
    progress=None,
    signer: signing.Signer | None = None,
) -> DepositResult:
    """Prefills `token_ids` from position 0 and writes the artifact at `path`.

    With `parent` (an artifact directory), the parent's chain is restored (verified) into the
    engine, `token_ids` are prefilled after it, and only the new positions are written; the
    manifest names the parent's root. Grafting parent then child is bit-identical to depositing
    the whole text at once with the same chunk schedule.

    With `compact`, local (sliding-window) layers store only their last `window` positions
    (`compaction_lib.Compaction`); `DepositResult.state` stays the full state the prefill computed.

    `path` may be a function of the root digest (a library names artifacts by their root); a
    relative parent hint is then computed against the final path.
    """
    ids = np.asarray(token_ids, np.int32)
    if ids.ndim == 1:
        ids = ids[None, :]
    if eng.position_offset:
        raise engine_lib.EngineError(
            "deposit computes at own positions: use an engine without offset"
        )
    start, parent_root, parent_path = 0, None, None
    if parent is None:
        state = eng.empty_state()
    else:
        from kvgraft_jax.exact import graft  # deposit needs graft only to extend a chain

        expected = manifest_lib.Expected.of(model, tokenizer, cache_dtype=eng.kv_shape.dtype)
        prefix = graft.load_prefix(eng, parent, expected=expected)
        state, start = prefix.state, prefix.state.length
        parent_root = prefix.manifest.root
    pre = eng.prefill(state, ids, chunk_size=chunk_size, progress=progress)
    state = writer.used_slice(pre.state, eng.mesh, start=start)
    compaction = None
    stored = state
    if compact:
        config = eng.config
        compaction = compaction_lib.Compaction.for_state(
            state.length,
            window=config.sliding_window_size,
            local_layers=[
                i
                for i, kind in enumerate(config.attention_types)
                if kind == gm.nn.AttentionType.LOCAL_SLIDING
            ],
        )
        stored = compaction_lib.compact(state, compaction, eng.mesh)
    started = time.perf_counter()
    digests, root = layout.digest_state(stored)
    digest_s = time.perf_counter() - started
    if callable(path):
        path = path(root)
    if parent is not None:
        parent_path = chain_lib.parent_hint(path, parent)
    manifest = manifest_lib.Manifest(
        format=manifest_lib.FORMAT,
        model=model,
        tokenizer=tokenizer,
        token_ids=ids.tolist(),
        first_position=start,
        last_position=start + state.length - 1,
        length=state.length,
        parent=parent_root,
        protocol=manifest_lib.Protocol(
            chunk_size=chunk_size,
            schedule=[[c.start, c.length] for c in pre.schedule],
            batch_size=eng.kv_shape.batch_size,
            cache_dtype=eng.kv_shape.dtype,
            attention=eng.attention,
            mesh=str(sharding.MeshSpec(**dict(eng.mesh.shape))),
            versions=versions,
            xla_flags=environment.xla_flags(),
        ),
        arrays=layout.array_entries(stored, digests),
        root=root,
        files=[],  # filled by writer.write once the state files exist
        provenance=manifest_lib.Provenance(
            text_sha256=hashlib.sha256(text.encode()).hexdigest(),
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            source=source,
        ),
        parent_path=parent_path,
        compaction=compaction,
        knowledge=knowledge,
    )
    started = time.perf_counter()
    written = writer.write(path, stored, manifest, overwrite=overwrite, signer=signer)
    write_s = time.perf_counter() - started
    committed = manifest_lib.read_manifest(written)
    return DepositResult(written, committed.root, committed, state, pre.seconds, digest_s, write_s)
