"""Artifacts on real files: deposit on one mesh, restore on any other, refuse anything doubtful."""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import MESHES, kill_at_pause_point, reseal

from kvgraft_jax.core import bits, engine, environment, model, sharding, tokenizer
from kvgraft_jax.exact import deposit
from kvgraft_jax.store import errors, writer
from kvgraft_jax.store import files as files_lib
from kvgraft_jax.store import manifest as manifest_lib
from kvgraft_jax.store import restore as restore_lib

ROOT = Path(__file__).resolve().parents[1]
LENGTH = 300  # more than one 256-position digest block, longer than the sliding window
TOK = tokenizer.tiny_tokenizer().info()


def _ids(batch=2):
    return np.tile(np.random.default_rng(0).integers(4, 1024, size=(1, LENGTH)), (batch, 1)).astype(
        np.int32
    )


def _deposit(tiny_params_on, mesh_name, path, *, seed=0, chunk_size=64, ids=None, overwrite=False):
    mesh, params = tiny_params_on(mesh_name, seed=seed)
    module = model.build_model("tiny")
    ids = _ids() if ids is None else ids
    eng = engine.Engine(module, params, mesh, batch_size=ids.shape[0], cache_length=ids.shape[1])
    return deposit.deposit(
        eng,
        ids,
        chunk_size=chunk_size,
        path=path,
        model=model.describe_model("tiny", module, params),
        tokenizer=tokenizer.tiny_tokenizer().info(),
        versions=environment.versions(),
        text="test",
        overwrite=overwrite,
    )


@pytest.fixture(scope="module")
def deposits(tiny_params_on, tmp_path_factory):
    base = tmp_path_factory.mktemp("deposits")
    return {name: _deposit(tiny_params_on, name, base / f"on_{name}") for name in MESHES}


@pytest.fixture()
def art(deposits, tmp_path):
    """A private copy of the artifact deposited on (2,4), free to damage."""
    dst = tmp_path / "art"
    shutil.copytree(deposits["2x4"].path, dst)
    return dst


def _mesh(name):
    return sharding.make_mesh(MESHES[name])


def test_layout_and_manifest(deposits):
    result = deposits["2x4"]
    names = sorted(os.listdir(result.path))
    assert names == sorted([files_lib.COMMIT_MARKER, files_lib.STATE_DIR, files_lib.MANIFEST])
    m = manifest_lib.read_manifest(result.path)
    assert m.format == manifest_lib.FORMAT and m.root == result.root
    assert (m.first_position, m.last_position, m.length) == (0, LENGTH - 1, LENGTH)
    assert m.protocol.schedule == [[0, 64], [64, 64], [128, 64], [192, 64], [256, 44]]
    assert m.protocol.mesh == "data:2,model:4" and m.protocol.batch_size == 2
    assert m.protocol.versions["jax"] == jax.__version__
    assert m.token_ids[0] == _ids()[0].tolist()
    assert m.tokenizer.fingerprint == TOK.fingerprint
    assert len(m.arrays) == 6 * 4
    k = next(a for a in m.arrays if a.name == "layer_0/k")
    assert k.shape == [2, LENGTH, 4, 32]  # sliced to the used length, not a padded cache
    assert k.logical_axes == ["batch", "cache_seq", "kv_heads", "head_dim"]
    assert not any(
        p.name.startswith(".") for p in Path(result.path).parent.iterdir()
    )  # no staging left


@pytest.mark.parametrize("target", list(MESHES))
@pytest.mark.parametrize("source", list(MESHES))
def test_restore_on_any_mesh_is_byte_exact(deposits, source, target):
    deposited = deposits[source]
    restored = restore_lib.restore(deposited.path, _mesh(target))
    assert restored.root == deposited.root
    for got, want in zip(
        jax.tree.leaves(restored.state.layers), jax.tree.leaves(deposited.state.layers), strict=True
    ):
        assert bits.first_mismatch(got, want) is None
    # The restored leaves sit in the target mesh's rule sharding.
    assert restored.state.layers[0].k.sharding.mesh.shape == _mesh(target).shape


