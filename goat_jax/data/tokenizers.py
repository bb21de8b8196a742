"""Tokenizers for language-model training: bytes and SentencePiece.

Both share one small interface (``Tokenizer``): ``encode(text) -> list[int]``,
``decode(ids) -> str`` and the attributes ``vocab_size``, ``pad_id``, ``bos_id``, ``eos_id``.
The special ids are the same for both (pad 0, BOS 1, EOS 2; SentencePiece adds unk 3),
so a padding mask is ``ids != 0`` whichever tokenizer produced them.

The SentencePiece model is trained from the training split the first time a run needs it
and saved to ``spm_model_path``; later runs (and resumed ones) load that file, so the token
ids of a checkpointed run never change underneath it.
"""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Iterable
from typing import Protocol

import ml_collections

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


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
    # Atomic so that a crash mid-write never leaves a truncated model for the next run to load.
    tmp_path = f"{model_path}.tmp.{os.getpid()}"
    with open(tmp_path, "wb") as f:
        f.write(buffer.getvalue())
    os.replace(tmp_path, model_path)
    return SentencePieceTokenizer(buffer.getvalue())


def make_tokenizer(
    data_config: ml_collections.ConfigDict,
    texts: Iterable[str] | None = None,
    *,
    allow_training: bool = True,
) -> Tokenizer:
    """Builds the tokenizer named by ``data_config.tokenizer`` ('byte' or 'sentencepiece').

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
    if kind != "sentencepiece":
        raise ValueError(
            f"data.tokenizer={kind!r} is unknown: use 'byte' or 'sentencepiece'.")
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
    if data_config.spm_vocab_size < 1:
        raise ValueError(f"data.spm_vocab_size={data_config.spm_vocab_size} must be positive.")
    return train_sentencepiece(
        texts, path, vocab_size=data_config.spm_vocab_size,
        max_sentences=data_config.spm_train_max_sentences)

