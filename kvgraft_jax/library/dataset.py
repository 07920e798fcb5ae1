"""JSONL problem sets: `{id, problem, answer}` per line, plus `solution` (and optionally `program`)
for seeding a library from known solutions.

The sample set shipped in `datasets/` is made by `make_sample()` (`python -m kvgraft_jax.library.dataset`
writes it again; a test checks the shipped bytes equal what the code makes).
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path

from kvgraft_jax.run import inputs


class DatasetError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Record:
    id: str
    problem: str
    answer: str
    solution: str = ""
    program: str = ""

    def to_json(self) -> dict[str, str]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v or k in ("id", "answer")}


# Longer than Gemma 3's 131,072-token window at one character per token: no record this long
# can be deposited or solved, and tokenizing it alone could exhaust memory.
MAX_FIELD_CHARS = 131_072


def load(path: str | Path, *, need_solution: bool = False) -> list[Record]:
    """Reads and checks a JSONL file: required fields, strings, unique ids; errors name the line."""
    path = Path(path)
    records, seen = [], set()
    lines = inputs.json_lines(
        path, flag="--dataset", error=DatasetError, where=lambda number: f"{path}:{number}"
    )
    for where, data in lines:
        if not isinstance(data, dict):
            raise DatasetError(f"{where}: expected an object, got {type(data).__name__}")
        required = ("id", "problem", "answer") + (("solution",) if need_solution else ())
        missing = [k for k in required if k not in data]
        if missing:
            raise DatasetError(f"{where}: missing field(s) {', '.join(missing)}")
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(Record)})
        if unknown:
            raise DatasetError(f"{where}: unknown field(s) {', '.join(unknown)}")
        values = {k: v if isinstance(v, str) else json.dumps(v) for k, v in data.items()}
        for name, value in values.items():
            if len(value) > MAX_FIELD_CHARS:
                raise DatasetError(
                    f"{where}: {name} has {len(value):,} characters, more than any model here "
                    f"takes in one context ({MAX_FIELD_CHARS:,}): refused before tokenizing"
                )
        if isinstance(data["answer"], bool) or not isinstance(data["answer"], str | int):
            raise DatasetError(f"{where}: answer must be a string or an integer")
        record = Record(**values)
        if not record.problem.strip():
            raise DatasetError(f"{where}: empty problem")
        if record.id in seen:
            raise DatasetError(f"{where}: duplicate id {record.id!r}")
        seen.add(record.id)
        records.append(record)
    if not records:
        raise DatasetError(f"{path}: no records")
    return records


# -------------------------------------------------------------------------------------------
# The sample set: arithmetic and word lookups, every answer checkable by a program

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_WORDS = ["maple", "river", "copper", "lantern", "orchid", "falcon", "granite", "harbor"]


def _arithmetic(rng: random.Random, index: int) -> Record:
    op = rng.choice(sorted(_OPS))
    a, b = rng.randint(11, 99), rng.randint(2, 49)
    value = _OPS[op](a, b)
    return Record(
        id=f"arith-{index:03d}",
        problem=f"What is {a} {op} {b}?",
        answer=str(value),
        solution=f"{a} {op} {b} = {value}.",
        program=f"print({a} {op} {b})",
    )


def _lookup(index: int) -> Record:
    word = _WORDS[index % len(_WORDS)]
    return Record(
        id=f"lookup-{index:03d}",
        problem=f"The secret word is {word}. What is the secret word?",
        answer=word,
        solution=f"The problem states the secret word: {word}.",
        program=f"text = 'The secret word is {word}.'\nprint(text.split()[-1].rstrip('.'))",
    )


def make_sample(seed: int = 2026) -> tuple[list[Record], list[Record]]:
    """(seed set with solutions, problem set): the problem set repeats most seeded problems (some
    reworded, which routing must still find), adds problems the library does not know, and the
    seed set holds two wrong solutions the verifiers must reject."""
    rng = random.Random(seed)
    arithmetic = [_arithmetic(rng, i) for i in range(12)]
    lookups = [_lookup(i) for i in range(6)]
    seeded = arithmetic[:8] + lookups[:2]
    wrong = [
        dataclasses.replace(
            arithmetic[8],
            id="arith-bad-solution",
            solution=arithmetic[8].solution.replace(
                arithmetic[8].answer, str(int(arithmetic[8].answer) + 1)
            ),
            program="",
        ),
        dataclasses.replace(
            arithmetic[9], id="arith-bad-program", program=f"print({arithmetic[9].answer} + 1)"
        ),
    ]
    seed_set = seeded + wrong
    problems = []
    for i, r in enumerate(seeded + arithmetic[8:] + lookups[2:]):
        problem = r.problem
        if i in (1, 4):  # reworded: other spacing and case, the same terms and numbers
            problem = problem.lower().replace(" ", "  ").rstrip("?")
        problems.append(Record(id=r.id, problem=problem, answer=r.answer))
    return seed_set, problems


def write_jsonl(records: list[Record], path: str | Path) -> None:
    lines = [json.dumps(r.to_json(), sort_keys=True) for r in records]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


SAMPLE_DIR = Path(__file__).resolve().parents[2] / "datasets"  # the repository's datasets/
SAMPLE_SEED = "sample_seed.jsonl"
SAMPLE_PROBLEMS = "sample_problems.jsonl"


def main(argv: list[str]) -> None:
    out = Path(argv[1]) if len(argv) > 1 else SAMPLE_DIR
    out.mkdir(parents=True, exist_ok=True)
    seed_set, problems = make_sample()
    write_jsonl(seed_set, out / SAMPLE_SEED)
    write_jsonl(problems, out / SAMPLE_PROBLEMS)
    print(
        f"wrote {out / SAMPLE_SEED} ({len(seed_set)}) and {out / SAMPLE_PROBLEMS} ({len(problems)})"
    )


if __name__ == "__main__":
    main(sys.argv)
