"""Tokenizers: exact round trips, the special-id contract, SentencePiece train/save/load."""

import gzip
import os

import pytest

from goat_jax.data import documents
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
        return documents.split_documents(f.read())


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


# ----------------------------------------------------------------------------------------
# GPT-2 BPE through tiktoken, from local files only.

# A small byte-level BPE vocabulary: the 256 bytes, then merges in rank order (each merge's
# halves exist at a lower rank, as BPE training produces them).
SMALL_MERGES = [b"th", b"the", b" t", b" the", b"in", b"ng", b"ing", b" a", b"an", b"and",
                b"er", b"e ", b"\xc3\xbc"]


def small_ranks():
    """256 single bytes + ``SMALL_MERGES``: a tiktoken ranks table (bytes -> rank)."""
    ranks = {bytes([b]): b for b in range(256)}
    for merge in SMALL_MERGES:
        ranks[merge] = len(ranks)
    return ranks


def write_small_ranks(path):
    """Writes ``small_ranks()`` in the tiktoken ranks format by hand (base64 token, rank)."""
    import base64

    with open(path, "w", encoding="ascii") as f:
        for token, rank in small_ranks().items():
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    return str(path)


def reference_bpe(text, ranks):
    """Plain-Python byte-pair encoding: GPT-2's regex pieces, then repeatedly merge the
    adjacent pair whose concatenation has the lowest rank (what tiktoken computes)."""
    import regex
    from tiktoken_ext.openai_public import r50k_pat_str

    ids = []
    for piece in regex.findall(r50k_pat_str, text):
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        while True:
            pairs = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:]))
                     if a + b in ranks]
            if not pairs:
                break
            _, i = min(pairs)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] for p in parts]
    return ids


def test_gpt2_tokenizer_from_a_local_ranks_file_matches_a_plain_bpe(tmp_path):
    path = write_small_ranks(tmp_path / "small.tiktoken")
    tok = tokenizers.make_tokenizer(_config(tokenizer="gpt2", bpe_ranks_path=path))
    ranks = small_ranks()
    assert tok.vocab_size == len(ranks) + 1
    assert tok.bos_id == tok.eos_id == tok.pad_id == len(ranks)  # <|endoftext|> after the ranks.
    text = "the thing and the other thing, über ünïcödé\n\n  in  the end<|endoftext|>" + SAMPLE
    ids = tok.encode(text)
    assert ids == reference_bpe(text, ranks)
    assert ranks[b" the"] in ids and ranks[b"ing"] in ids  # Merges were applied.
    assert tok.eos_id not in ids  # A literal "<|endoftext|>" is text, not a boundary.
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text
    # write_bpe_ranks carries an encoding's vocabulary to a file that reads back identically.
    out = str(tmp_path / "written.tiktoken")
    tokenizers.write_bpe_ranks(tokenizers.gpt2_encoding_from_ranks(ranks), out)
    assert tokenizers.read_bpe_ranks(out) == ranks


def test_gpt2_tokenizer_without_local_files_says_how_to_provide_them(tmp_path, monkeypatch):
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    how = r"(?s)data.bpe_ranks_path.*write_bpe_ranks.*TIKTOKEN_CACHE_DIR"
    with pytest.raises(ValueError, match=how):
        tokenizers.make_tokenizer(_config(tokenizer="gpt2"))
    with pytest.raises(ValueError, match="is not a file"):
        tokenizers.make_tokenizer(_config(tokenizer="gpt2", bpe_ranks_path=str(tmp_path / "no")))
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("dGg= 0\nnot-base64 1\n")
    with pytest.raises(ValueError, match="line 2"):
        tokenizers.make_tokenizer(_config(tokenizer="gpt2", bpe_ranks_path=str(bad)))
    bad.write_text("dGg= 0\naW4= 2\n")
    with pytest.raises(ValueError, match="without gaps"):
        tokenizers.make_tokenizer(_config(tokenizer="gpt2", bpe_ranks_path=str(bad)))
    # A cache directory without the gpt2 files, then with corrupt ones: named, never fetched.
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(ValueError, match="lacks"):
        tokenizers.make_tokenizer(_config(tokenizer="gpt2", tiktoken_cache_dir=str(cache)))
    import hashlib

    for url in tokenizers.GPT2_VOCAB_FILES:
        (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes(b"not the vocabulary")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    with pytest.raises(ValueError, match="corrupt"):
        tokenizers.make_tokenizer(_config(tokenizer="gpt2"))
