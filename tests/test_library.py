"""The library on disk: concurrent depositors (real processes), a crash between artifact and catalog,
reindex from manifests alone, and restore cost that does not grow with the library."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import kill_at_pause_point, reseal

from kvgraft_jax.cli import modes as modes_lib
from kvgraft_jax.core import engine as engine_lib
from kvgraft_jax.core import environment, tokenizer
from kvgraft_jax.core import model as model_lib
from kvgraft_jax.exact import deposit, graft
from kvgraft_jax.library import catalog, dataset, library, verifiers
from kvgraft_jax.run import config
from kvgraft_jax.store import chain, errors, files
from kvgraft_jax.store import manifest as manifest_lib

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra):
    return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", **extra)


def _seed_argv(lib, data):
    return [
        sys.executable,
        "-m",
        "kvgraft_jax.main",
        "--model=tiny",
        "--mode=deposit",
        "--chunk_size=16",
        "--mesh=data:1,model:1",
        f"--library={lib}",
        f"--dataset={data}",
    ]


def _records(prefix, count, start=0):
    return [
        dataset.Record(
            id=f"{prefix}-{i}",
            problem=f"What is {i} + {i + 7}?",
            answer=str(2 * i + 7),
            solution=f"{i} + {i + 7} = {2 * i + 7}.",
            program=f"print({i} + {i + 7})",
        )
        for i in range(start, start + count)
    ]


def _keys_and_roots(lib_dir):
    with catalog.Catalog(Path(lib_dir) / library.CATALOG) as c:
        return sorted((i.key, i.root, i.item_id.split("-")[-1]) for i in c.items())


def test_concurrent_depositors_lose_nothing_and_reindex_rebuilds_the_same(tmp_path):
    lib = tmp_path / "lib"
    shared = _records("shared", 2, start=100)  # every process deposits these too
    procs = []
    for w in range(4):
        data = tmp_path / f"part{w}.jsonl"
        dataset.write_jsonl(_records(f"w{w}", 3, start=10 * w) + shared, data)
        procs.append(
            subprocess.Popen(
                _seed_argv(lib, data),
                cwd=ROOT,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-2000:]
    with catalog.Catalog(lib / library.CATALOG) as c:
        assert c.integrity_ok()
        items = c.items()
    keys = [i.key for i in items]
    assert len(keys) == len(set(keys)) == 4 * 3 + 2
    expected = {
        catalog.normalize_key(r.problem) for w in range(4) for r in _records("w", 3, 10 * w)
    }
    assert expected | {catalog.normalize_key(r.problem) for r in shared} == set(keys)
    # Every row's artifact is committed, named by its root, and holds that item.
    for item in items:
        path = lib / item.artifact
        manifest = manifest_lib.read_manifest(path)
        assert path.name == manifest.root == item.root
        assert item.key in [k.key for k in manifest.knowledge.items]
    leftovers = [p.name for p in (lib / library.ARTIFACTS).iterdir() if p.name.startswith(".")]
    assert leftovers == []
    # The catalog rebuilt from the manifests alone holds the same rows.
    before = _keys_and_roots(lib)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{lib / library.CATALOG}{suffix}").unlink(missing_ok=True)
    cfg = config.RunConfig(mode="reindex", library=str(lib))
    report = modes_lib.run_reindex(cfg)
    assert (report.artifacts, report.items, report.skipped) == (14, 14, [])
    assert _keys_and_roots(lib) == before


def test_crash_between_artifact_and_catalog_is_picked_up_by_reindex(tmp_path):
    lib = tmp_path / "lib"
    data = tmp_path / "one.jsonl"
    dataset.write_jsonl(_records("c", 1), data)
    kill_at_pause_point(_seed_argv(lib, data), env=_env(), stage="library_before_catalog", cwd=ROOT)
    committed = [p for p in (lib / library.ARTIFACTS).iterdir()]
    assert len(committed) == 1 and files.is_committed(committed[0])
    assert _keys_and_roots(lib) == []  # no catalog row yet, and never a row without its artifact
    with library.Library(lib) as libr:
        done = libr.reindex()
        assert (done.artifacts, done.items) == (1, 1)
        (item,) = libr.catalog.items()
    assert item.root == committed[0].name and item.item_id == "c-0"
    assert json.loads(item.evidence)["checked_as"] == "integer"


def test_uncommitted_debris_is_skipped_by_reindex(tmp_path):
    lib = library.Library(tmp_path / "lib")
    debris = lib.directory / library.ARTIFACTS / ".abc.kvgraft-staging-123"
    debris.mkdir()
    done = lib.reindex()
    assert done.items == 0 and "staging" in done.skipped[0]
    lib.close()


def test_local_catalog_with_artifacts_on_a_store_without_rename(
    tiny_params_on, tmp_path, monkeypatch
):
    """`--library_artifacts=gs://...`: the catalog stays local, the artifacts go through the
    object-store commit path (here a local directory on that path), and the location is kept."""
    with pytest.raises(library.LibraryError, match="local directory"):
        library.Library("gs://bucket/lib")
    monkeypatch.setenv(files.COMMIT_BY_MARKER_ENV, "1")
    mesh, params = tiny_params_on("1")
    module = model_lib.build_model("tiny")
    tok = tokenizer.tiny_tokenizer()
    eng = engine_lib.Engine(module, params, mesh, batch_size=1, cache_length=128)
    info = model_lib.describe_model("tiny", module, params)
    bucket = tmp_path / "bucket"
    lib = library.Library(tmp_path / "lib", artifacts=bucket)
    for r in _records("b", 3):
        verdict = verifiers.check_answer(r.solution, r.answer)
        text = library.item_text(r.problem, r.solution, r.answer)
        item = library.VerifiedItem(r.id, r.problem, r.answer, text, verdict)
        lib.deposit(
            lambda n: eng, tok, [item], model=info, versions=environment.versions(), chunk_size=16
        )
    roots = sorted(p.name for p in bucket.iterdir())
    assert len(roots) == 3 and all(files.is_committed(bucket / r) for r in roots)
    assert not (tmp_path / "lib" / library.ARTIFACTS).exists()  # nothing local
    rows = lib.catalog.items()
    assert sorted(Path(row.artifact) for row in rows) == [bucket / r for r in roots]
    match = lib.route(_records("b", 3)[1].problem, info.fingerprint, threshold=0.8)
    prefix = graft.load_prefix(eng, lib.artifact_path(match.item.root))
    assert prefix.manifest.root == match.item.root
    before = _keys_and_roots(tmp_path / "lib")
    lib.close()

    with library.Library(tmp_path / "lib") as again:  # no flag: the recorded location
        assert str(again.artifacts) == str(bucket)
        assert again.reindex().items == 3
    assert _keys_and_roots(tmp_path / "lib") == before
    with pytest.raises(library.LibraryError, match="keeps its artifacts at"):
        library.Library(tmp_path / "lib", artifacts=tmp_path / "elsewhere")


def test_a_query_restores_one_artifact_however_large_the_library(tiny_params_on, tmp_path):
    """A library growing tenfold past what one query attends: each query still routes to the same
    artifact and restores exactly that artifact's positions and bytes, never the library's.
    (The time this takes is a benchmark's business, not a test's.)"""
    mesh, params = tiny_params_on("1")
    module = model_lib.build_model("tiny")
    tok = tokenizer.tiny_tokenizer()
    eng = engine_lib.Engine(module, params, mesh, batch_size=1, cache_length=128)
    info = model_lib.describe_model("tiny", module, params)
    lib = library.Library(tmp_path / "lib")
    queries = [r.problem for r in _records("q", 3)]

    def add(records):
        for r in records:
            text = library.item_text(r.problem, r.solution, r.answer)
            verdict = verifiers.check_answer(r.solution, r.answer)
            item = library.VerifiedItem(r.id, r.problem, r.answer, text, verdict)
            lib.deposit(
                lambda n: eng,
                tok,
                [item],
                model=info,
                versions=environment.versions(),
                chunk_size=16,
            )

    def work_per_query():
        out = []
        for q in queries:
            match = lib.route(q, info.fingerprint, threshold=0.8)
            path = lib.artifact_path(match.item.root)
            prefix = graft.load_prefix(eng, path)
            stored = sum(f.size for f in manifest_lib.read_manifest(path).files)
            out.append((match.item.root, prefix.state.length, stored))
        return out

    add(_records("q", 4))
    small = work_per_query()
    small_stats = lib.stats(info.fingerprint)
    add(_records("more", 36, start=50))
    large = work_per_query()
    stats = lib.stats(info.fingerprint)
    assert (small_stats.artifacts, stats.artifacts, stats.items) == (4, 40, 40)
    assert stats.tokens_stored >= 9 * small_stats.tokens_stored  # the library grew tenfold
    assert large == small  # same artifact, same positions, same bytes per query
    attended = max(length for _, length, _ in large)
    assert attended <= stats.largest_artifact_tokens < stats.tokens_stored // 10
    lib.close()


@pytest.fixture
def tiny_deposit(tiny_params_on):
    """deposit(path, text_ids, parent=None) with the tiny model on one device."""
    mesh, params = tiny_params_on("1")
    module = model_lib.build_model("tiny")
    info = model_lib.describe_model("tiny", module, params)

    def put(path, ids, parent=None):
        start = manifest_lib.read_manifest(parent).end_position if parent else 0
        eng = engine_lib.Engine(module, params, mesh, batch_size=1, cache_length=start + len(ids))
        return deposit.deposit(
            eng,
            [ids],
            chunk_size=16,
            path=path,
            model=info,
            tokenizer=None,
            versions=environment.versions(),
            text=str(ids),
            parent=parent,
        )

    return put


def test_catalog_roots_are_pinned(tmp_path, tiny_deposit):
    with library.Library(tmp_path / "lib") as lib:
        for bad in ("../../../x", "/etc", "A" * 64, "a" * 63, "a" * 64 + "/..", ""):
            with pytest.raises(library.LibraryError, match="not a 64-hex digest"):
                lib.artifact_path(bad)
        good = tiny_deposit(lib.artifact_path, list(range(5, 25)))
        assert [link.manifest.root for link in lib.chain(good.root)] == [good.root]
        # A directory named by one root holding another artifact is refused.
        shutil.copytree(good.path, lib.artifact_path("b" * 64))
        with pytest.raises(errors.CorruptArtifactError, match="catalog row names bbbbbbbb"):
            lib.chain("b" * 64)
        # A child in the library whose parent lives outside it is refused.
        outside = tiny_deposit(tmp_path / "outside", list(range(30, 46)))
        child = tiny_deposit(lib.artifact_path, list(range(50, 60)), parent=outside.path)
        with pytest.raises(errors.CorruptArtifactError, match="not this library's artifact"):
            lib.chain(child.root)


def test_a_local_artifact_naming_a_remote_parent_is_refused_before_any_access(
    tmp_path, tiny_deposit
):
    parent = tiny_deposit(tmp_path / "p", list(range(5, 21)))
    child = tiny_deposit(tmp_path / "c", list(range(30, 40)), parent=parent.path)
    assert len(chain.resolve_chain(child.path)) == 2
    reseal(child.path, parent_path="gs://no-such-bucket-kvgraft/p")
    with pytest.raises(errors.CorruptArtifactError, match="another storage scheme"):
        chain.resolve_chain(child.path)
