"""Mesh axes, logical-axis rules and the only place that builds a `PartitionSpec`.

Every array in kvgraft_jax is described by a tuple of *logical* axes (`batch`, `kv_heads`, ...).
`LOGICAL_RULES` maps each logical axis to the mesh axis it may be sharded over; trying another
sharding means editing that mapping, nothing else. A logical axis whose size the mesh axis does not
divide stays replicated, and `ShardingPlan.replicated` records it so that startup can log it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA = "data"
MODEL = "model"
MESH_AXES = (DATA, MODEL)

# Logical axes.
BATCH = "batch"
CACHE_SEQ = "cache_seq"
SEQ = "seq"
KV_HEADS = "kv_heads"
HEADS = "heads"
HEAD_DIM = "head_dim"
EMBED = "embed"
MLP = "mlp"
VOCAB = "vocab"
STACK = "stack"  # the leading 2 or 3 of fused q/k/v and gating weights
NORM = "norm"

LOGICAL_RULES: Mapping[str, str | None] = {
    BATCH: DATA,
    KV_HEADS: MODEL,
    HEADS: MODEL,
    MLP: MODEL,
    VOCAB: MODEL,
    CACHE_SEQ: None,
    SEQ: None,
    HEAD_DIM: None,
    EMBED: None,
    STACK: None,
    NORM: None,
}


class MeshSpecError(ValueError):
    """A `--mesh` value that cannot describe a mesh on the devices at hand."""


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Mesh shape as plain values (JSON-serialisable; a live `Mesh` never goes into a config)."""

    data: int = 1
    model: int = 1

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data, self.model)

    @property
    def num_devices(self) -> int:
        return self.data * self.model

    def __str__(self) -> str:
        return f"{DATA}:{self.data},{MODEL}:{self.model}"

    @classmethod
    def parse(cls, text: str, *, num_devices: int | None = None) -> MeshSpec:
        """Parses `data:2,model:4`. An empty string puts all devices on `model`; `-1` fills."""
        if num_devices is None:
            num_devices = jax.device_count()
        text = text.strip()
        if not text:
            return cls(data=1, model=num_devices)
        sizes: dict[str, int] = {}
        for part in text.split(","):
            name, sep, value = part.strip().partition(":")
            if not sep or name not in MESH_AXES:
                raise MeshSpecError(
                    f"--mesh: expected entries like 'data:2,model:4' with axes {MESH_AXES}, got {part!r}"
                )
            if name in sizes:
                raise MeshSpecError(f"--mesh: axis {name!r} given twice in {text!r}")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise MeshSpecError(
                    f"--mesh: size of {name!r} must be an integer, got {value!r}"
                ) from None
        fills = [n for n, s in sizes.items() if s == -1]
        if len(fills) > 1:
            raise MeshSpecError(f"--mesh: at most one axis may be -1, got {text!r}")
        if any(s < 1 and s != -1 for s in sizes.values()):
            raise MeshSpecError(f"--mesh: sizes must be positive (or one -1), got {text!r}")
        if fills:
            known = math.prod(s for s in sizes.values() if s != -1)
            if num_devices % known:
                raise MeshSpecError(f"--mesh: {num_devices} devices cannot fill {text!r}")
            sizes[fills[0]] = num_devices // known
        spec = cls(data=sizes.get(DATA, 1), model=sizes.get(MODEL, 1))
        if spec.num_devices > num_devices:
            raise MeshSpecError(
                f"--mesh={text} needs {spec.num_devices} devices, only {num_devices} are visible "
                "(on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)"
            )
        return spec


def make_mesh(spec: MeshSpec, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh over the first `spec.num_devices` devices."""
    if devices is None:
        devices = jax.devices()
    if spec.num_devices > len(devices):
        raise MeshSpecError(f"mesh {spec} needs {spec.num_devices} devices, got {len(devices)}")
    grid = np.asarray(list(devices)[: spec.num_devices], dtype=object).reshape(spec.shape)
    return Mesh(grid, MESH_AXES)


@dataclasses.dataclass(frozen=True)
class Replicated:
    """A logical axis that a rule would shard but the mesh axis does not divide."""

    array: str
    logical_axis: str
    size: int
    mesh_axis: str
    mesh_size: int
    nbytes: int


def logical_to_spec(
    logical_axes: Sequence[str],
    shape: Sequence[int],
    mesh: Mesh,
    *,
    rules: Mapping[str, str | None] = LOGICAL_RULES,
    name: str = "",
    nbytes: int = 0,
    replicated: list[Replicated] | None = None,
) -> PartitionSpec:
    """The `PartitionSpec` for an array with these logical axes on `mesh`.

    Refuses a mapping that would use one mesh axis twice. A rule whose mesh axis does not divide the
    dimension is dropped (that dimension replicated) and appended to `replicated`, when given.
    """
    if len(logical_axes) != len(shape):
        raise ValueError(
            f"{name or 'array'}: logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}"
        )
    used: set[str] = set()
    spec: list[str | None] = []
    for axis, size in zip(logical_axes, shape, strict=True):
        if axis not in rules:
            raise KeyError(f"{name or 'array'}: no sharding rule for logical axis {axis!r}")
        mesh_axis = rules[axis]
        if mesh_axis is None:
            spec.append(None)
            continue
        if mesh_axis in used:
            raise ValueError(
                f"{name or 'array'}: logical axes {tuple(logical_axes)} map mesh axis {mesh_axis!r} twice"
            )
        mesh_size = mesh.shape[mesh_axis]
        if mesh_size == 1:
            spec.append(None)
        elif size % mesh_size == 0:
            spec.append(mesh_axis)
            used.add(mesh_axis)
        else:
            spec.append(None)
            if replicated is not None:
                replicated.append(Replicated(name, axis, size, mesh_axis, mesh_size, nbytes))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def named_sharding(
    mesh: Mesh,
    logical_axes: Sequence[str],
    shape: Sequence[int],
    *,
    name: str = "",
    nbytes: int = 0,
    replicated: list[Replicated] | None = None,
) -> NamedSharding:
    spec = logical_to_spec(
        logical_axes, shape, mesh, name=name, nbytes=nbytes, replicated=replicated
    )
    return NamedSharding(mesh, spec)


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def describe_replicated(entries: Sequence[Replicated]) -> list[str]:
    """One line per logical axis left replicated, largest first, for the startup log."""
    groups: dict[tuple[str, int, str, int], list[Replicated]] = {}
    for entry in entries:
        groups.setdefault(
            (entry.logical_axis, entry.size, entry.mesh_axis, entry.mesh_size), []
        ).append(entry)
    lines = []
    for (axis, size, mesh_axis, mesh_size), group in sorted(
        groups.items(), key=lambda kv: -sum(e.nbytes for e in kv[1])
    ):
        nbytes = sum(e.nbytes for e in group)
        lines.append(
            f"replicated: logical axis {axis!r} (size {size}) is not divisible by mesh axis "
            f"{mesh_axis}={mesh_size}: {len(group)} arrays, {nbytes / 2**20:.1f} MiB held whole on "
            f"every device (largest: {max(group, key=lambda e: e.nbytes).array})"
        )
    return lines
