"""The language-model text pipeline: documents -> tokens -> packed windows -> host batches.

    documents (local text files | TFDS | parquet | jsonl)
      -> this host's shard -> shuffle (a new order every epoch) -> tokens, BOS ... EOS
      -> packing 'concat' (default): concatenated and cut into windows of seq_len + 1 tokens
         (documents may straddle; ``bos_windows``: documents are ``... EOS`` and every window
         is BOS + seq_len tokens) -> {'inputs': w[:-1], 'targets': w[1:], 'weights'}
      -> packing 'documents': whole documents first-fit into windows, with 'segment_ids' and
         per-document 'positions' (``goat_jax.data.packing``)
      -> local batch

Entry point: ``make_lm_datasets(data_config, seq_len=, global_batch_size=, seed=)`` returns
``(train_iter, make_eval_iter, tokenizer)``. Batches are dicts of numpy arrays, with
b = global_batch_size // process_count examples per host:

    inputs  int32   [b, seq_len]   token ids
    targets int32   [b, seq_len]   inputs shifted left by one (the next token)
    weights float32 [b, seq_len]   1 on real targets, 0 on padding (only in eval with
                                   'concat'; 'documents' pads every window's tail)
    segment_ids, positions  int32 [b, seq_len]   'documents' only (goat_jax.data.packing)

* ``train_iter`` repeats forever. ``train_iter.get_state()`` is a small JSON-serializable dict
  (a few integers); ``set_state(state)`` on an iterator built with the same config, seed and
  process layout continues with exactly the batches the uninterrupted one would have given.
* ``make_eval_iter()`` returns a fresh, finite, never-shuffled iterator over the held-out
  split each time it is called: exactly ``num_eval_batches`` batches on every host (padded
  with weight-0 windows if the split runs out, so all hosts run the same number of steps).
* ``tokenizer``: see ``goat_jax.data.tokenizers``; build the model with ``tokenizer.vocab_size``.

Multi-host: each process reads a disjoint shard of the documents (of the blocks, for
parquet/jsonl) and yields only its local batch; ``to_global_array`` assembles the global one.

Data config fields (``default_data_config()`` is the Jargon File with bytes):
  source                 'text_files' | 'tfds' | 'parquet' | 'jsonl'
  paths                  files or glob patterns (a str or a list) for the file sources
  eval_paths             optional held-out files; if empty, ``eval_fraction`` is held out
  eval_fraction          fraction of distinct documents (text_files) or blocks (parquet/jsonl)
                         held out for eval, chosen by content hash, independent of the seed;
                         every copy of a held-out document is held out with it
  doc_split              text_files only: 'entries' (a document starts at each unindented
                         heading line and each Jargon-style ':headword:' line), 'paragraphs'
                         (blank-line separated) or 'files' (one document per file)
  text_key               the text field of a TFDS / parquet / jsonl record ('text')
  tfds_name              e.g. 'c4/en'; must already be prepared as array_record in
                         tfds_data_dir (read with tfds.data_source: random access, no TF)
  tfds_data_dir          '' means the TFDS default
  tfds_train_split, tfds_eval_split   e.g. 'train', 'validation'
  jsonl_block_bytes      jsonl files are read in blocks of about this many bytes, the unit
                         of sharding and of shuffling; .jsonl.gz files are one block each
  tokenizer              'byte' | 'sentencepiece' | 'gpt2' (GPT-2 BPE through tiktoken)
  bpe_ranks_path         gpt2: a local tiktoken ranks file (``tokenizers.write_bpe_ranks``)
  tiktoken_cache_dir     gpt2: a local tiktoken cache holding the gpt2 files (if no ranks file)
  packing                'concat' (documents concatenated, cut anywhere: the official recipes)
                         | 'documents' (whole documents per window, split only when longer
                         than seq_len; segment ids and per-document positions)
  bos_windows            every window starts with BOS and documents carry only their EOS (the
                         official C4 packing, docs/protocols.md, C4 125M); False: BOS ... EOS
                         documents cut anywhere
  spm_model_path         SentencePiece model to load, or where to save the trained one
  spm_vocab_size         vocabulary size when training SentencePiece
  spm_train_max_sentences  lines of the training split used to train SentencePiece
  num_eval_batches       eval batches per call of make_eval_iter; <= 0 means the whole
                         split (single process only)
  read_threads           threads reading and tokenizing documents ahead of packing

Shuffling: random-access sources (text files, TFDS) get a full per-epoch permutation of
documents. Parquet and jsonl are read a block at a time (a row group, or a byte range of
lines), because random access to single rows would re-read a block per document; their
order is a per-epoch permutation of blocks and of the documents within each block.
"""

