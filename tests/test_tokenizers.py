"""Tokenizers: exact round trips, the special-id contract, SentencePiece train/save/load."""

import gzip
import os

import pytest

from goat_jax.data import text as text_lib
from goat_jax.data import tokenizers

SAMPLE = "Hello, world!\n\n  two  spaces\ttab, ünïcödé, 日本語, ☃ and a final newline\n"


def _config(**overrides):
    cfg = text_lib.default_data_config()
    cfg.update(overrides)
    return cfg


def test_byte_tokenizer_contract_and_round_trip():
    tok = tokenizers.ByteTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 259)
    assert tok.encode("A\x00\xff") == [ord("A") + 3, 3, 0xC3 + 3, 0xBF + 3]
    ids = tok.encode(SAMPLE)
    assert len(ids) == len(SAMPLE.encode("utf-8"))
    assert all(3 <= i < 259 for i in ids)
    assert tok.decode(ids) == SAMPLE
    # Specials are structure, not text.
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == SAMPLE


@pytest.fixture(scope="module")
def jargon_docs():
    with gzip.open(text_lib.JARGON_FILE, "rt", encoding="utf-8") as f:
        return text_lib.split_documents(f.read())


def test_sentencepiece_trains_on_jargon_saves_and_reloads(tmp_path, jargon_docs):
    path = str(tmp_path / "spm" / "jargon.model")
    cfg = _config(tokenizer="sentencepiece", spm_model_path=path, spm_vocab_size=512,
                  spm_train_max_sentences=3000)
    trained = tokenizers.make_tokenizer(cfg, texts=iter(jargon_docs))
    assert os.path.isfile(path)
    assert trained.vocab_size == 512
    assert (trained.pad_id, trained.bos_id, trained.eos_id) == (0, 1, 2)

    # A second call loads the saved file and must not touch the texts.
    loaded = tokenizers.make_tokenizer(cfg, texts=None)
    excerpt = jargon_docs[1000] + "\n\n" + jargon_docs[2000]
    ids = loaded.encode(excerpt)
    assert ids == trained.encode(excerpt)
    assert len(ids) < 0.8 * len(excerpt.encode("utf-8"))  # It learned pieces, not bytes.
    assert all(3 <= i < 512 for i in ids)
    assert loaded.decode(ids) == excerpt
    # Byte fallback keeps characters never seen in training lossless.
    assert loaded.decode(loaded.encode(SAMPLE)) == SAMPLE
    assert loaded.decode([loaded.bos_id, *ids, loaded.eos_id]) == excerpt


def test_make_tokenizer_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="data.tokenizer"):
        tokenizers.make_tokenizer(_config(tokenizer="wordpiece"))
    with pytest.raises(ValueError, match="data.spm_model_path"):
        tokenizers.make_tokenizer(_config(tokenizer="sentencepiece", spm_model_path=""))
    missing = str(tmp_path / "missing.model")
    cfg = _config(tokenizer="sentencepiece", spm_model_path=missing)
    with pytest.raises(ValueError, match="data.spm_model_path"):
        tokenizers.make_tokenizer(cfg, texts=None)
    with pytest.raises(ValueError, match="multi-host"):
        tokenizers.make_tokenizer(cfg, texts=["some text"], allow_training=False)
    cfg.spm_vocab_size = 265  # Below 4 specials + 256 bytes + the distinct characters.
    with pytest.raises(ValueError, match="data.spm_vocab_size"):
        tokenizers.make_tokenizer(cfg, texts=[SAMPLE * 3, "The quick brown fox jumps."])
    assert not os.path.exists(missing)