# A plain Orbax read, as any reader outside kvgraft would do it: Orbax warns that it takes the
# sharding from the checkpoint.
@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")
def test_the_stored_state_holds_bf16_values_and_the_cache_their_bits(deposits):
    """The engine holds bf16 K/V as uint16 bits (XLA:CPU writes a bf16 slot by rewriting the
    whole cache); an artifact stores, digests and records the values: any Orbax reader gets
    bf16, and a restore gives back the same bits in the engine's form."""
    import orbax.checkpoint as ocp

    deposited = deposits["1"]
    held = deposited.state.layers[0].k
    assert held.dtype == np.uint16 and deposited.state.shape.dtype == "bfloat16"
    entries = {a.name: a for a in deposited.manifest.arrays}
    assert (
        entries["layer_0/k"].dtype == "bfloat16" and entries["layer_0/positions"].dtype == "int32"
    )
    stored = ocp.PyTreeCheckpointer().restore(deposited.path / files_lib.STATE_DIR)
    # Format 2: per field, the layers of one shape stacked in layer order (layout.stored_arrays).
    assert sorted(stored) == ["end_index", "k", "positions", "v"]
    assert sorted(stored["k"]) == ["stack_0"]  # tiny is not compacted: one shape for all layers
    k = np.asarray(stored["k"]["stack_0"])
    assert str(k.dtype) == "bfloat16" and k.shape == (len(deposited.state.layers), *held.shape)
    for i, layer in enumerate(deposited.state.layers):
        assert np.array_equal(k[i].view(np.uint16), np.asarray(layer.k))
        assert np.array_equal(np.asarray(stored["positions"]["stack_0"])[i], layer.positions)
    restored = restore_lib.restore(deposited.path, _mesh("1"))
    assert restored.state.layers[0].k.dtype == np.uint16
    assert bits.sha256(restored.state.layers[0].k) == bits.sha256(held)


# Measured: depositing the same tokens on each mesh gives these groups of equal roots (XLA:CPU,
# jax 0.9.2, tiny model, batch 2). No two meshes agree: every one shards the heads or the model
# dimension differently, which changes the prefill's reduction order. Persistence and re-sharding
# are exact (the test above); the prefill computation is mesh-specific.
def test_record_which_deposit_meshes_agree(deposits):
    groups = {}
    for name, result in deposits.items():
        groups.setdefault(result.root, []).append(name)
    agree = sorted(sorted(g) for g in groups.values())
    print("deposit meshes with equal roots:", agree)
    assert agree == DEPOSIT_ROOT_GROUPS


DEPOSIT_ROOT_GROUPS = [["1"], ["2x4"], ["4x2"], ["8"]]


def test_same_content_again_is_a_noop_and_different_content_is_refused(tiny_params_on, tmp_path):
    path = tmp_path / "a"
    first = _deposit(tiny_params_on, "1", path)
    mtime = (path / files_lib.MANIFEST).stat().st_mtime_ns
    again = _deposit(tiny_params_on, "1", path)
    assert again.root == first.root and (path / files_lib.MANIFEST).stat().st_mtime_ns == mtime
    other = _ids()[:, :200]
    with pytest.raises(errors.ArtifactExistsError, match="--overwrite"):
        _deposit(tiny_params_on, "1", path, ids=other)
    assert manifest_lib.read_manifest(path).root == first.root  # nothing lost
    replaced = _deposit(tiny_params_on, "1", path, ids=other, overwrite=True)
    assert manifest_lib.read_manifest(path).root == replaced.root != first.root
    assert restore_lib.restore(path, _mesh("1")).state.length == 200


# -- refusals ------------------------------------------------------------------------------------


def _expected(**overrides):
    base = {"model_name": "tiny"}
    base.update(overrides)
    return manifest_lib.Expected(**base)


def test_refuses_other_weights(art, tiny_params_on):
    _, params = tiny_params_on("1", seed=1)
    other = model.weights_fingerprint(model.TINY_CONFIGS["tiny"], params)
    with pytest.raises(errors.IncompatibleArtifactError, match="weights fingerprint"):
        restore_lib.restore(art, _mesh("1"), expected=_expected(model_fingerprint=other))


def test_refuses_other_tokenizer_config_and_dtype(art):
    with pytest.raises(errors.IncompatibleArtifactError, match="tokenizer"):
        restore_lib.restore(art, _mesh("1"), expected=_expected(tokenizer_fingerprint="0" * 64))
    mqa = model.config_to_json(model.TINY_CONFIGS["tiny_mqa"])
    with pytest.raises(errors.IncompatibleArtifactError, match=r"model config .*num_kv_heads"):
        restore_lib.restore(art, _mesh("1"), expected=_expected(model_config=mqa))
    with pytest.raises(errors.IncompatibleArtifactError, match="model"):
        restore_lib.restore(art, _mesh("1"), expected=_expected(model_name="gemma3_270m"))
    with pytest.raises(errors.IncompatibleArtifactError, match="cache dtype"):
        restore_lib.restore(art, _mesh("1"), expected=_expected(cache_dtype="float32"))


