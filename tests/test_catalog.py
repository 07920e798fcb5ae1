"""The SQLite catalog: keys, FTS5 routing to exactly one item, rejections, concurrent writers."""

import multiprocessing
import sqlite3

import pytest

from kvgraft_jax.library import catalog, dataset

FP = "weights-a"


def _item(problem, *, root="r" * 64, fp=FP, item_id=None, answer="1"):
    return catalog.CatalogItem(
        key=catalog.normalize_key(problem),
        item_id=item_id or problem,
        problem=problem,
        answer=answer,
        text=f"Problem: {problem}\nAnswer: {answer}\n",
        verifier="integer",
        evidence="{}",
        root=root,
        artifact=f"artifacts/{root}",
        model_fingerprint=fp,
        tokenizer_fingerprint="tok",
        artifact_tokens=20,
        parent=None,
        created="2026-12-03T00:00:00+00:00",
    )


@pytest.fixture
def cat(tmp_path):
    with catalog.Catalog(tmp_path / "catalog.sqlite") as c:
        c.add(
            [
                _item("What is 17 * 23?", root="a" * 64),
                _item("What is 17 * 24?", root="b" * 64),
                _item("The secret word is maple. What is the secret word?", root="c" * 64),
                _item("What is 17 * 23?", root="d" * 64, fp="weights-b"),
            ]
        )
        yield c


def test_exact_key_first(cat):
    match = cat.route("  what is 17 * 23?  ", FP, threshold=0.8)
    assert match.how == "exact" and match.item.root == "a" * 64 and match.score == 1.0


def test_search_finds_a_reworded_problem_and_only_one(cat):
    match = cat.route("WHAT  is 17*23", FP, threshold=0.8)
    assert match.how == "search" and match.item.root == "a" * 64
    assert match.score == pytest.approx(1.0)


def test_other_numbers_never_match(cat):
    assert cat.route("What is 17 * 25?", FP, threshold=0.1) is None
    assert cat.route("What is 23 * 17 * 2?", FP, threshold=0.1) is None


NEAR_MISSES = {
    "operator swapped": "What is 10 - 3?",
    "another operator": "What is 10 * 3?",
    "operands swapped": "What is 3 + 10?",
    "one digit changed": "What is 10 + 4?",
    "sign added": "What is -10 + 3?",
    "operator as a word": "What is 10 plus 3?",
}


@pytest.mark.parametrize("kind", list(NEAR_MISSES))
def test_a_near_miss_is_another_problem(tmp_path, kind):
    with catalog.Catalog(tmp_path / "catalog.sqlite") as c:
        c.add([_item("What is 10 + 3?", root="a" * 64)])
        assert c.route("what is 10 + 3", FP, threshold=0.8).item.root == "a" * 64
        assert c.route(NEAR_MISSES[kind], FP, threshold=0.0) is None


def test_units_are_part_of_a_problem(tmp_path):
    problem = (
        "A rope is 3 km long and is cut into equal pieces. How many meters is each of 6 pieces?"
    )
    with catalog.Catalog(tmp_path / "catalog.sqlite") as c:
        c.add([_item(problem, root="a" * 64)])
        assert c.route(problem.replace("?", " ?"), FP, threshold=0.8).how == "search"
        assert c.route(problem.replace("3 km", "3 miles"), FP, threshold=0.0) is None


