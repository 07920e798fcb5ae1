"""Mesh parsing and the logical-axis rules (the only PartitionSpec builder)."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from kvgraft_jax.core import sharding


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", sharding.MeshSpec(1, 8)),
        ("data:2,model:4", sharding.MeshSpec(2, 4)),
        ("model:4,data:2", sharding.MeshSpec(2, 4)),
        ("data:1,model:1", sharding.MeshSpec(1, 1)),
        ("data:4", sharding.MeshSpec(4, 1)),
        ("data:2,model:-1", sharding.MeshSpec(2, 4)),
        (" data : 2 , model:4 ".replace(" : ", ":"), sharding.MeshSpec(2, 4)),
    ],
)
def test_parse_mesh(text, expected):
    assert sharding.MeshSpec.parse(text, num_devices=8) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rows:2", "axes"),
        ("data=2", "axes"),
        ("data:two", "integer"),
        ("data:2,data:4", "twice"),
        ("data:-1,model:-1", "at most one"),
        ("data:0", "positive"),
        ("data:3,model:-1", "cannot fill"),
        ("data:4,model:4", "only 8 are visible"),
    ],
)
def test_parse_mesh_refuses_bad_specs(text, message):
    with pytest.raises(sharding.MeshSpecError, match=message):
        sharding.MeshSpec.parse(text, num_devices=8)


def test_mesh_spec_round_trips_through_its_string():
    spec = sharding.MeshSpec(2, 4)
    assert sharding.MeshSpec.parse(str(spec), num_devices=8) == spec


def test_make_mesh_uses_named_axes():
    mesh = sharding.make_mesh(sharding.MeshSpec(2, 4))
    assert mesh.axis_names == sharding.MESH_AXES
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    small = sharding.make_mesh(sharding.MeshSpec(1, 1))
    assert small.devices.size == 1 and small.devices.flat[0] == jax.devices()[0]


def test_logical_to_spec_shards_divisible_axes_and_records_the_rest():
    mesh = sharding.make_mesh(sharding.MeshSpec(2, 4))
    replicated = []
    spec = sharding.logical_to_spec(
        (sharding.BATCH, sharding.CACHE_SEQ, sharding.KV_HEADS, sharding.HEAD_DIM),
        (2, 64, 4, 32),
        mesh,
        replicated=replicated,
    )
    assert spec == P("data", None, "model")
    assert replicated == []
    spec = sharding.logical_to_spec(
        (sharding.BATCH, sharding.KV_HEADS),
        (3, 1),
        mesh,
        name="x",
        nbytes=12,
        replicated=replicated,
    )
    assert spec == P()
    assert [(r.logical_axis, r.mesh_axis) for r in replicated] == [
        ("batch", "data"),
        ("kv_heads", "model"),
    ]
    lines = sharding.describe_replicated(replicated)
    assert len(lines) == 2 and all("not divisible" in line for line in lines)


def test_logical_to_spec_refuses_collisions_and_unknown_axes():
    mesh = sharding.make_mesh(sharding.MeshSpec(2, 4))
    with pytest.raises(ValueError, match="twice"):
        sharding.logical_to_spec((sharding.HEADS, sharding.MLP), (8, 8), mesh)
    with pytest.raises(KeyError, match="no sharding rule"):
        sharding.logical_to_spec(("pixels",), (8,), mesh)
    with pytest.raises(ValueError, match="do not match"):
        sharding.logical_to_spec((sharding.BATCH,), (8, 8), mesh)


def test_size_one_mesh_axes_are_left_out_of_the_spec():
    mesh = sharding.make_mesh(sharding.MeshSpec(1, 8))
    replicated = []
    spec = sharding.logical_to_spec(
        (sharding.BATCH, sharding.VOCAB), (3, 1024), mesh, replicated=replicated
    )
    assert spec == P(None, "model")
    assert replicated == []  # batch over a size-1 data axis is not a missed opportunity