def _rewrite_manifest(path, edit, *, resign):
    data = json.loads((path / files_lib.MANIFEST).read_text())
    edit(data)
    (path / files_lib.MANIFEST).write_text(json.dumps(data))
    if resign:  # a manifest consistent with its marker, but wrong about the stored arrays
        m = manifest_lib.Manifest.from_json(data)
        (path / files_lib.COMMIT_MARKER).write_text(
            json.dumps({"root": m.root, "manifest_sha256": m.sha256()})
        )


def test_refuses_other_format_version(art):
    _rewrite_manifest(art, lambda d: d.update(format="kvgraft-artifact/9"), resign=True)
    with pytest.raises(
        errors.IncompatibleArtifactError,
        match="format 'kvgraft-artifact/9', this build reads 'kvgraft-artifact/1' and 'kvgraft-artifact/2'",
    ):
        restore_lib.restore(art, _mesh("1"))


def test_refuses_hand_edited_manifest(art):
    def edit(d):
        d["token_ids"][0][5] += 1

    _rewrite_manifest(art, edit, resign=False)
    with pytest.raises(errors.CorruptArtifactError, match="edited"):
        restore_lib.restore(art, _mesh("1"))


def test_the_manifest_is_checked_as_read_and_as_its_dataclasses(art):
    """The marker records the manifest file's bytes: an untouched file passes on them alone. The
    committed SHA-256 is of the manifest's dataclasses: a file rewritten whose own JSON hashes to
    it passes; one that differs only where the dataclasses drop it (a null `knowledge`, as a
    library-era writer could put) passes through them, as before; any value changed fails."""
    raw = (art / files_lib.MANIFEST).read_bytes()
    marker = json.loads((art / files_lib.COMMIT_MARKER).read_text())
    assert marker[manifest_lib.MANIFEST_FILE_SHA256] == hashlib.sha256(raw).hexdigest()
    baseline = manifest_lib.read_manifest(art)
    _rewrite_manifest(art, lambda d: None, resign=False)  # reformatted: other bytes, same JSON
    assert (art / files_lib.MANIFEST).read_bytes() != raw
    assert manifest_lib.read_manifest(art) == baseline
    _rewrite_manifest(art, lambda d: d.update(knowledge=None), resign=False)
    assert manifest_lib.read_manifest(art) == baseline
    _rewrite_manifest(art, lambda d: d["provenance"].update(source="edited"), resign=False)
    with pytest.raises(errors.CorruptArtifactError, match="edited"):
        manifest_lib.read_manifest(art)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "dtype",
            "float32",
            r"stored k.stack_0 is bfloat16\[6, 2, 300, 4, 32\], the manifest says float32",
        ),
        (
            "shape",
            [2, 300, 4, 16],
            r"stored k.stack_0 is bfloat16\[6, 2, 300, 4, 32\], the manifest says bfloat16\[6, 2, 300, 4, 16\]",
        ),
    ],
)
def test_refuses_dtype_or_shape_mismatch_before_reading(art, field, value, message):
    def edit(d):
        # every K and V entry, consistently, so only the stored metadata can catch it
        for entry in d["arrays"]:
            if entry["name"].endswith(("/k", "/v")):
                entry[field] = value
        from kvgraft_jax.core import digest

        d["root"] = digest.root(
            [
                digest.ArrayDigest(
                    a["name"], a["dtype"], tuple(a["shape"]), tuple(a["block_shape"]), a["digest"]
                )
                for a in d["arrays"]
            ]
        )

    _rewrite_manifest(art, edit, resign=True)
    with pytest.raises(errors.CorruptArtifactError, match=message):
        restore_lib.restore(art, _mesh("1"))


def _state_files(path):
    return sorted(p for p in (path / files_lib.STATE_DIR).rglob("*") if p.is_file())


def _data_files(path):
    return [p for p in _state_files(path) if p.parent.name == "d"]


