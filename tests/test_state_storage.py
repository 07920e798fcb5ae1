"""How `state/` packs a KV state: format 2 stacks each field's layers of one shape; format 1 (one
stored array per layer and field) still restores and grafts exactly as it did."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import MESHES, reseal

from kvgraft_jax.core import bits, engine, environment, kvstate, model, sharding, tokenizer
from kvgraft_jax.exact import deposit, graft
from kvgraft_jax.store import errors, layout
from kvgraft_jax.store import files as files_lib
from kvgraft_jax.store import manifest as manifest_lib
from kvgraft_jax.store import restore as restore_lib

LENGTH, QUERY, NEW, CHUNK = 100, 12, 6, 8
WINDOW = model.TINY_CONFIGS["tiny"].sliding_window_size  # 16: layers 0-4 local, 5 global
FORMAT_1 = "kvgraft-artifact/1"


def _engine(tiny_params_on, mesh_name):
    mesh, params = tiny_params_on(mesh_name)
    return engine.Engine(
        model.build_model("tiny"), params, mesh, batch_size=1, cache_length=LENGTH + QUERY + NEW
    )


def _ids(length, seed):
    return np.random.default_rng(seed).integers(4, 1024, size=(1, length)).astype(np.int32)


@pytest.fixture(scope="module")
def compacted(tiny_params_on, tmp_path_factory):
    """A compacted deposit on (2,4): the local layers' K/V one shape, the global layer's another."""
    eng = _engine(tiny_params_on, "2x4")
    return deposit.deposit(
        eng,
        _ids(LENGTH, 0),
        chunk_size=CHUNK,
        path=tmp_path_factory.mktemp("storage") / "art",
        model=model.describe_model("tiny", eng.model, eng.params),
        tokenizer=tokenizer.tiny_tokenizer().info(),
        versions=environment.versions(),
        compact=True,
    )


def _as_format_1(src, dst):
    """`src` rewritten as the format-1 writer wrote it (kvgraft <= stop 30): the same values as
    gemma's cache tree, one stored array per layer and field, the same manifest but its format
    and file inventory, committed the same way."""
    restored = restore_lib.restore(src, sharding.make_mesh(MESHES["2x4"]), expand=False)
    values = jax.tree.map(kvstate.to_values, restored.state.layers)
    dst.mkdir()
    ocp.PyTreeCheckpointer(use_ocdbt=True, use_zarr3=True).save(
        dst / files_lib.STATE_DIR, args=ocp.args.PyTreeSave(kvstate.layers_to_gemma(values))
    )
    old = dataclasses.replace(
        restored.manifest, format=FORMAT_1, files=files_lib.file_inventory(dst)
    )
    (dst / files_lib.MANIFEST).write_text(json.dumps(old.to_json(), indent=1, sort_keys=True))
    marker = {"root": old.root, "manifest_sha256": old.sha256()}
    (dst / files_lib.COMMIT_MARKER).write_text(json.dumps(marker))
    return dst


@pytest.fixture(scope="module")
def format_1(compacted, tmp_path_factory):
    return _as_format_1(compacted.path, tmp_path_factory.mktemp("format_1") / "art")


def _copy(path, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(path, dst)
    return dst


@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")
def test_each_field_stores_one_stack_per_shape_in_layer_order(compacted):
    m = compacted.manifest
    assert m.format == manifest_lib.FORMAT and m.storage is manifest_lib.StateStorage.STACKED
    stored = ocp.PyTreeCheckpointer().restore(compacted.path / files_lib.STATE_DIR)
    shapes = {f: {key: a.shape for key, a in stacks.items()} for f, stacks in stored.items()}
    kv = (1, WINDOW, 4, 32), (1, LENGTH, 4, 32)  # tiny: 4 KV heads of 32
    assert shapes == {
        "k": {"stack_0": (5, *kv[0]), "stack_1": (1, *kv[1])},
        "v": {"stack_0": (5, *kv[0]), "stack_1": (1, *kv[1])},
        "positions": {"stack_0": (6, 1, LENGTH)},
        "end_index": {"stack_0": (6, 1)},
    }
    # Every stacked slice is that layer's stored array, bit for bit.
    entries = {a.name: (tuple(a.shape), a.dtype) for a in m.arrays}
    for s in layout.stored_arrays(entries, manifest_lib.StateStorage.STACKED):
        stack = np.asarray(stored[s.group][s.key])
        for j, name in enumerate(s.names):
            layer, field = int(name.split("/")[0].removeprefix("layer_")), name.split("/")[1]
            want = np.asarray(getattr(compacted.state.layers[layer], field))
            if field in ("k", "v") and layer < 5:
                want = want[:, LENGTH - WINDOW :]  # compacted: the last window only
            got = stack[j].view(np.uint16) if field in ("k", "v") else stack[j]
            assert np.array_equal(got, want), name


def test_a_format_1_artifact_restores_and_grafts_as_it_did(tiny_params_on, compacted, format_1):
    """Format 1's state holds gemma's cache tree; its restore onto another mesh is bit-identical
    to format 2's, and so is a graft from it."""
    tree = json.loads((format_1 / files_lib.STATE_DIR / "_METADATA").read_text())["tree_metadata"]
    assert len(tree) == 6 * 4 and "('layer_5', 'k')" in tree
    mesh = sharding.make_mesh(MESHES["4x2"])
    new, old = (restore_lib.restore(p, mesh) for p in (compacted.path, format_1))
    assert old.manifest.storage is manifest_lib.StateStorage.PER_LAYER
    assert old.root == new.root == compacted.root
    for a, b in zip(
        jax.tree.leaves(old.state.layers), jax.tree.leaves(new.state.layers), strict=True
    ):
        assert a.sharding == b.sharding and bits.sha256(a) == bits.sha256(b)
    eng = _engine(tiny_params_on, "4x2")
    query = _ids(QUERY, 1)
    from_new = graft.graft(eng, compacted.path, query, max_new_tokens=NEW)
    from_old = graft.graft(eng, format_1, query, max_new_tokens=NEW)
    assert graft.compare(from_old.run, from_new.run).bit_identical


