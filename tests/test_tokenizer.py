"""The tiny SentencePiece tokenizer: Gemma 3's special ids, byte fallback, reproducible build."""

import hashlib

import pytest

from kvgraft_jax.core import tokenizer


@pytest.fixture(scope="module")
def tok():
    return tokenizer.tiny_tokenizer()


def test_special_token_ids_match_gemma3(tok):
    from gemma.gm.text import _tokenizer as gemma_tokenizer

    special = gemma_tokenizer.Gemma3Tokenizer.special_tokens
    assert tok.pad_id == special.PAD == 0
    assert tok.eos_id == special.EOS == 1
    assert tok.bos_id == special.BOS == 2
    assert tok.piece_to_id("<unk>") == special.UNK == 3
    assert tok.piece_to_id("<mask>") == special.MASK == 4
    assert tok.piece_to_id("<start_of_turn>") == special.START_OF_TURN == 105
    assert tok.piece_to_id("<end_of_turn>") == special.END_OF_TURN == 106
    assert tok.vocab_size == tokenizer.TINY_VOCAB_SIZE == 1024


@pytest.mark.parametrize(
    "text",
    [
        "The cache key is 12345.",
        "def add(a, b):\n    return a + b\n",
        "  leading, trailing  and\tmixed   whitespace  ",
        "Grüße, 世界, Ελληνικά, مرحبا 🙂🚀",
        "",
    ],
)
def test_round_trip_is_lossless(tok, text):
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == tok.bos_id
    assert all(0 < i < tok.vocab_size for i in ids)
    assert tok.decode(ids[1:]) == text


def test_unseen_characters_use_byte_fallback_not_unk(tok):
    ids = tok.encode("ꙮ")  # not in the training corpus
    assert tok.piece_to_id("<unk>") not in ids
    assert len(ids) == len("ꙮ".encode())


def test_digits_are_split(tok):
    assert len(tok.encode("98765")) == 5


def test_shipped_model_is_what_the_trainer_builds():
    shipped = tokenizer.tiny_tokenizer().info().fingerprint
    assert hashlib.sha256(tokenizer.train_tiny_tokenizer()).hexdigest() == shipped


def test_missing_file_names_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="--tokenizer=PATH"):
        tokenizer.Tokenizer.from_file(tmp_path / "nope.model")


def test_from_file_matches_shipped(tmp_path):
    path = tokenizer.write_tiny_tokenizer(tmp_path / "t.model")
    assert tokenizer.Tokenizer.from_file(path).info() == tokenizer.tiny_tokenizer().info()
