"""Document-aware packing (``data.packing = 'documents'``): whole documents in windows, with
segment ids and per-document positions, for :mod:`goat_jax.data.text`.

    token arrays [BOS, ..., EOS] (one per document, this host's shard, shuffled)
      -> pieces of at most seq_len + 1 tokens (a longer document is split; consecutive pieces
         share one token, so every target is predicted exactly once)
      -> {'inputs': piece[:-1], 'targets': piece[1:]}
      -> first-fit into windows of seq_len (grain's FirstFitPackIterDataset)
      -> inputs, targets, weights, segment_ids, positions

Batch fields, each [b, seq_len] (``'concat'`` batches have only the first three):

    inputs       int32    token ids; padding holds the tokenizer's pad id
    targets      int32    the next token *of the same document* (never across a boundary)
    weights      float32  1 on real targets, 0 on padding
    segment_ids  int32    1, 2, ... for the documents (pieces) of a row in order, then
                          ``PAD_SEGMENT_ID`` on the padding: non-decreasing along every row, the
                          contract under which the flash kernel skips tiles across documents
                          (goat_jax/kernels/mask.py); padding sees only padding
    positions    int32    0, 1, ... restarting at each document (and at the padding)

Choices, and why:

* **grain's first-fit packer** rather than our own: it is a checkpointable grain iterator
  (its state is the parent's state at the start of the packing round plus the next row, so a
  restore re-packs that round identically), it emits segment ids and positions, and first-fit
  over a pool of windows wastes far less than greedy next-fit (a document that does not fit
  the open window goes to any other window with room, not to a fresh one). The pool is at
  least ``MIN_PACKING_BINS`` windows and a multiple of the local batch, so each round is whole
  batches: a checkpoint between batches never splits a batch. Documents of one round are
  consecutive in the shuffled stream, so the order stays random.
* **A document longer than seq_len is split, and every piece restarts at position 0**: the
  model is trained on positions 0 .. seq_len - 1 only (a learned position table has no row
  beyond ``max_len``, and extrapolation is measured past seq_len, so training must not see
  longer positions); a continued piece is then a window of a long document, as in
  ``'concat'``. Its first token is not BOS, so sink statistics on "first tokens" should use
  the first piece (``positions == 0`` where ``inputs == BOS``).
* **Pieces are cut at seq_len + 1 tokens, overlapping by one**: a piece's last token is the
  target of its last input and the first input of the next piece, as in the concat windows.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import grain

PACKINGS = ("concat", "documents")
PAD_SEGMENT_ID = int(np.iinfo(np.int32).max)  # above every document id: rows stay non-decreasing
MIN_PACKING_BINS = 16  # first-fit pool: fuller windows than next-fit even at batch size 1


class _DocumentPieces(grain.experimental.FlatMapTransform):
    """A token array -> examples of at most ``seq_len`` (input, target) pairs."""

    max_fan_out = 1 << 20  # only bounds MapDataset flat maps; the iterator one buffers a list

    def __init__(self, seq_len: int):
        self._seq_len = seq_len

    def flat_map(self, tokens: np.ndarray) -> list[dict[str, np.ndarray]]:
        """The pieces of one document, in order (none for a document of < 2 tokens)."""
        n, step = len(tokens), self._seq_len
        return [{"inputs": tokens[a:min(a + step, n - 1)], "targets": tokens[a + 1:min(a + step + 1, n)]}
                for a in range(0, n - 1, step)]


def num_packing_bins(local_batch: int) -> int:
    """Windows packed per first-fit round: a multiple of ``local_batch`` >= MIN_PACKING_BINS."""
    return local_batch * -(-MIN_PACKING_BINS // local_batch)


def pack_documents(stream: grain.IterDataset, *, seq_len: int, pad_id: int,
                   num_bins: int, max_documents: Optional[int] = None) -> grain.IterDataset:
    """Packs a stream of token arrays (documents) into examples with segment ids and
    positions (module doc); finite streams end with a partial round of windows.

    Args:
      stream: IterDataset of int32 token arrays, each one document ([BOS, ..., EOS]).
      seq_len: tokens per window.
      pad_id: token id written into the padding.
      num_bins: windows per first-fit round (:func:`num_packing_bins`).
      max_documents: when given, no window holds more than this many documents, the padding
        counting as one: a window that reaches the bound is closed and the next document starts
        another (grain's ``max_sequences_per_bin``, ``max_documents - 1`` so that room is left
        for the padding), and every window is checked on the host as well
        (:func:`check_documents_per_row`). The bound of cuDNN's packed layout,
        ``model.max_documents_per_row`` (:func:`goat_jax.tasks.lm.document_bound`); at least 2.
    """
    if seq_len < 1 or num_bins < 1:
        raise ValueError(f"seq_len={seq_len} and num_bins={num_bins} must be >= 1.")
    if max_documents is not None and max_documents < 2:
        raise ValueError(
            f"model.max_documents_per_row={max_documents}: a packed window holds at least one document "
            "and usually padding, which cuDNN's packed layout counts as one more; set it to at least 2 "
            "(its memory: docs/packing.md), or set model.implementation='flash'.")
    pieces = grain.experimental.FlatMapIterDataset(stream, _DocumentPieces(seq_len))
    packed = grain.experimental.FirstFitPackIterDataset(
        pieces, length_struct={"inputs": seq_len, "targets": seq_len}, num_packing_bins=num_bins,
        # Each round is a few whole batches already drawn from a shuffled stream: shuffling the
        # windows within it adds nothing, and the rows of a batch stay in packing order.
        shuffle_bins=False, padding_struct={"inputs": pad_id, "targets": pad_id},
        max_sequences_per_bin=None if max_documents is None else max_documents - 1)
    examples = packed.map(_to_example)
    if max_documents is not None:
        examples = examples.map(functools.partial(check_documents_per_row, max_documents=max_documents))
    return examples


def check_documents_per_row(example: dict[str, np.ndarray], max_documents: int) -> dict[str, np.ndarray]:
    """``example`` unchanged, after checking that its ``segment_ids`` hold at most
    ``max_documents`` runs (documents, the padding counting as one). Raises ValueError naming
    ``model.max_documents_per_row`` otherwise: cuDNN's packed layout is sized by it
    (goat_jax/kernels/cudnn_packed.py), and a row that does not fit would be lost. The packer
    never makes such a row (:func:`pack_documents`): this guards that promise."""
    ids = np.asarray(example["segment_ids"])
    runs = int(1 + np.count_nonzero(ids[1:] != ids[:-1])) if ids.size else 0
    if runs > max_documents:
        raise ValueError(
            f"A packed window holds {runs} documents (the padding counting as one), more than "
            f"model.max_documents_per_row={max_documents}, the static bound of cuDNN's packed layout on "
            f"GPUs. Raise model.max_documents_per_row to at least {runs} (its memory: "
            "docs/packing.md), or set model.implementation='flash'.")
    return example


def _to_example(packed: dict[str, Any]) -> dict[str, np.ndarray]:
    """grain's packed row -> the batch fields (padding: weight 0, PAD_SEGMENT_ID, positions
    restarting at 0 where the padding starts)."""
    seg = np.asarray(packed["targets_segment_ids"], np.int32)
    real = seg > 0  # grain marks padding with segment 0, after the last document
    n_real = int(real.sum())
    positions = np.asarray(packed["targets_positions"], np.int32).copy()
    positions[n_real:] = np.arange(len(seg) - n_real, dtype=np.int32)
    return {
        "inputs": np.asarray(packed["inputs"], np.int32),
        "targets": np.asarray(packed["targets"], np.int32),
        "weights": real.astype(np.float32),
        "segment_ids": np.where(real, seg, PAD_SEGMENT_ID).astype(np.int32),
        "positions": positions,
    }


def padding_example(seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """An all-padding example (weight 0) with the fields of :func:`pack_documents`'s."""
    return {
        "inputs": np.full(seq_len, pad_id, np.int32),
        "targets": np.full(seq_len, pad_id, np.int32),
        "weights": np.zeros(seq_len, np.float32),
        "segment_ids": np.full(seq_len, PAD_SEGMENT_ID, np.int32),
        "positions": np.arange(seq_len, dtype=np.int32),
    }
