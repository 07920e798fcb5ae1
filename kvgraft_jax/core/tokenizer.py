"""Tokenizers: gemma's SentencePiece tokenizer over a local `.model` file, and the tiny test tokenizer.

gemma's `gm.text.Gemma3Tokenizer()` downloads its model from GCS when no path is given, which fails
offline, so every tokenizer here is built from a local file. The tiny tokenizer is a real
SentencePiece model trained by this module on a corpus it generates; it keeps Gemma 3's special-token
ids (pad 0, eos 1, bos 2, unk 3, mask 4, <start_of_turn> 105, <end_of_turn> 106) and byte fallback, so
every mode works on any text with the tiny models too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import random
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import sentencepiece as spm

TINY_TOKENIZER_ASSET = "tiny_tokenizer.model"
TINY_VOCAB_SIZE = 1024

# Gemma 3 reserves ids 4..106 for these pieces; keeping the same ids keeps prompts interchangeable.
_GEMMA3_RESERVED_PIECES = (
    "<mask>",
    "[multimodal]",
    *(f"<unused{i}>" for i in range(99)),
    "<start_of_turn>",
    "<end_of_turn>",
)

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "one",
    "all",
    "we",
    "their",
    "has",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "cache",
    "key",
    "value",
    "token",
    "model",
    "layer",
    "head",
    "window",
    "position",
    "prefix",
    "query",
    "graft",
    "deposit",
    "artifact",
    "library",
    "verify",
    "exact",
    "digest",
    "shard",
    "mesh",
    "device",
    "array",
    "state",
    "decode",
    "prefill",
    "chunk",
    "schedule",
    "answer",
    "problem",
    "solution",
    "proof",
    "number",
    "sum",
    "product",
    "prime",
    "square",
    "root",
    "integer",
    "fraction",
    "equal",
    "greater",
    "less",
    "first",
    "second",
    "third",
    "last",
    "next",
    "time",
    "work",
    "energy",
    "speed",
    "memory",
    "disk",
    "read",
    "write",
    "store",
    "restore",
    "load",
    "save",
    "check",
    "test",
    "pass",
    "fail",
    "error",
    "result",
    "report",
    "step",
    "compute",
    "recompute",
    "knowledge",
    "manual",
    "document",
    "chapter",
    "section",
    "page",
    "line",
    "word",
    "text",
    "language",
    "code",
    "program",
    "function",
    "return",
    "print",
    "import",
    "class",
    "define",
    "value",
    "list",
    "map",
    "set",
    "loop",
    "while",
    "if",
    "else",
    "true",
    "false",
    "none",
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "hundred",
    "thousand",
    "million",
    "water",
    "earth",
    "light",
    "sound",
    "heat",
    "force",
    "mass",
    "volume",
    "area",
    "angle",
    "circle",
    "triangle",
    "rectangle",
    "length",
    "width",
    "height",
    "point",
    "plane",
    "space",
    "river",
    "city",
    "country",
]

_CODE_LINES = (
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "import math\nprint(math.sqrt(16))\n",
    "class Cache:\n    def __init__(self, size):\n        self.size = size\n",
    "if x > 0 and y < 0:\n    total += x - y\n",
    "result = [n for n in numbers if n % 2 == 0]\n",
)


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    """What a manifest records about a tokenizer."""

    kind: str  # "sentencepiece"
    vocab_size: int
    fingerprint: str  # SHA-256 of the serialized SentencePiece model proto


class TokenizerError(ValueError):
    """A file that is not a SentencePiece model."""


class Tokenizer:
    """A SentencePiece tokenizer with Gemma's conventions (BOS prepended on request, no dummy prefix)."""

    def __init__(self, model_proto: bytes, *, source: str):
        self._proto = model_proto
        self.source = source
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(model_proto)
        except RuntimeError:  # sentencepiece's parse failure (its message names only its source)
            raise TokenizerError(
                f"{source} is not a SentencePiece model ({len(model_proto)} bytes that do not "
                "parse): pass --tokenizer=PATH to the release's tokenizer.model"
            ) from None
        # Fixed by the model proto: read once.
        self.vocab_size: int = self._sp.GetPieceSize()
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        self.pad_id: int = self._sp.pad_id()

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"tokenizer model {str(path)!r} not found: pass --tokenizer=PATH to a SentencePiece "
                "`.model` file (for Gemma 3, `tokenizer.model` from the Gemma release); nothing is "
                "downloaded at run time"
            )
        return cls(path.read_bytes(), source=str(path))

    def piece_to_id(self, piece: str) -> int:
        return self._sp.PieceToId(piece)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(self._sp.EncodeAsIds(text))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])

    def info(self) -> TokenizerInfo:
        return TokenizerInfo(
            kind="sentencepiece",
            vocab_size=self.vocab_size,
            fingerprint=hashlib.sha256(self._proto).hexdigest(),
        )


def tiny_tokenizer() -> Tokenizer:
    """The tokenizer shipped with the package for the tiny model family."""
    asset = resources.files("kvgraft_jax") / "assets" / TINY_TOKENIZER_ASSET
    return Tokenizer(asset.read_bytes(), source=f"kvgraft_jax/assets/{TINY_TOKENIZER_ASSET}")


def tiny_corpus(*, num_lines: int = 4000, seed: int = 0) -> str:
    """Deterministic training text: English-like prose, numbers and short programs."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        kind = i % 4
        if kind == 3:
            lines.append(rng.choice(_CODE_LINES))
            continue
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if kind == 2:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 100000)))
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice((".", "?", "!", ":", ",")))
    return "\n".join(lines)


def train_tiny_tokenizer() -> bytes:
    """Trains the tiny SentencePiece model; deterministic (one thread, fixed corpus)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(tiny_corpus().splitlines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=TINY_VOCAB_SIZE,
        byte_fallback=True,
        character_coverage=1.0,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        user_defined_symbols=list(_GEMMA3_RESERVED_PIECES),
        add_dummy_prefix=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def write_tiny_tokenizer(path: str | Path) -> Path:
    """Regenerates the shipped asset (`python -m kvgraft_jax.core.tokenizer`)."""
    path = Path(path)
    path.write_bytes(train_tiny_tokenizer())
    return path


if __name__ == "__main__":
    out = Path(__file__).parents[1] / "assets" / TINY_TOKENIZER_ASSET
    print(write_tiny_tokenizer(out))