@pytest.mark.parametrize("mesh", ["1", "2x4"])
def test_overlapped_and_serial_reads_restore_the_same_bits(deposits, mesh):
    """Hashing each array as it lands (overlap, the default past two cores) or after all have
    landed: the same arrays, bit for bit, and the same root."""
    path = deposits["2x4"].path
    overlapped = restore_lib.restore(path, _mesh(mesh), overlap=True)
    serial = restore_lib.restore(path, _mesh(mesh), overlap=False)
    assert overlapped.root == serial.root == deposits["2x4"].root
    for a, b in zip(
        jax.tree.leaves(overlapped.state.layers), jax.tree.leaves(serial.state.layers), strict=True
    ):
        assert a.sharding == b.sharding
        assert bits.sha256(a) == bits.sha256(b)


def test_shards_are_read_into_buffers_xla_places_without_a_copy():
    """A restore reads every shard into a host buffer aligned for XLA, so that on a CPU device
    the placed array is that buffer (a second copy of 128 MiB was a third of read and place)."""
    from kvgraft_jax.store import verified_read

    for shape, dtype in [
        ((1, 300, 1, 64), jax.numpy.bfloat16),
        ((2, 300), np.int32),
        ((1,), np.int32),
    ]:
        host = verified_read.aligned_empty(shape, dtype)
        assert host.shape == shape and host.dtype == np.dtype(dtype) and host.flags.c_contiguous
        assert host.ctypes.data % verified_read.HOST_ALIGNMENT == 0
    host = verified_read.aligned_empty((1, 300, 1, 64), np.uint16)
    host[...] = 7
    placed = jax.device_put(host, jax.devices()[0])
    assert placed.unsafe_buffer_pointer() == host.ctypes.data  # the buffer itself, no copy
    misaligned = np.empty(300 * 64 + 1, np.uint16)[1:].reshape(1, 300, 1, 64)
    assert jax.device_put(misaligned, jax.devices()[0]).unsafe_buffer_pointer() != (
        misaligned.ctypes.data
    )  # what TensorStore's own results (16-byte aligned) got: a copy


def _codecs(path):
    import orbax.checkpoint as ocp
    import tensorstore as ts

    from kvgraft_jax.store import verified_read

    context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
    spec = verified_read.orbax_spec(
        files_lib.as_path(path) / files_lib.STATE_DIR, "k.stack_0", context
    )
    store = ts.open(spec, context=context, open=True, read=True).result()
    return json.dumps(store.spec().to_json()["metadata"]["codecs"])


def test_stored_uncompressed_by_default_and_zstd_on_request(deposits, tmp_path):
    """Both kinds restore to the same bits and root; only `compression=True` writes zstd."""
    source = deposits["2x4"]
    restored = restore_lib.restore(source.path, _mesh("2x4"))
    manifest = manifest_lib.read_manifest(source.path)
    assert "zstd" not in _codecs(source.path)
    zstd = writer.write(tmp_path / "zstd", restored.state, manifest, compression=True)
    assert "zstd" in _codecs(zstd)
    again = restore_lib.restore(zstd, _mesh("4x2"))
    assert again.root == source.root
    for a, b in zip(
        jax.tree.leaves(again.state.layers), jax.tree.leaves(restored.state.layers), strict=True
    ):
        assert bits.sha256(a) == bits.sha256(b)


# A metadata file fails its recorded SHA-256; a data file fails TensorStore's B-tree checksums or
# the canonical digests of the arrays read from it (restore hashes those bytes once, not twice).
DAMAGE = r"changed since the deposit|restored with SHA-256|CRC-32C checksum"


def test_refuses_a_flipped_bit_in_any_state_file(art, tmp_path):
    """Inspect's full check refuses every flip. A plain restore refuses every flip in a byte it
    reads; a flip it lets through must be in a data file, and the state it returns is still the
    deposited one (its root re-verified), so nothing damaged can reach a graft."""
    files = _state_files(art)
    assert len(files) >= 8
    deposited = restore_lib.restore(art, _mesh("2x4"))
    passed = []
    for i, f in enumerate(files):
        copy = tmp_path / f"flip{i}"
        shutil.copytree(art, copy)
        target = copy / f.relative_to(art)
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x10
        target.write_bytes(bytes(data))
        with pytest.raises(errors.CorruptArtifactError, match="changed since the deposit"):
            restore_lib.restore(copy, _mesh("2x4"), every_file=True)
        try:
            restored = restore_lib.restore(copy, _mesh("2x4"))
        except errors.CorruptArtifactError as e:
            assert re.search(DAMAGE, str(e)), e
            continue
        passed.append(f)
        assert f.parent.name == "d", f"a flip in metadata file {f} was not refused"
        assert restored.root == deposited.root
        for a, b in zip(
            jax.tree.leaves(restored.state.layers),
            jax.tree.leaves(deposited.state.layers),
            strict=True,
        ):
            assert bits.sha256(a) == bits.sha256(b)
    # Every file holding chunk bytes is refused: the flips let through are in small node files.
    assert max(_data_files(art), key=lambda p: p.stat().st_size) not in passed
    assert len(passed) < len(_data_files(art))