def test_a_wrong_route_is_never_taken_again_and_gives_way(tmp_path):
    with catalog.Catalog(tmp_path / "catalog.sqlite") as c:
        c.add([_item("What is 10 + 3?", root="a" * 64, answer="12")])
        match = c.route("What is 10 + 3?", FP, threshold=0.8)
        c.record_wrong_route("What is 10 + 3?", match.item, FP, "answered 12, expected 13")
        assert c.route("What is 10 + 3?", FP, threshold=0.0) is None  # exact and search
        assert c.route("  WHAT is 10 +  3? ", FP, threshold=0.0) is None  # the same key
        # A reworded problem is another key: its own hit is verified, and barred if it fails.
        assert c.route("what is 10 + 3", FP, threshold=0.8).item.root == "a" * 64
        # Another model's route is its own.
        assert c.wrong_routes(catalog.normalize_key("What is 10 + 3?"), "weights-b") == set()
        # A verified item for the key replaces the wrong one; search finds it too.
        assert c.add([_item("What is 10 + 3?", root="b" * 64, answer="13")]) == [True]
        assert c.route("What is 10 + 3?", FP, threshold=0.8).item.root == "b" * 64
        assert c.route("what is 10 + 3 ?", FP, threshold=0.8).item.root == "b" * 64
        # Reindexing from manifests in any order keeps the right one.
        c.replace_all(
            [
                _item("What is 10 + 3?", root="a" * 64, answer="12"),
                _item("What is 10 + 3?", root="b" * 64, answer="13"),
            ]
        )
        assert c.route("What is 10 + 3?", FP, threshold=0.8).item.root == "b" * 64


def test_below_threshold_is_no_knowledge(cat):
    query = "Tell me: the secret word is maple, so what is the secret word of the story?"
    low = cat.route(query, FP, threshold=0.95)
    assert low is None
    found = cat.route(query, FP, threshold=0.5)
    assert found is not None and found.item.root == "c" * 64 and 0.5 <= found.score < 0.95


def test_items_of_another_model_are_invisible(cat):
    assert cat.route("What is 17 * 23?", "weights-b", threshold=0.8).item.root == "d" * 64
    assert (
        cat.route("The secret word is maple. What is the secret word?", "weights-b", threshold=0.5)
        is None
    )


def test_first_verified_item_wins_a_key(cat):
    assert cat.add([_item("what is 17 * 23?", root="e" * 64)]) == [False]
    assert cat.get(catalog.normalize_key("What is 17 * 23?"), FP).root == "a" * 64


def test_rejections_are_kept(cat):
    from kvgraft_jax.library import verifiers

    verdict = verifiers.check_answer("17 * 23 = 392", "391")
    cat.reject(
        catalog.Rejection(
            "x1", "What is 17 * 23?", verdict.verifier, verdict.reason, "{}", "dataset"
        )
    )
    assert cat.rejections() == [("x1", "integer", "integer 392 != 391", "dataset")]


def test_replace_all_rebuilds_the_search_index(cat):
    assert cat.replace_all([_item("What is 2 + 2?", root="f" * 64)]) == 1
    assert cat.route("What is 17 * 23?", FP, threshold=0.5) is None
    assert cat.route("what is 2+2", FP, threshold=0.8).item.root == "f" * 64
    assert cat.integrity_ok()


