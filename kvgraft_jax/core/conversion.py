"""The content-keyed cache of converted weights: for sources whose conversion costs real time.

    found = conversion.find(root, source_sha256, module.config, fmt="kvgraft-gguf-conversion/2")
    params, plan, fingerprint = conversion.load_params(found, module, mesh)

A GGUF file (parsed, dequantized, remapped: ~15 s for the 270M) is converted once into gemma's
parameter tree and written here as an Orbax checkpoint beside the tokenizer's `.model` file and a
`conversion.json`, committed by a rename. (Hugging Face checkpoints are read directly instead:
their conversion is a change of layout during the read, and a cache measured slower on a hit;
see `hf_checkpoint`.) The key is the SHA-256
of the source's bytes plus a digest of the gemma config, so the same numbers in the same file
reuse one conversion and a changed byte converts again. Loading restores straight into the mesh's
shardings and re-hashes the parameters: a damaged cache is refused, never used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from gemma import gm
from jax.sharding import Mesh

from kvgraft_jax.core import atomic
from kvgraft_jax.core import model as model_lib

CACHE_ENV = "KVGRAFT_CACHE_DIR"


class WeightsError(ValueError):
    """Weights this run cannot use: unreadable, of another model, or a damaged conversion."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvgraft_jax")


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Conversion:
    """A committed conversion of one weight source for one gemma config."""

    directory: Path
    source_sha256: str  # SHA-256 of the source's bytes
    params_sha256: str  # model.weights_fingerprint of the converted params
    convert_s: float  # seconds this call spent converting (0.0 when the cache was hit)

    def tokenizer_proto(self) -> bytes:
        return (self.directory / "tokenizer.model").read_bytes()


def target(root: Path | None, source_sha256: str, config) -> Path:
    """Where the conversion of these bytes for this config lives."""
    config_sha = hashlib.sha256(
        json.dumps(model_lib.config_to_json(config), sort_keys=True).encode()
    ).hexdigest()
    return (root or cache_dir()) / f"{source_sha256[:32]}-{config_sha[:12]}"


def find(root: Path | None, source_sha256: str, config, *, fmt: str) -> Conversion | None:
    """The committed conversion of these bytes, or None when there is none yet."""
    where = target(root, source_sha256, config)
    meta_path = where / "conversion.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    if meta.get("format") != fmt or meta.get("source_sha256") != source_sha256:
        return None
    return Conversion(where, source_sha256, meta["params_sha256"], 0.0)


def commit(
    root: Path | None,
    source_sha256: str,
    config,
    *,
    params: Any,
    tokenizer_proto: bytes,
    meta: dict[str, Any],
    convert_s: float,
) -> Conversion:
    """Writes params (numpy or sharded jax arrays), the tokenizer and `meta`, all or nothing."""
    where = target(root, source_sha256, config)
    fingerprint = model_lib.weights_fingerprint(config, params)
    with atomic.staged_directory(
        where, accept_existing=lambda t: (t / "conversion.json").is_file()
    ) as staging:
        ocp.PyTreeCheckpointer().save(staging / "params", params)
        (staging / "tokenizer.model").write_bytes(tokenizer_proto)
        record = {**meta, "source_sha256": source_sha256, "params_sha256": fingerprint}
        (staging / "conversion.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    return Conversion(where, source_sha256, fingerprint, convert_s)


def load_params(conversion: Conversion, module: gm.nn.Transformer, mesh: Mesh):
    """The converted parameters restored straight into their shardings on `mesh`, checked."""
    abstract = model_lib.abstract_params(module)
    plan = model_lib.param_plan(abstract, module.config, mesh)
    wanted = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, plan.shardings
    )
    params = ocp.PyTreeCheckpointer().restore(
        conversion.directory / "params",
        args=ocp.args.PyTreeRestore(
            item=wanted, restore_args=ocp.checkpoint_utils.construct_restore_args(wanted)
        ),
    )
    fingerprint = model_lib.weights_fingerprint(module.config, params)
    if fingerprint != conversion.params_sha256:
        raise WeightsError(
            f"cached conversion {conversion.directory} is damaged (parameter digest "
            f"{fingerprint[:16]} vs {conversion.params_sha256[:16]}): delete it to convert again"
        )
    return params, plan, fingerprint


def check_tree(params, abstract, *, path: str) -> None:
    """Refuses converted parameters whose paths, shapes or dtypes differ from the model's."""
    got = {p: (x.shape, x.dtype) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    want = {p: (x.shape, x.dtype) for p, x in jax.tree_util.tree_leaves_with_path(abstract)}
    if got != want:
        diff = sorted(jax.tree_util.keystr(p) for p in set(got) ^ set(want))
        bad = [jax.tree_util.keystr(p) for p in got.keys() & want.keys() if got[p] != want[p]]
        raise WeightsError(
            f"{path}: converted parameters do not fit the model: {diff[:3]} {bad[:3]}"
        )