def test_restored_digests_catch_damage_even_with_a_consistent_manifest(art):
    """Damage the array data, then update the file inventory and re-sign: the digests still refuse."""
    data_file = max(_data_files(art), key=lambda p: p.stat().st_size)
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    data_file.write_bytes(bytes(raw))
    inventory = [dataclasses_asdict(f) for f in files_lib.file_inventory(art)]
    _rewrite_manifest(art, lambda d: d.update(files=inventory), resign=True)
    with pytest.raises(errors.CorruptArtifactError, match=r"restored with SHA-256|cannot be read"):
        restore_lib.restore(art, _mesh("2x4"))


def dataclasses_asdict(x):
    import dataclasses

    return dataclasses.asdict(x)


def test_refuses_truncated_and_missing_files(art, tmp_path):
    biggest = max(_data_files(art), key=lambda p: p.stat().st_size)
    truncated = tmp_path / "trunc"
    shutil.copytree(art, truncated)
    victim = truncated / biggest.relative_to(art)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(errors.CorruptArtifactError, match="truncated"):
        restore_lib.restore(truncated, _mesh("1"))

    missing = tmp_path / "missing"
    shutil.copytree(art, missing)
    (missing / biggest.relative_to(art)).unlink()
    with pytest.raises(errors.CorruptArtifactError, match="missing"):
        restore_lib.restore(missing, _mesh("1"))

    no_manifest = tmp_path / "no_manifest"
    shutil.copytree(art, no_manifest)
    (no_manifest / files_lib.MANIFEST).unlink()
    with pytest.raises(errors.CorruptArtifactError, match="missing"):
        restore_lib.restore(no_manifest, _mesh("1"))

    with pytest.raises(errors.ArtifactNotFoundError):
        restore_lib.restore(tmp_path / "nothing", _mesh("1"))


def test_refuses_an_uncommitted_artifact(art):
    (art / files_lib.COMMIT_MARKER).unlink()
    with pytest.raises(errors.UncommittedArtifactError, match="interrupted"):
        restore_lib.restore(art, _mesh("1"))


# -- crash safety --------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["after_state", "after_manifest", "before_rename"])
def test_sigkill_mid_deposit_leaves_nothing_visible(tmp_path, stage):
    target = tmp_path / "lib" / "doc"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    argv = [
        sys.executable,
        "-m",
        "kvgraft_jax.main",
        "--mode=deposit",
        "--text=A verified fact.",
        f"--artifact={target}",
    ]
    kill_at_pause_point(argv, env=env, stage=stage, cwd=ROOT)
    assert not target.exists()
    with pytest.raises(errors.ArtifactNotFoundError):
        manifest_lib.read_manifest(target)
    leftovers = list(target.parent.iterdir())
    assert all(p.name.startswith(".doc" + files_lib.STAGING_INFIX) for p in leftovers), leftovers
    for p in leftovers:  # the debris is itself never mistaken for an artifact
        with pytest.raises(errors.UncommittedArtifactError, match="staging"):
            restore_lib.restore(p, _mesh("1"))
    # A later deposit to the same path succeeds and restores intact.
    done = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert restore_lib.restore(target, _mesh("1")).root == manifest_lib.read_manifest(target).root