from __future__ import annotations

import atexit
import copy
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import grain
    import ml_collections

from goat_jax.data import documents
from goat_jax.data import hosts
from goat_jax.data import packing as packing_lib
from goat_jax.data import tokenizers as tokenizers_lib
from goat_jax.config.fields import Bool, Float, Int, Section, Str, Strs, check_section

JARGON_FILE = "/usr/share/doc/jargon-text/jargon.txt.gz"
SOURCES = ("text_files", "tfds", "parquet", "jsonl")
Batch = dict[str, np.ndarray]
_PREFETCH_BATCHES = 2


# Every field of the ``data`` section, declared once: default, type, range or choices, doc
# (the engine checks FIELD_SPECS before any work; which fields a source needs is checked by
# make_lm_datasets). List-valued fields are tuples, so that --config.data.paths=a.txt
# --config.data.paths=b.txt sets them (ml_collections cannot override lists from the command line).
DATA = Section(
    source=("text_files", Str(choices=SOURCES)),
    paths=((JARGON_FILE,), Strs(nonempty=True, doc="files or globs for the file sources; .gz is read transparently")),
    eval_paths=((), Strs(doc="held-out files; empty: hold out eval_fraction of the data instead")),
    eval_fraction=(0.02, Float(min=0.0, max=1.0, max_inclusive=False,
                               doc="held-out share, by content hash, not seed; with no eval_paths it must be > 0")),
    doc_split=("entries", Str(choices=documents.DOC_SPLITS, doc="text_files only")),
    text_key=("text", Str(nonempty=True, doc="text field of TFDS / parquet / jsonl records")),
    tfds_name=("c4/en", Str(doc="source='tfds'; must be prepared as array_record")),
    tfds_data_dir=("", Str(doc="'' = the TFDS default data dir")),
    tfds_train_split=("train", Str()),
    tfds_eval_split=("validation", Str()),
    jsonl_block_bytes=(8 << 20, Int(min=1, doc="unit of jsonl sharding/shuffling (~thousands of docs)")),
    tokenizer=("byte", Str(choices=tokenizers_lib.TOKENIZERS,
                           doc="'byte': vocab 259; 'gpt2': tiktoken, 50257")),
    bpe_ranks_path=("", Str(doc="gpt2: local tiktoken ranks file; '' = use tiktoken_cache_dir")),
    tiktoken_cache_dir=("", Str(doc="gpt2: local tiktoken cache; '' = $TIKTOKEN_CACHE_DIR")),
    packing=("concat", Str(choices=packing_lib.PACKINGS, doc="'documents': whole documents first-fit (goat_jax.data.packing)")),
    bos_windows=(False, Bool(doc="True: BOS at position 0 of every window, documents end with EOS")),
    spm_model_path=("", Str(doc="loaded if it exists, else trained on the train split and saved")),
    spm_vocab_size=(32000, Int(min=1, doc="only used when training SentencePiece")),
    spm_train_max_sentences=(200_000, Int(min=1, doc="lines used to train SentencePiece")),
    num_eval_batches=(16, Int(doc="per make_eval_iter() call; <= 0: the whole held-out split (1 process only)")),
    read_threads=(4, Int(min=0, doc="threads reading + tokenizing ahead of packing")),
)
FIELD_SPECS = DATA.specs


