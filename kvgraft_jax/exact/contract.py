"""The exactness contract: every setting that changes a prefix's bits, compared with a run's own.

A grafted decode is claimed bit-identical to a recompute only when the recompute is the same
computation as the deposit's. These are the settings that decide that, each recorded in the
manifest and compared here, term by term, so that verify can say which it matched:

| term | recorded in | a mismatch means |
| --- | --- | --- |
| model (name, config, weights fingerprint) | `model` | refused before any read |
| tokenizer fingerprint | `tokenizer` | refused before any read |
| cache dtype | `protocol.cache_dtype` | refused |
| batch size | `protocol.batch_size` | the engine is built with the artifact's |
| token ids | `token_ids` | replayed from the manifest: always the same |
| chunk schedule | `protocol.chunk_size`, `protocol.schedule` | replayed, and the replay checked |
| positions | `first_position` .. `last_position` | refused, or relocated and labelled approximate (r) |
| attention | `protocol.attention` | reference (c): a different computation |
| jax, jaxlib, backend | `protocol.versions` | reference (c) |
| XLA flags | `protocol.xla_flags` (less the forced device count) | reference (c) |
| mesh | `protocol.mesh` | reference (b) where the deposit mesh can be built here, else (c) |

Not in the contract, because it does not change a bit: the cache length (attention visits whole
blocks of positions in a fixed order, `kvgraft_jax.core.attention`; tested on the real 270M with
deposit and verify in separate runs), where the artifact is stored or restored, and the mesh it is
restored onto (restore is pure data movement; only the mesh that *computes* is a term).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvgraft_jax.core import environment, xla_flags
from kvgraft_jax.store import chain


@dataclasses.dataclass(frozen=True)
class Term:
    """One setting of the contract: the artifact's value (every link's), this run's, the verdict."""

    name: str
    deposited: str
    here: str
    matched: bool
    if_not: str  # what a mismatch means for the claim


def _values(links: Sequence[chain.Link], get) -> str:
    return " | ".join(dict.fromkeys(str(get(link.manifest)) for link in links))


def compare(
    links: Sequence[chain.Link],
    *,
    attention: str,
    batch_size: int,
    cache_dtype: str,
    run_mesh: str,
    relocated_by: int,
    model_fingerprint: str,
    tokenizer_fingerprint: str | None,
) -> list[Term]:
    """Every term for a graft of `links` (root first) into a run with these settings."""
    now, flags = environment.versions(), environment.xla_flags()

    def term(name, get, here, if_not, *, same=None) -> Term:
        deposited = _values(links, get)
        matched = all(str(get(link.manifest)) == str(here) for link in links)
        return Term(name, deposited, str(here), matched if same is None else same, if_not)

    schedules = _values(links, lambda m: m.protocol.schedule)
    terms = [
        term("model", lambda m: m.model.fingerprint, model_fingerprint, "refused"),
        term(
            "tokenizer",
            lambda m: m.tokenizer.fingerprint if m.tokenizer else None,
            tokenizer_fingerprint,
            "refused",
        ),
        term("cache dtype", lambda m: m.protocol.cache_dtype, cache_dtype, "refused"),
        term("batch size", lambda m: m.protocol.batch_size, batch_size, "refused"),
        Term("chunk schedule", schedules, f"replayed: {schedules}", True, "replayed"),
        term(
            "positions",
            lambda m: f"{m.first_position}..{m.last_position}",
            _shifted(links, relocated_by),
            "relocated: approximate (r)",
        ),
        term("attention", lambda m: m.protocol.attention, attention, "reference c"),
    ]
    for key in ("jax", "jaxlib", "backend"):
        terms.append(
            term(key, lambda m, k=key: m.protocol.versions.get(k), now[key], "reference c")
        )
    terms.append(
        term(
            "XLA flags",
            lambda m: repr(xla_flags.normalize(m.protocol.xla_flags)),
            repr(flags),
            "reference c",
        )
    )
    terms.append(term("mesh", lambda m: m.protocol.mesh, run_mesh, "reference b, else c"))
    return terms


def _shifted(links: Sequence[chain.Link], by: int) -> str:
    """The positions each link occupies in this run (its own unless relocated)."""
    return " | ".join(
        dict.fromkeys(
            f"{link.manifest.first_position + by}..{link.manifest.last_position + by}"
            for link in links
        )
    )


def drift_notes(terms: Sequence[Term]) -> list[str]:
    """Why a recompute here is not the deposit's computation (terms whose mismatch means (c))."""
    return [
        f"{t.name} differs (artifact {t.deposited}, this run {t.here}): the prefix computation "
        "may differ; state exactness still holds"
        for t in terms
        if not t.matched and t.if_not == "reference c"
    ]


def choose_reference(
    terms: Sequence[Term], *, exact: bool, notes: Sequence[str], deposit_mesh_buildable: bool
) -> str:
    """The strongest reference this run can compute: a (same computation here), b (the deposit's
    mesh, then the state moved here), c (a recompute here, not proven), r (relocated)."""
    if not exact:
        return "r"
    if notes:
        return "c"
    (mesh,) = [t for t in terms if t.name == "mesh"]
    if mesh.matched:
        return "a"
    return "b" if deposit_mesh_buildable else "c"