def test_commit_marker_path_for_stores_without_atomic_rename(tiny_params_on, tmp_path, monkeypatch):
    """The gs:// write path (files in place, COMMITTED last), exercised on a local directory
    that is not allowed to rename: the same code a bucket gets, switched on by the documented
    `KVGRAFT_COMMIT_BY_MARKER` (gcsfuse-like mounts)."""
    monkeypatch.setenv(files_lib.COMMIT_BY_MARKER_ENV, "1")

    class NoRename:  # our module's `os`, without rename
        def __getattr__(self, name):
            return getattr(os, name)

        def rename(self, *args):
            raise AssertionError(f"rename on a store without atomic rename: {args}")

    monkeypatch.setattr(writer, "os", NoRename())
    path = tmp_path / "bucket" / "doc"
    first = _deposit(tiny_params_on, "1", path)
    assert sorted(os.listdir(path)) == sorted(
        [files_lib.COMMIT_MARKER, files_lib.STATE_DIR, files_lib.MANIFEST]
    )
    assert not [
        p for p in path.parent.iterdir() if p.name.startswith(".")
    ]  # nothing staged beside it
    assert restore_lib.restore(path, _mesh("2x4")).root == first.root

    # An interrupted write in place is visible as a directory but refused until committed.
    (path / files_lib.COMMIT_MARKER).unlink()
    with pytest.raises(errors.UncommittedArtifactError):
        restore_lib.restore(path, _mesh("1"))
    # A later deposit replaces the debris and commits.
    again = _deposit(tiny_params_on, "1", path, ids=_ids()[:, :100])
    assert restore_lib.restore(path, _mesh("1")).root == again.root

    # A directory holding anything a deposit does not write is never cleared for an artifact.
    mine = tmp_path / "bucket" / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("mine")
    with pytest.raises(errors.ArtifactExistsError, match="not an artifact"):
        _deposit(tiny_params_on, "1", mine)
    assert (mine / "todo.txt").read_text() == "mine"


def test_sigkill_mid_deposit_without_rename_leaves_nothing_committed(tmp_path):
    """On the commit-marker path the files are in place, so a crash leaves a visible directory:
    it is refused as uncommitted, and the next deposit replaces it."""
    target = tmp_path / "bucket" / "doc"
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        **{files_lib.COMMIT_BY_MARKER_ENV: "1"},
    )
    argv = [sys.executable, "-m", "kvgraft_jax.main", "--mode=deposit", "--text=A fact."]
    argv.append(f"--artifact={target}")
    kill_at_pause_point(argv, env=env, stage="after_manifest", cwd=ROOT)
    assert (target / files_lib.MANIFEST).exists() and not files_lib.is_committed(target)
    with pytest.raises(errors.UncommittedArtifactError, match="COMMITTED"):
        restore_lib.restore(target, _mesh("1"))
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert restore_lib.restore(target, _mesh("1")).root == manifest_lib.read_manifest(target).root


def test_concurrent_depositors_of_the_same_content_both_succeed(
    tiny_params_on, tmp_path, monkeypatch
):
    """The loser of the commit race finds the winner's identical artifact and returns it."""
    winner = _deposit(tiny_params_on, "1", tmp_path / "winner")
    path = tmp_path / "doc"
    real_rename = os.rename

    def racing_rename(src, dst):
        if dst == os.fspath(path) and not os.path.exists(dst):
            shutil.copytree(winner.path, dst)  # the other process commits a moment earlier
        return real_rename(src, dst)

    monkeypatch.setattr(writer.os, "rename", racing_rename)
    loser = _deposit(tiny_params_on, "1", path)
    assert loser.root == winner.root
    assert restore_lib.restore(path, _mesh("1")).root == winner.root
    assert not [p for p in tmp_path.iterdir() if files_lib.STAGING_INFIX in p.name]

    different = _ids()[:, :50]
    shutil.rmtree(path)  # the racing rename puts the winner back just before this commit
    with pytest.raises(errors.ArtifactExistsError, match="concurrent deposit"):
        _deposit(tiny_params_on, "1", path, ids=different)
    assert manifest_lib.read_manifest(path).root == winner.root  # the winner's entry is not lost


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"last_position": 200_000}, "last position 200000 != first 0 \\+ length 300 - 1"),
        ({"length": 0}, "length 0"),
        ({"first_position": -5}, "first position -5"),
        ({"token_ids": [[5] * 10, [5] * 10]}, "token ids are not 2 rows of 300"),
        ({"token_ids": [[5] * 300, [5] * 299 + [True]]}, "wrong type: token_ids"),
        ({"token_ids": [[5] * 300, [5.0] * 300]}, "wrong type: token_ids"),
        ({"token_ids": [[5] * 300, ["5"] + [5] * 299]}, "wrong type: token_ids"),
    ],
)
def test_a_resealed_manifest_that_does_not_add_up_is_refused_before_any_read(art, changes, message):
    reseal(art, **changes)
    with pytest.raises(errors.CorruptArtifactError, match=message):
        manifest_lib.read_manifest(art)