def default_data_config() -> ml_collections.ConfigDict:
    """Defaults: the Jargon File (Debian ``jargon-text``) with the byte tokenizer."""
    return DATA.defaults()


# ----------------------------------------------------------------------------------------
# Streams of documents, with small checkpointable state.


class _BlockDocsIterDataset(grain.IterDataset):
    """Documents of ``blocks``, block by block; shuffled per epoch at both levels if ``shuffle``.

    State: {'epoch', 'block' (position in the epoch's block order), 'doc' (position in the
    block's document order)}. Restoring re-reads one block.
    """

    def __init__(self, blocks, read_block, *, seed: int, shuffle: bool):
        super().__init__()
        self._blocks, self._read_block = tuple(blocks), read_block
        self._seed, self._shuffle = seed, shuffle

    def __iter__(self) -> grain.DatasetIterator:
        return _BlockDocsIterator(self._blocks, self._read_block, self._seed, self._shuffle)


class _BlockDocsIterator(grain.DatasetIterator):
    """See ``_BlockDocsIterDataset``; repeats forever when shuffling (training)."""

    def __init__(self, blocks, read_block, seed, shuffle):
        super().__init__()
        self._blocks, self._read_block = blocks, read_block
        self._seed, self._shuffle = seed, shuffle
        self._epoch = self._block = self._doc = 0
        self._loaded_key, self._loaded_docs = None, []
        self._epoch_was_empty = True

    def _block_order(self, epoch: int) -> np.ndarray:
        if not self._shuffle:
            return np.arange(len(self._blocks))
        return np.random.default_rng([self._seed, epoch]).permutation(len(self._blocks))

    def _docs(self) -> list[str]:
        key = (self._epoch, self._block)
        if key != self._loaded_key:
            block_id = int(self._block_order(self._epoch)[self._block])
            docs = self._read_block(self._blocks[block_id])
            if self._shuffle:
                rng = np.random.default_rng([self._seed, self._epoch, block_id])
                perm = rng.permutation(len(docs))
                docs = [docs[i] for i in perm]
            self._loaded_key, self._loaded_docs = key, docs
        return self._loaded_docs

    def __next__(self) -> str:
        while True:
            if self._block >= len(self._blocks):
                if not self._shuffle or self._epoch_was_empty:
                    raise StopIteration  # Eval is one pass; an empty shard must not spin forever.
                self._epoch, self._block, self._doc = self._epoch + 1, 0, 0
                self._epoch_was_empty = True
                continue
            docs = self._docs()
            if self._doc < len(docs):
                self._doc += 1
                self._epoch_was_empty = False
                return docs[self._doc - 1]
            self._block, self._doc = self._block + 1, 0

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "block": self._block, "doc": self._doc}

    def set_state(self, state: dict[str, Any]) -> None:
        self._epoch, self._block, self._doc = state["epoch"], state["block"], state["doc"]
        self._epoch_was_empty = self._block == 0 and self._doc == 0


class _PackedWindowsIterDataset(grain.IterDataset):
    """Concatenates token arrays and cuts the stream into windows of ``window_len`` tokens.

    Consecutive windows do not overlap, so with window_len = seq_len + 1 every token is a
    target exactly once except the last of each window. With ``bos_id`` set, each window is
    ``bos_id`` followed by the next window_len - 1 stream tokens, so every stream token is a
    target exactly once and position 0 always holds BOS. A final partial window (finite
    parents only) is padded with ``pad_id``. State: where the next window starts, i.e. the
    parent's state before the document it starts in, plus the token offset into it.
    """

    def __init__(self, parent: grain.IterDataset, *, window_len: int, pad_id: int,
                 bos_id: int | None = None):
        super().__init__(parent)
        self._window_len, self._pad_id, self._bos_id = window_len, pad_id, bos_id

    def __iter__(self) -> grain.DatasetIterator:
        return _PackedWindowsIterator(self._parent.__iter__(), self._window_len, self._pad_id,
                                      self._bos_id)