def test_schema_version_mismatch_is_refused(tmp_path):
    path = tmp_path / "catalog.sqlite"
    catalog.Catalog(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='0' WHERE name='schema'")
    db.commit()
    db.close()
    with pytest.raises(catalog.CatalogError, match="reindex moves it aside"):
        catalog.Catalog(path)
    from kvgraft_jax.library import library

    with library.Library(tmp_path, rebuild_unusable_catalog=True) as lib:  # what reindex opens
        assert lib.catalog.items() == []


def test_a_locked_catalog_is_one_line(tmp_path):
    path = tmp_path / "catalog.sqlite"
    catalog.Catalog(path).close()
    opened = catalog.Catalog(path, timeout_s=0.2)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(catalog.CatalogError, match="database is locked"):
            catalog.Catalog(path, timeout_s=0.2)
        with pytest.raises(catalog.CatalogError, match="database is locked"):
            opened.add([_item("What is 1 + 1?")])  # locked during an operation, not at open
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert opened.add([_item("What is 1 + 1?")]) == [True]  # nothing half-done
    opened.close()


def _writer(path, worker, count, shared_keys):
    with catalog.Catalog(path) as c:
        for i in range(count):
            c.add([_item(f"What is {worker} + {i}?", root=f"{worker:02d}{i:062d}")])
        for key in shared_keys:  # every worker races for the same keys
            c.add([_item(key, root=f"{worker:064d}")])


def _opener(directory, rounds, barrier):
    for r in range(rounds):
        barrier.wait(timeout=60)  # every process opens the same new catalog at once
        try:
            catalog.Catalog(directory / f"catalog{r}.sqlite").close()
        except BaseException:
            barrier.abort()  # the others stop at their next round instead of waiting
            raise


def test_processes_creating_one_catalog_together_all_open_it(tmp_path):
    """SQLite refuses a journal-mode change it cannot lock without waiting; CI saw one of six
    writers die with "database is locked" at open. Without the retry in `catalog._use_wal` this
    test failed in one of two runs here (8 processes x 40 fresh catalogs, opened at one instant)."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(8)
    workers = [ctx.Process(target=_opener, args=(tmp_path, 40, barrier)) for _ in range(8)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(timeout=120)
    assert [p.exitcode for p in workers] == [0] * 8


def test_concurrent_processes_lose_nothing(tmp_path):
    path = tmp_path / "catalog.sqlite"
    shared = [f"What is {n} * {n}?" for n in range(5)]
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_writer, args=(path, w, 40, shared)) for w in range(6)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(timeout=120)
        assert p.exitcode == 0
    with catalog.Catalog(path) as c:
        items = c.items(FP)
        assert c.integrity_ok()
    keys = [i.key for i in items]
    assert len(keys) == len(set(keys)) == 6 * 40 + len(shared)
    for w in range(6):
        for i in range(40):
            assert catalog.normalize_key(f"What is {w} + {i}?") in keys


def test_sample_files_are_what_the_code_makes(tmp_path):
    dataset.main(["dataset", str(tmp_path)])
    for name in (dataset.SAMPLE_SEED, dataset.SAMPLE_PROBLEMS):
        assert (tmp_path / name).read_bytes() == (dataset.SAMPLE_DIR / name).read_bytes(), name
    problems = dataset.load(dataset.SAMPLE_DIR / dataset.SAMPLE_PROBLEMS)
    seeds = dataset.load(dataset.SAMPLE_DIR / dataset.SAMPLE_SEED, need_solution=True)
    assert len(problems) == 18 and len(seeds) == 12


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"id": "a", "problem": "p"}', "missing field"),
        ('{"id": "a", "problem": "p", "answer": "1", "extra": 1}', "unknown field"),
        ("[1, 2]", "expected an object"),
        ("{not json", "not JSON"),
        (
            '{"id": "a", "problem": "p", "answer": "1", "solution": "%s"}' % ("x" * 200_000),
            "solution has 200,000 characters",
        ),
        ('{"id": "a", "problem": " ", "answer": "1"}', "empty problem"),
        (
            '{"id": "a", "problem": "p", "answer": "1"}\n{"id": "a", "problem": "q", "answer": "2"}',
            "duplicate id",
        ),
    ],
)
def test_dataset_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(dataset.DatasetError, match=message):
        dataset.load(path)


def test_a_dataset_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"id": "a", "problem": "\xff\xfe", "answer": "1"}\n')
    with pytest.raises(dataset.DatasetError, match="not UTF-8"):
        dataset.load(path)


@pytest.mark.parametrize("damage", [b"not a database at all" * 100, b""])
def test_an_unusable_catalog_is_one_line_and_reindex_can_replace_it(tmp_path, damage):
    from kvgraft_jax.library import library

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / library.CATALOG).write_bytes(
        damage or b"SQLite format 3\x00" + b"\x01" * 200
    )
    with pytest.raises(catalog.CatalogError, match="--mode=reindex moves it aside"):
        library.Library(tmp_path / "lib")
    with library.Library(tmp_path / "lib", rebuild_unusable_catalog=True) as lib:
        assert lib.catalog.items() == [] and lib.catalog.integrity_ok()
    assert any(
        p.name.startswith(f"{library.CATALOG}.unusable-") for p in (tmp_path / "lib").iterdir()
    )