@pytest.mark.parametrize(
    ("which", "claims", "missing"),
    [("format_2", FORMAT_1, "layer_0/k"), ("format_1", manifest_lib.FORMAT, "k.stack_0")],
)
def test_a_manifest_that_claims_the_other_packing_is_refused(
    compacted, format_1, tmp_path, which, claims, missing
):
    """A forger who rewrites the format (and reseals) gets a refusal naming the missing array,
    before any state byte is read."""
    art = _copy(compacted.path if which == "format_2" else format_1, tmp_path, "art")
    reseal(art, format=claims)
    with pytest.raises(errors.CorruptArtifactError, match=f"lacks a readable {missing}"):
        restore_lib.restore(art, sharding.make_mesh(MESHES["1"]))


def test_a_stack_of_another_shape_is_refused_before_it_is_read(compacted, tmp_path):
    """The stored stack is sized by the manifest's per-layer entries: an entry forged to say
    the local layers keep more positions (stack shape and manifest disagree) is refused."""
    art = _copy(compacted.path, tmp_path, "art")
    data = json.loads((art / files_lib.MANIFEST).read_text())
    data["compaction"]["window"] = WINDOW + 4
    data["compaction"]["kept_from"] = LENGTH - WINDOW - 4
    for a in data["arrays"]:
        if a["name"].split("/")[1] in ("k", "v") and a["shape"][1] == WINDOW:
            a["shape"][1] = WINDOW + 4
    reseal(art, **data)
    with pytest.raises(
        errors.CorruptArtifactError,
        match=r"stored k.stack_0 is bfloat16\[5, 1, 16, 4, 32\], the manifest says bfloat16\[5, 1, 20, ",
    ):
        restore_lib.restore(art, sharding.make_mesh(MESHES["1"]))