class _PackedWindowsIterator(grain.DatasetIterator):
    """See ``_PackedWindowsIterDataset``."""

    def __init__(self, parent: grain.DatasetIterator, window_len: int, pad_id: int,
                 bos_id: int | None = None):
        super().__init__(parent)
        self._window_len, self._pad_id, self._bos_id = window_len, pad_id, bos_id
        self._doc: np.ndarray | None = None  # The document the next window starts in ...
        self._doc_state: dict[str, Any] | None = None  # ... the parent's state before it ...
        self._offset = 0  # ... and how many of its tokens are already in earlier windows.

    def __next__(self) -> Batch:
        window = np.full(self._window_len, self._pad_id, np.int32)
        filled = 0
        if self._bos_id is not None:
            window[0], filled = self._bos_id, 1
        while filled < self._window_len:
            if self._doc is None or self._offset == len(self._doc):
                self._doc_state = copy.deepcopy(self._parent.get_state())
                try:
                    self._doc, self._offset = next(self._parent), 0
                except StopIteration:
                    self._doc = None
                    break
            take = min(self._window_len - filled, len(self._doc) - self._offset)
            window[filled:filled + take] = self._doc[self._offset:self._offset + take]
            filled, self._offset = filled + take, self._offset + take
        if filled == (0 if self._bos_id is None else 1):
            raise StopIteration
        return _window_example(window, filled)

    def get_state(self) -> dict[str, Any]:
        if self._doc is not None and self._offset < len(self._doc):
            return {"parent": copy.deepcopy(self._doc_state), "offset": self._offset}
        return {"parent": self._parent.get_state(), "offset": 0}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._doc_state, self._doc, self._offset = copy.deepcopy(state["parent"]), None, 0
        if state["offset"]:
            self._doc, self._offset = next(self._parent), state["offset"]


def _window_example(window: np.ndarray, filled: int) -> Batch:
    """A window of seq_len + 1 tokens (the first ``filled`` real) -> one training example."""
    seq_len = len(window) - 1
    return {
        "inputs": window[:-1],
        "targets": window[1:],
        "weights": (np.arange(1, seq_len + 1) < filled).astype(np.float32),
    }


def _token_stream(split: documents.Split, tokenizer: tokenizers_lib.Tokenizer, *, train: bool,
                  seed: int, process_index: int, process_count: int,
                  read_threads: int, bos_windows: bool = False) -> grain.IterDataset:
    """This host's shard of ``split`` as int32 token arrays [BOS, ..., EOS] ([..., EOS] with
    ``bos_windows``: the packer then puts BOS at the start of every window instead)."""
    head, eos = ([] if bos_windows else [tokenizer.bos_id]), tokenizer.eos_id

    def tokenize(text: str) -> np.ndarray:
        return np.asarray([*head, *tokenizer.encode(text), eos], np.int32)

    if split.docs is not None:
        # Shard before shuffling so that each host's documents are fixed across epochs and
        # disjoint from the others'.
        docs = split.docs[process_index::process_count]
        if train:
            # grain reseeds each epoch with seed + epoch; hashing the seed first keeps runs
            # with seeds s and s + 1 from replaying each other's orders one epoch apart.
            docs = docs.shuffle(int(np.random.SeedSequence(seed).generate_state(1)[0])).repeat()
        return docs.map(tokenize).to_iter_dataset(grain.ReadOptions(num_threads=read_threads))
    blocks = split.blocks[process_index::process_count]
    return _BlockDocsIterDataset(blocks, split.read_block, seed=seed, shuffle=train).map(tokenize)


# ----------------------------------------------------------------------------------------
# Entry points.


