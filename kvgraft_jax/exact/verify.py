"""Verify a graft: choose the strongest reference this run can compute, run it, compare every step.

The references, strongest first (`contract.choose_reference` picks one from the contract's terms):

- (a) the artifact's own computation here: its chunk schedule replayed on the same programs;
- (b) the prefill on the deposit's mesh, its live state moved to this mesh, then continued;
- (c) a recompute on this mesh, which is a different computation: compared, but not a proof;
- (r) a relocated graft against a recompute at the new positions: approximate by construction.

The exit code says which: 0 bit-identical against (a) or (b), 1 differs, 3 not provable here.
Beside the reference, the recompute a user would write (prefix + query as one text) is measured too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from kvgraft_jax.core import engine as engine_lib
from kvgraft_jax.core import sharding
from kvgraft_jax.exact import contract, graft


@dataclasses.dataclass(frozen=True)
class Verification:
    kind: str  # "a" | "b" | "c" | "r"
    reference: str  # what the reference computed, in words
    deposit_meshes: list[str]
    run_mesh: str
    comparison: graft.Comparison
    terms: list[contract.Term]
    natural: dict[str, Any] | None  # the recompute a user would write, against the graft
    notes: list[str]

    @property
    def exit_code(self) -> int:
        """0 proven bit-identical, 1 differs from a reference that should match, 3 not provable."""
        if self.kind in ("c", "r"):
            return 3
        return 0 if self.comparison.bit_identical else 1


def verify(
    eng: engine_lib.Engine,
    grafted: graft.Grafted,
    query: np.ndarray,
    *,
    max_new_tokens: int,
    model_fingerprint: str,
    tokenizer_fingerprint: str | None,
    engine_on: Callable[[Mesh], engine_lib.Engine],
) -> Verification:
    """Compares `grafted` (made on `eng`) with the strongest reference. `engine_on(mesh)` builds an
    engine like `eng`, with the same weights, on the deposit's mesh, for reference (b)."""
    links, new = grafted.links, max_new_tokens
    run_mesh = str(sharding.MeshSpec(**dict(eng.mesh.shape)))
    deposit_meshes = sorted({link.manifest.protocol.mesh for link in links})
    terms = contract.compare(
        links,
        attention=eng.attention,
        batch_size=eng.kv_shape.batch_size,
        cache_dtype=eng.kv_shape.dtype,
        run_mesh=run_mesh,
        relocated_by=grafted.prefix.relocated_by,
        model_fingerprint=model_fingerprint,
        tokenizer_fingerprint=tokenizer_fingerprint,
    )
    notes = contract.drift_notes(terms)
    deposit_spec = None
    if len(deposit_meshes) == 1:
        try:
            deposit_spec = sharding.MeshSpec.parse(
                deposit_meshes[0], num_devices=jax.device_count()
            )
        except sharding.MeshSpecError:
            notes.append(
                f"the deposit mesh {deposit_meshes[0]} cannot be built from {jax.device_count()} devices"
            )
    else:
        notes.append(f"the chain's links were deposited on different meshes {deposit_meshes}")
    kind = contract.choose_reference(
        terms, exact=grafted.exact, notes=notes, deposit_mesh_buildable=deposit_spec is not None
    )
    if kind == "b":
        source = engine_on(sharding.make_mesh(deposit_spec))
        reference = graft.prefill_elsewhere_then_continue(
            source, eng, links, query, max_new_tokens=new
        )
    else:
        reference = graft.recompute(eng, links, query, max_new_tokens=new)
    labels = {
        "a": "a: recompute replaying the artifact's schedule on the deposit mesh, same programs",
        "b": f"b: prefill on the deposit mesh {deposit_meshes[0]}, reshard the live state to {run_mesh}, continue",
        "c": f"c: recompute on {run_mesh} (a different computation: not proven here)",
        "r": f"r: recompute at the new positions on {run_mesh} (relocated graft: approximate)",
    }
    comparison = graft.compare(grafted.run, reference)
    return Verification(
        kind=kind,
        reference=labels[kind],
        deposit_meshes=deposit_meshes,
        run_mesh=run_mesh,
        comparison=comparison,
        terms=list(terms),
        natural=natural_reference(eng, grafted, query, kind, comparison, new),
        notes=notes,
    )


def natural_reference(eng, grafted, query, kind, verdict, new) -> dict[str, Any] | None:
    """The recompute a user would write: prefix + query as one text, prefilled on this engine (this
    mesh, this cache) in chunks of the artifact's size from position 0, then decoded."""
    if kind == "r":
        return None
    links = grafted.links
    chunk = links[-1].manifest.protocol.chunk_size
    ids = np.concatenate([np.asarray(link.manifest.token_ids, np.int32) for link in links], axis=-1)
    text = np.concatenate([ids, query], axis=-1)
    schedule = engine_lib.chunk_schedule(text.shape[-1], chunk)
    replayed = [c for link in links for c in link.manifest.protocol.schedule]
    replayed += [[c.start, c.length] for c in grafted.run.query_schedule]
    same_schedule = [[c.start, c.length] for c in schedule] == replayed
    described = {
        "computation": "prefix + query prefilled as one text on this run's engine, then decoded",
        "mesh": str(sharding.MeshSpec(**dict(eng.mesh.shape))),
        "cache_slots": eng.kv_shape.cache_length,
        "chunk_size": chunk,
        "same_schedule_as_graft": same_schedule,
    }
    if same_schedule and kind in ("a", "c"):
        # Literally the reference's computation: same programs, same chunks, same inputs.
        return described | {
            "same_computation_as_reference": True,
            "bit_identical": verdict.bit_identical,
            "argmax_agreement": verdict.argmax_agreement,
            "max_abs_logit_diff": verdict.max_abs_logit_diff,
        }
    run = graft.continue_from(
        eng,
        eng.empty_state(),
        text,
        chunk_size=chunk,
        max_new_tokens=new,
        dropped=graft.Dropped.of(links),
    )
    measured = graft.compare(grafted.run, run)
    return described | {
        "same_computation_as_reference": False,
        "bit_identical": measured.bit_identical,
        "argmax_agreement": measured.argmax_agreement,
        "max_abs_logit_diff": measured.max_abs_logit_diff,
    }