@pytest.mark.parametrize("held", [np.uint16, jax.numpy.bfloat16])
def test_a_stack_keeps_every_bit_nan_payloads_included(held):
    """Stacking copies bits, never values: XLA:CPU copies bf16 through f32, which rewrites NaN
    payloads, so a stack of bf16 values made that way changed random K/V bits."""
    mesh = sharding.make_mesh(MESHES["2x4"])
    shape = kvstate.KVShape(num_layers=3, batch_size=2, cache_length=40, num_kv_heads=4, head_dim=8)
    rng = np.random.default_rng(0)
    layers = []
    for target in shape.shardings(mesh):
        kv = rng.integers(0, 2**16, size=(2, 2, 40, 4, 8), dtype=np.uint16)
        kv[:, 0, 0, 0, :2] = [0x7F81, 0xFFC1]  # a signalling and a quiet NaN with payloads
        host = {
            "k": kv[0].view(held),
            "v": kv[1].view(held),
            "positions": rng.integers(-(2**31), 2**31, size=(2, 40), dtype=np.int32),
            "end_index": np.array([40, 7], np.int32),
        }
        layers.append(
            kvstate.LayerKV(**{n: jax.device_put(host[n], getattr(target, n)) for n in host})
        )
    tree = layout.state_tree(kvstate.KVState(tuple(layers), 40))
    for field in kvstate.LAYER_AXES:
        stack = tree[field]["stack_0"]
        assert stack.sharding.spec[0] is None  # the layer axis is never sharded
        for i, layer in enumerate(layers):
            assert bits.as_bits(stack[i]).tobytes() == bits.as_bits(getattr(layer, field)).tobytes()


def _stored_shape(path, param):
    import tensorstore as ts

    from kvgraft_jax.store import verified_read

    context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
    spec = verified_read.orbax_spec(files_lib.as_path(path) / files_lib.STATE_DIR, param, context)
    store = ts.open(spec, context=context, open=True, read=True).result()
    return tuple(store.shape)


def test_a_field_of_more_than_stack_bytes_is_stored_in_runs_of_layers(
    tiny_params_on, compacted, tmp_path, monkeypatch
):
    """Layers of one shape are stacked in runs of at most `STACK_BYTES` (whole layers, in
    layer order): the same state, the same digests, restored bit for bit onto any mesh."""
    assert _stored_shape(compacted.path, "k.stack_0")[0] == 5  # 5 local layers: one stack
    layer_k = 1 * LENGTH * 4 * 32 * 2  # the global layer's K: bf16[1, 100, 4, 32]
    monkeypatch.setattr(layout, "STACK_BYTES", 2 * 1 * WINDOW * 4 * 32 * 2)  # 2 local layers
    eng = _engine(tiny_params_on, "2x4")
    runs = deposit.deposit(
        eng,
        _ids(LENGTH, 0),
        chunk_size=CHUNK,
        path=tmp_path / "runs",
        model=model.describe_model("tiny", eng.model, eng.params),
        tokenizer=tokenizer.tiny_tokenizer().info(),
        versions=environment.versions(),
        compact=True,
    )
    assert runs.root == compacted.root  # the same state, however it is packed
    assert layer_k > layout.STACK_BYTES  # the global layer is a run of its own
    tree = json.loads((runs.path / files_lib.STATE_DIR / "_METADATA").read_text())["tree_metadata"]
    stacks = sorted(key for key in tree if key.startswith("('k'"))
    assert stacks == [f"('k', 'stack_{j}')" for j in range(4)]  # locals 2 + 2 + 1, global 1
    assert [_stored_shape(runs.path, f"k.stack_{j}") for j in range(4)] == [
        (2, 1, WINDOW, 4, 32),
        (2, 1, WINDOW, 4, 32),
        (1, 1, WINDOW, 4, 32),
        (1, 1, LENGTH, 4, 32),
    ]
    meshes = [sharding.make_mesh(MESHES[name]) for name in ("1", "4x2")]
    from_runs = [restore_lib.restore(runs.path, mesh) for mesh in meshes]
    # The rule is part of the format: read with another limit, the stacks are not there.
    with pytest.raises(errors.CorruptArtifactError, match=r"stored k.stack_0 is .*\[5, 1, 16"):
        restore_lib.restore(compacted.path, meshes[0])
    monkeypatch.undo()
    for a, mesh in zip(from_runs, meshes, strict=True):
        b = restore_lib.restore(compacted.path, mesh)
        assert a.root == b.root == compacted.root
        for x, y in zip(
            jax.tree.leaves(a.state.layers), jax.tree.leaves(b.state.layers), strict=True
        ):
            assert x.sharding == y.sharding and bits.sha256(x) == bits.sha256(y)