def _check_config(cfg: ml_collections.ConfigDict) -> None:
    """Each field's type and range (:data:`FIELD_SPECS`, also when called outside the engine),
    then the section's cross-field rule."""
    check_section(cfg, FIELD_SPECS, "data")
    default_fraction = DATA.default_values()["eval_fraction"]
    if cfg.eval_fraction != default_fraction and (cfg.eval_paths or cfg.source == "tfds"):
        # Inert: the held-out split is data.eval_paths' files, or the TFDS eval split.
        given = "data.eval_paths is set" if cfg.eval_paths else "data.source='tfds' holds out data.tfds_eval_split"
        raise ValueError(f"data.eval_fraction={cfg.eval_fraction:g} is not used: {given}. Drop "
                         "data.eval_fraction" + (", or clear data.eval_paths to hold out a fraction of "
                                                 "data.paths instead." if cfg.eval_paths else "."))
    if cfg.source != "tfds" and not cfg.eval_paths and not 0.0 < cfg.eval_fraction < 1.0:
        raise ValueError(f"data.eval_fraction={cfg.eval_fraction} must be in (0, 1), or set "
                         "data.eval_paths to held-out files.")
    if cfg.packing == "documents" and cfg.bos_windows:
        raise ValueError("data.bos_windows=True puts BOS at the start of every concatenated window; "
                         "with data.packing='documents' every document starts with its own BOS. "
                         "Set data.bos_windows=False or data.packing='concat'.")


def make_lm_datasets(
    data_config: ml_collections.ConfigDict,
    *,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    process_index: int | None = None,
    process_count: int | None = None,
    max_documents: int | None = None,
) -> tuple[grain.DatasetIterator, Callable[[], Iterator[Batch]], tokenizers_lib.Tokenizer]:
    """Builds the training iterator, the eval-iterator factory and the tokenizer.

    See the module docstring for the batch format, the state and the config fields.

    Args:
      data_config: the data config (``default_data_config()`` and overrides).
      seq_len: tokens per example (windows hold seq_len + 1 tokens).
      global_batch_size: examples per step over all processes.
      seed: shuffle seed in [0, 2**32); the eval split does not depend on it.
      process_index: this host's index; default ``jax.process_index()``.
      process_count: number of hosts; default ``jax.process_count()``.
      max_documents: with ``packing='documents'``, the most documents a window may hold
        (checked on the host: :func:`goat_jax.data.packing.check_documents_per_row`); None: no check.

    Returns:
      (train_iter, make_eval_iter, tokenizer): ``train_iter`` yields this host's batches of
      global_batch_size // process_count examples forever and has get_state/set_state;
      ``make_eval_iter()`` returns a fresh finite iterator of eval batches of the same size.
    """
    cfg = data_config
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1.")
    process_index, process_count, local_batch = hosts.host_split(
        global_batch_size, seed, process_index, process_count)
    _check_config(cfg)
    if cfg.num_eval_batches <= 0 and process_count > 1:
        raise ValueError(f"data.num_eval_batches={cfg.num_eval_batches}: a whole-split eval "
                         "needs a single process; set a positive number so all hosts agree.")

    if cfg.source == "text_files":
        train_split, eval_split = documents.text_file_splits(cfg)
    elif cfg.source == "tfds":
        train_split = documents.tfds_split(cfg, cfg.tfds_train_split, "tfds_train_split")
        eval_split = documents.tfds_split(cfg, cfg.tfds_eval_split, "tfds_eval_split")
    else:
        train_split, eval_split = documents.block_splits(cfg)
    n_train = len(train_split.docs) if train_split.docs is not None else len(train_split.blocks)
    if n_train < process_count:
        field = "data.tfds_train_split" if cfg.source == "tfds" else "data.paths"
        raise ValueError(
            f"{field}: the training split has {n_train} "
            f"{'documents' if train_split.docs is not None else 'blocks'} for process_count="
            f"{process_count} hosts; add data (or, for jsonl, lower data.jsonl_block_bytes).")

    tokenizer = tokenizers_lib.make_tokenizer(
        cfg, texts=train_split.texts(), allow_training=process_count == 1)
    stream = functools.partial(
        _token_stream, tokenizer=tokenizer, seed=seed, process_index=process_index,
        process_count=process_count, read_threads=cfg.read_threads, bos_windows=cfg.bos_windows)
    if cfg.packing == "documents":
        pack = functools.partial(
            packing_lib.pack_documents, seq_len=seq_len, pad_id=tokenizer.pad_id,
            num_bins=packing_lib.num_packing_bins(local_batch), max_documents=max_documents)
        padding = packing_lib.padding_example(seq_len, tokenizer.pad_id)
    else:
        pack = functools.partial(
            _PackedWindowsIterDataset, window_len=seq_len + 1, pad_id=tokenizer.pad_id,
            bos_id=tokenizer.bos_id if cfg.bos_windows else None)
        padding = _window_example(np.full(seq_len + 1, tokenizer.pad_id, np.int32), 0)

    train_ds = pack(stream(train_split, train=True)).batch(local_batch, drop_remainder=True)
    # A background thread packs the next batches while the trainer runs a step; its state is
    # that of the last batch handed out, so prefetching does not change what resumes.
    train_iter = iter(grain.experimental.ThreadPrefetchIterDataset(
        train_ds, prefetch_buffer_size=_PREFETCH_BATCHES))
    # grain closes that thread in __del__, which for an iterator alive at interpreter exit runs
    # after grain's modules are torn down and prints a traceback: close it at exit instead.
    atexit.register(_close_at_exit, weakref.ref(train_iter))

    def make_eval_iter() -> Iterator[Batch]:
        windows = iter(pack(stream(eval_split, train=False)))
        return _eval_batches(windows, local_batch, cfg.num_eval_batches, padding)

    return train_iter, make_eval_iter, tokenizer


