"""Tokenizers for language-model training: bytes, SentencePiece and GPT-2 BPE (tiktoken).

All share one small interface (``Tokenizer``): ``encode(text) -> list[int]``,
``decode(ids) -> str`` and the attributes ``vocab_size``, ``pad_id``, ``bos_id``, ``eos_id``.
Bytes and SentencePiece use pad 0, BOS 1, EOS 2 (SentencePiece adds unk 3). GPT-2 BPE has one
special token, ``<|endoftext|>`` (50256), which is BOS, EOS and padding at once, as in the
official C4 recipe (docs/protocols.md, C4 125M); padded positions are told apart by the batch
``weights``, never by the id.

The SentencePiece model is trained from the training split the first time a run needs it
and saved to ``spm_model_path``; later runs (and resumed ones) load that file, so the token
ids of a checkpointed run never change underneath it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import itertools
import os
from collections.abc import Iterable
from typing import Protocol

from goat_jax import _extras, files
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import ml_collections

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
TOKENIZERS = ("byte", "sentencepiece", "gpt2")


class Tokenizer(Protocol):
    """What the data pipeline and the evaluators need from a tokenizer."""

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        ...

    def decode(self, ids: Iterable[int]) -> str:
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: pad 0, BOS 1, EOS 2, byte b -> b + 3 (vocab 259).

    Lossless for any text and needs no training, which makes it the default for the tiny
    config and for character-level experiments.
    """

    _OFFSET = 3

    def __init__(self):
        self.pad_id, self.bos_id, self.eos_id = PAD_ID, BOS_ID, EOS_ID
        self.vocab_size = 256 + self._OFFSET

    def encode(self, text: str) -> list[int]:
        """Text -> ids, one per UTF-8 byte, without BOS/EOS."""
        return [b + self._OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; special ids are dropped, broken UTF-8 becomes U+FFFD."""
        data = bytes(int(i) - self._OFFSET for i in ids if self._OFFSET <= int(i) < self.vocab_size)
        return data.decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A trained SentencePiece model (pad 0, BOS 1, EOS 2, unk 3).

    Args:
      model_proto: the serialized model (the bytes of a ``.model`` file).
    """

    def __init__(self, model_proto: bytes):
        with _extras.imports(__name__):
            import sentencepiece as spm  # pylint: disable=g-import-not-at-top

        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = int(self._sp.vocab_size())
        self.pad_id, self.bos_id, self.eos_id = (
            int(self._sp.pad_id()), int(self._sp.bos_id()), int(self._sp.eos_id()))

    @classmethod
    def load(cls, model_path: str) -> SentencePieceTokenizer:
        """Loads a ``.model`` file written by ``train_sentencepiece``."""
        with open(model_path, "rb") as f:
            return cls(f.read())

    def encode(self, text: str) -> list[int]:
        """Text -> piece ids, without BOS/EOS."""
        return list(self._sp.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        """Piece ids -> text; special ids are dropped."""
        specials = (self.pad_id, self.bos_id, self.eos_id)
        return self._sp.decode([int(i) for i in ids if int(i) not in specials])


# GPT-2's vocabulary as tiktoken fetches it (``tiktoken_ext.openai_public.gpt2``): the two
# files of the GPT-2 release and their SHA-256. tiktoken caches a download under
# ``$TIKTOKEN_CACHE_DIR/sha1(url)``; nothing here downloads.
GPT2_VOCAB_FILES = {
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe":
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json":
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
GPT2_ENDOFTEXT = "<|endoftext|>"
# GPT-2's pre-tokenization pattern (tiktoken's r50k pattern, the one of the GPT-2 release).
GPT2_PATTERN = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)"""
                r"""|\s""")
_WRITE_RANKS_HINT = (
    "On a machine with network access run\n"
    "  python -c \"import tiktoken; from goat_jax.data.tokenizers import write_bpe_ranks; "
    "write_bpe_ranks(tiktoken.get_encoding('gpt2'), 'gpt2.tiktoken')\"\n"
    "and set data.bpe_ranks_path to the copied gpt2.tiktoken; or copy tiktoken's cache "
    "(TIKTOKEN_CACHE_DIR there, holding the two gpt2 files) and set data.tiktoken_cache_dir "
    "(or the TIKTOKEN_CACHE_DIR environment variable) to it.")


class TiktokenTokenizer:
    """GPT-2 byte-level BPE through ``tiktoken``: ``<|endoftext|>`` is BOS = EOS = pad.

    Args:
      encoding: a ``tiktoken.Encoding`` whose only special token is ``<|endoftext|>``
        (``gpt2``, or a small one built from local ranks in tests).
    """

    def __init__(self, encoding):
        special = encoding.special_tokens_set
        if special != {GPT2_ENDOFTEXT}:
            raise ValueError(f"TiktokenTokenizer needs an encoding whose only special token is "
                             f"{GPT2_ENDOFTEXT!r}; {encoding.name!r} has {sorted(special)}.")
        self._encoding = encoding
        self.vocab_size = int(encoding.n_vocab)
        self.pad_id = self.bos_id = self.eos_id = int(encoding.eot_token)

    def encode(self, text: str) -> list[int]:
        """Text -> BPE ids, without BOS/EOS; a literal "<|endoftext|>" in the text is encoded as
        ordinary text, so documents cannot inject document boundaries."""
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: Iterable[int]) -> str:
        """BPE ids -> text; ``<|endoftext|>`` is dropped, broken UTF-8 becomes U+FFFD."""
        return self._encoding.decode([int(i) for i in ids if int(i) != self.eos_id])


def read_bpe_ranks(path: str) -> dict[bytes, int]:
    """Reads a tiktoken ranks file (one ``base64(token) rank`` per line, e.g. ``gpt2.tiktoken``).

    Raises:
      ValueError: naming ``data.bpe_ranks_path`` when the file is missing or malformed.
    """
    if not os.path.isfile(path):
        raise ValueError(f"data.bpe_ranks_path={path!r} is not a file. {_WRITE_RANKS_HINT}")
    ranks = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:
                raise ValueError(
                    f"data.bpe_ranks_path={path!r}, line {number}: expected 'base64(token) rank' "
                    f"({e}). {_WRITE_RANKS_HINT}") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"data.bpe_ranks_path={path!r}: the ranks are not 0..{len(ranks) - 1} "
                         f"without gaps or repeats. {_WRITE_RANKS_HINT}")
    return ranks


def write_bpe_ranks(encoding, path: str) -> None:
    """Writes ``encoding``'s mergeable ranks as a tiktoken ranks file that ``read_bpe_ranks``
    (``data.bpe_ranks_path``) reads back: how to carry GPT-2's vocabulary to an offline host."""
    ranks = encoding._mergeable_ranks  # pylint: disable=protected-access
    items = sorted(ranks.items(), key=lambda kv: kv[1])
    files.write_whole(path, "".join(f"{base64.b64encode(token).decode('ascii')} {rank}\n" for token, rank in items))


def gpt2_encoding_from_ranks(ranks: dict[bytes, int], name: str = "gpt2"):
    """A ``tiktoken.Encoding`` with GPT-2's pattern, ``ranks`` and ``<|endoftext|>`` after them."""
    with _extras.imports(__name__):
        import tiktoken  # pylint: disable=g-import-not-at-top

    return tiktoken.Encoding(name=name, pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={GPT2_ENDOFTEXT: len(ranks)})


@contextlib.contextmanager
def _environ(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def load_gpt2_tokenizer(data_config: ml_collections.ConfigDict) -> TiktokenTokenizer:
    """GPT-2 BPE from local files only: ``data.bpe_ranks_path`` (a ranks file), else tiktoken's
    cache in ``data.tiktoken_cache_dir`` or ``$TIKTOKEN_CACHE_DIR``.

    Raises:
      ValueError: naming both ways to provide the vocabulary offline when neither is there
        (tiktoken would otherwise try to download it, which a training host must not do).
    """
    if data_config.bpe_ranks_path:
        ranks = read_bpe_ranks(data_config.bpe_ranks_path)
        return TiktokenTokenizer(gpt2_encoding_from_ranks(ranks))
    cache_dir = data_config.tiktoken_cache_dir or os.environ.get("TIKTOKEN_CACHE_DIR", "")
    missing = [url for url in GPT2_VOCAB_FILES if not cache_dir or not os.path.isfile(
        os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest()))]
    if missing:
        where = (f"the tiktoken cache {cache_dir!r} lacks {missing}" if cache_dir else
                 "neither data.bpe_ranks_path nor data.tiktoken_cache_dir (nor TIKTOKEN_CACHE_DIR) "
                 "is set")
        raise ValueError(f"data.tokenizer='gpt2' needs GPT-2's vocabulary files locally: {where}. "
                         f"{_WRITE_RANKS_HINT}")
    for url, sha256 in GPT2_VOCAB_FILES.items():
        with open(os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest()), "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != sha256:
                raise ValueError(f"The tiktoken cache {cache_dir!r} holds a corrupt copy of {url} "
                                 f"(SHA-256 differs). {_WRITE_RANKS_HINT}")
    with _extras.imports(__name__):
        import tiktoken  # pylint: disable=g-import-not-at-top

    # Both files were verified above, so tiktoken reads its cache and never fetches.
    with _environ("TIKTOKEN_CACHE_DIR", cache_dir):
        return TiktokenTokenizer(tiktoken.get_encoding("gpt2"))


def train_sentencepiece(
    texts: Iterable[str],
    model_path: str,
    *,
    vocab_size: int,
    max_sentences: int = 200_000,
) -> SentencePieceTokenizer:
    """Trains a unigram SentencePiece model on ``texts``, writes it to ``model_path``, returns it.

    The model is made lossless, so ``decode(encode(s)) == s`` for any string: identity
    normalization and no whitespace collapsing (code and tables keep their layout), no dummy
    prefix, and byte fallback instead of an unk token for characters never seen in training.

    Args:
      texts: documents; each is split into lines, the unit SentencePiece trains on. Only the
        first ``max_sentences`` non-empty lines are read (deterministic, and training time is
        roughly linear in it).
      model_path: where the ``.model`` file goes (written atomically; parent dirs are created).
      vocab_size: size of the vocabulary including the 4 special ids and 256 byte pieces.
      max_sentences: cap on the number of training lines.
    """
    with _extras.imports(__name__):
        import sentencepiece as spm  # pylint: disable=g-import-not-at-top

    lines = (line.strip() for text in texts for line in text.splitlines())
    sentences = list(itertools.islice((l for l in lines if l), max_sentences))
    if not sentences:
        raise ValueError("train_sentencepiece got no text: check data.paths / data.source.")
    buffer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=buffer, vocab_size=vocab_size,
            model_type="unigram", pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID,
            byte_fallback=True, normalization_rule_name="identity",
            remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, split_digits=True, character_coverage=1.0,
            input_sentence_size=0, max_sentence_length=16384,
            num_threads=min(16, os.cpu_count() or 1),
            minloglevel=2)
    except RuntimeError as e:
        raise ValueError(
            f"SentencePiece training failed for data.spm_vocab_size={vocab_size} ({e}). "
            "A byte-fallback model needs more than 259 + the number of distinct characters; "
            "raise data.spm_vocab_size.") from e
    directory = os.path.dirname(os.path.abspath(model_path))
    os.makedirs(directory, exist_ok=True)
    # Whole so that a crash mid-write never leaves a truncated model for the next run to load.
    files.write_whole(model_path, buffer.getvalue())
    return SentencePieceTokenizer(buffer.getvalue())


def make_tokenizer(
    data_config: ml_collections.ConfigDict,
    texts: Iterable[str] | None = None,
    *,
    allow_training: bool = True,
) -> Tokenizer:
    """Builds the tokenizer named by ``data_config.tokenizer`` ('byte', 'sentencepiece', 'gpt2').

    For 'gpt2', see ``load_gpt2_tokenizer`` (local files only, never a download).

    For 'sentencepiece', ``data_config.spm_model_path`` is loaded if it exists; otherwise a
    model of ``spm_vocab_size`` pieces is trained on ``texts`` (at most
    ``spm_train_max_sentences`` lines, read lazily, so pass a generator) and saved there. The
    returned tokenizer's ``vocab_size`` is the loaded model's, which is the one to build the
    model with.

    Args:
      data_config: the data config (see ``goat_jax.data.text``).
      texts: training documents, only read if a SentencePiece model must be trained.
      allow_training: False forbids training (multi-host runs: hosts training separately
        could disagree on ids, so the model must exist before the run starts).
    """
    kind = data_config.tokenizer
    if kind == "byte":
        return ByteTokenizer()
    if kind == "gpt2":
        return load_gpt2_tokenizer(data_config)
    if kind != "sentencepiece":
        raise ValueError(
            f"data.tokenizer={kind!r} is unknown: use one of {TOKENIZERS}.")
    path = data_config.spm_model_path
    if not path:
        raise ValueError(
            "data.spm_model_path is empty: set it to a .model file to load, or to a path where "
            "the model trained on the data should be saved.")
    if os.path.exists(path):
        return SentencePieceTokenizer.load(path)
    if not allow_training:
        raise ValueError(
            f"data.spm_model_path={path!r} does not exist and training it is not allowed here "
            "(multi-host run): train it once with a single process (make_tokenizer) first.")
    if texts is None:
        raise ValueError(
            f"data.spm_model_path={path!r} does not exist: pass texts= to train it, or point "
            "data.spm_model_path at an existing model.")
    return train_sentencepiece(
        texts, path, vocab_size=data_config.spm_vocab_size,
        max_sentences=data_config.spm_train_max_sentences)