def test_a_resealed_schedule_is_refused(art):
    data = json.loads((art / files_lib.MANIFEST).read_text())
    reseal(art, protocol=dict(data["protocol"], schedule=[[0, 300]]))
    with pytest.raises(errors.CorruptArtifactError, match="is not chunks of 64"):
        manifest_lib.read_manifest(art)


def test_stored_arrays_must_be_the_models_kv_state(art):
    """A manifest resealed to claim another model's config: the stored shapes give it away."""
    other = model.config_to_json(model.TINY_CONFIGS["tiny_mqa"])
    data = json.loads((art / files_lib.MANIFEST).read_text())
    reseal(art, model=dict(data["model"], config=other))
    with pytest.raises(errors.IncompatibleArtifactError, match="stored layers 6, the model has 12"):
        restore_lib.restore(art, _mesh("1"), expected=manifest_lib.Expected(model_config=other))


def test_a_state_nested_thousands_deep_is_refused_in_one_line(art):
    """Deeper than Python's recursion limit: the listing walks with a stack, so the extra file is
    refused like any other, not by a RecursionError."""
    deep = os.fspath(art / files_lib.STATE_DIR)
    levels = []
    for _ in range(1500):  # one level at a time: os.makedirs recurses, and so does rmtree
        deep = os.path.join(deep, "x")
        os.mkdir(deep)
        levels.append(deep)
    extra = os.path.join(deep, "extra")
    with open(extra, "wb") as f:
        f.write(b"x")
    try:
        with pytest.raises(errors.CorruptArtifactError, match="unexpected file"):
            restore_lib.restore(art, _mesh("1"))
    finally:  # pytest's own clean-up of tmp_path (shutil.rmtree) would die in a RecursionError
        os.remove(extra)
        for level in reversed(levels):
            os.rmdir(level)


@pytest.mark.parametrize("kind", ["fifo", "symlink to /dev/zero", "symlink to a copy"])
def test_only_regular_files_in_the_state(art, kind, tmp_path):
    victim = next(p for p in sorted((art / files_lib.STATE_DIR).rglob("*")) if p.is_file())
    copy = tmp_path / "copy"
    shutil.copy(victim, copy)
    victim.unlink()
    if kind == "fifo":
        os.mkfifo(victim)
    else:
        victim.symlink_to("/dev/zero" if "zero" in kind else copy)
    signal.alarm(120)  # a read of the FIFO or /dev/zero would never end: fail instead of hanging
    try:
        for every_file in (False, True):
            with pytest.raises(errors.CorruptArtifactError, match="not a regular file"):
                restore_lib.restore(art, _mesh("1"), every_file=every_file)
    finally:
        signal.alarm(0)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda a: (a / files_lib.COMMIT_MARKER).write_text("[1, 2]"), "not a commit record"),
        (
            lambda a: (
                (a / files_lib.COMMIT_MARKER).unlink(),
                (a / files_lib.COMMIT_MARKER).mkdir(),
            ),
            "COMMITTED is not a regular file",
        ),
        (
            lambda a: (a / files_lib.MANIFEST).write_text("[" * 100_000 + "]" * 100_000),
            "unreadable",
        ),
        (
            lambda a: ((a / files_lib.MANIFEST).unlink(), os.mkfifo(a / files_lib.MANIFEST)),
            "manifest.json is not a regular file",
        ),
        (lambda a: (a / files_lib.MANIFEST).write_bytes(b"\xff\xfe"), "unreadable"),
    ],
)
def test_damaged_manifest_or_marker_is_one_error(art, damage, message):
    damage(art)
    with pytest.raises(errors.CorruptArtifactError, match=message):
        manifest_lib.read_manifest(art)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("dtype", "float99", "dtype 'float99'"),
        ("shape", "many", "shape"),
        ("shape", [2, -1, 4, 32], "shape"),
    ],
)
def test_a_resealed_junk_array_entry_is_refused(art, field, value, message):
    data = json.loads((art / files_lib.MANIFEST).read_text())
    arrays = [dict(a, **{field: value}) if a["name"] == "layer_0/k" else a for a in data["arrays"]]
    reseal(art, arrays=arrays)
    with pytest.raises(errors.CorruptArtifactError, match=message):
        manifest_lib.read_manifest(art)


def test_an_artifact_path_that_is_a_file_is_one_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(errors.ArtifactNotFoundError, match="is a file, not an artifact"):
        manifest_lib.read_manifest(tmp_path / "file")