def _close_at_exit(ref: weakref.ref) -> None:
    if (iterator := ref()) is not None:
        iterator.close()
        iterator.close = lambda: None  # What __del__ calls, later, when close can no longer run.


# The held-out split "far less than asked": fewer than this share of the windows the eval asks for.
SMALL_EVAL_SHARE = 0.5


def _eval_batches(windows: Iterator[Batch], batch_size: int, num_batches: int,
                  padding: Batch, what: str = "tokens") -> Iterator[Batch]:
    """Stacks windows into batches; pads with ``padding`` (weight 0) once they run out. When the
    windows are exhausted it warns (once per message) if the held-out split filled less than one
    window's targets, or fewer than :data:`SMALL_EVAL_SHARE` of the ``num_batches x batch_size``
    windows asked for: the eval loss is then over few ``what`` (the count is logged beside
    ``eval_loss`` as ``eval_tokens``), not what the config suggests."""
    exhausted, produced, real, scored = False, 0, 0, 0.0
    window = int(np.size(padding["weights"]))  # a window's scored targets
    while num_batches <= 0 or produced < num_batches:
        examples = []
        for _ in range(batch_size):
            example = None if exhausted else next(windows, None)
            exhausted = example is None
            if not exhausted:
                real += 1
                scored += float(np.sum(example["weights"]))
            examples.append(padding if exhausted else example)
        if exhausted and num_batches <= 0 and examples[0] is padding:
            break
        yield {k: np.stack([e[k] for e in examples]) for k in padding}
        produced += 1
    asked = num_batches * batch_size if num_batches > 0 else 0
    if not exhausted and asked:
        return  # the split fills every window asked for
    if scored < window:
        why = f"less than one window ({window} {what})"
    elif asked and real < SMALL_EVAL_SHARE * asked:
        why = f"{real} of the {asked} windows asked for (data.num_eval_batches={num_batches} x {batch_size} per host)"
    else:
        return
    warnings.warn(f"the held-out split fills {why}: eval_loss / eval_ppl are over {int(scored)} {what} only "
                  "(eval_tokens in metrics.jsonl). Hold out more data (data.eval_fraction or data.eval_paths) "
                  "or lower data.num_eval_batches.", UserWarning, stacklevel=2)


def to_global_array(local_batch: Batch, sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
    """Assembles each host's local batch into global arrays sharded by ``sharding``.

    Each host's rows land where ``sharding`` puts that process's devices along axis 0 (so in
    process order for a mesh over ``jax.devices()``), as
    ``jax.make_array_from_process_local_data`` infers the global shape.
    """
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, x), local_batch)
