"""Documents of the language-model corpus: where text comes from and how it is cut.

Reads local text files (plain or gzip), TFDS data sources (array_record, random access, no
TensorFlow), parquet row groups and jsonl byte ranges; decodes UTF-8 with a count of invalid
bytes (files that are mostly not text are refused); cuts files into documents; holds out an
eval split by content hash. :mod:`goat_jax.data.text` turns these documents into tokens,
packed windows and host batches.

A :class:`Split` is one split of the corpus: random access to documents (``docs``) or whole
blocks read at a time (``blocks`` + ``read_block``), for sources where reading a single row
would re-read its block.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import gzip
import json
import os
import re
import textwrap
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import grain
    import ml_collections
import numpy as np

from goat_jax.data import tfds_source

DOC_SPLITS = ("entries", "paragraphs", "files")  # how text files are cut into documents


# ----------------------------------------------------------------------------------------
# Documents.


def split_documents(text: str, doc_split: str = "entries") -> list[str]:
    """Splits one file's text into documents (dedented, stripped, empty ones dropped).

    'entries' suits the Jargon File and most structured plain text: a document starts at
    every unindented line that begins with a letter or digit (chapter and section headings;
    not table borders) and at every ':headword:' line of the lexicon, so each glossary
    entry is one document. 'paragraphs' splits at blank lines; 'files' keeps the whole text
    as one document.
    """
    if doc_split == "files":
        pieces = [text]
    elif doc_split == "paragraphs":
        pieces = re.split(r"\n[ \t]*\n", text)
    elif doc_split == "entries":
        starts = [m.start() for m in re.finditer(r"^(?:\w|[ \t]*:[^:\s][^:\n]*:)", text, re.M)]
        bounds = [0, *starts, len(text)]
        pieces = [text[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    else:
        raise ValueError(f"data.doc_split={doc_split!r} is unknown: use one of {DOC_SPLITS}.")
    docs = (_dedent_body(p) for p in pieces)
    return [d for d in docs if d]


def _dedent_body(piece: str) -> str:
    # The Jargon File indents its body by 3 spaces under unindented headings: layout, not
    # content worth tokens.
    head, _, body = piece.strip("\n").partition("\n")
    return f"{head.strip()}\n{textwrap.dedent(body)}".strip()


# A file is refused as "not text" when more than this fraction of its bytes are invalid UTF-8 or
# C0 control characters other than whitespace. Text in a legacy 8-bit encoding (Latin-1 prose:
# ~1-5% accented bytes) stays under it and is read with a warning; binary data (random bytes:
# ~60% invalid, compressed or executable files: >30%) is far above it.
MAX_NON_TEXT_FRACTION = 0.1
_SURROGATE = re.compile("[\udc80-\udcff]")  # surrogateescape's stand-ins for invalid bytes
_CONTROL = re.compile(b"[\x00-\x08\x0e-\x1f\x7f]")  # C0 controls except \t \n \v \f \r


def decode_utf8(data: bytes, source: str) -> str:
    """Decodes ``data`` as UTF-8, never silently: the byte tokenizer is lossless only for
    valid UTF-8, so each invalid byte (decoded as U+FFFD) is counted and reported.

    Raises:
      ValueError: naming ``source`` and the fraction, when more than ``MAX_NON_TEXT_FRACTION``
        of the bytes are invalid UTF-8 or control characters (a binary file, or text in
        another encoding: convert it with ``iconv -f <encoding> -t utf-8``).
    Warns:
      UserWarning naming ``source`` and the count, when some bytes are invalid UTF-8.
    """
    text = data.decode("utf-8", errors="surrogateescape")
    invalid = len(_SURROGATE.findall(text))
    non_text = invalid + len(_CONTROL.findall(data))
    if data and non_text > MAX_NON_TEXT_FRACTION * len(data):
        raise ValueError(
            f"{source} does not look like UTF-8 text: {non_text / len(data):.0%} of its "
            f"{len(data)} bytes are invalid UTF-8 or control characters (the limit is "
            f"{MAX_NON_TEXT_FRACTION:.0%}). Remove binary files from data.paths, or convert "
            "the file to UTF-8 (e.g. iconv -f latin1 -t utf-8).")
    if invalid:
        warnings.warn(
            f"{source}: {invalid} of {len(data)} bytes are not valid UTF-8 and were replaced by "
            "U+FFFD (the byte tokenizer then sees the replacement's 3 bytes, not the original). "
            "Convert the file to UTF-8 to keep them.", UserWarning, stacklevel=2)
        text = _SURROGATE.sub("\ufffd", text)
    return text


def read_text(path: str) -> str:
    """The text of a file (gzip when the name ends in .gz) as UTF-8, invalid bytes replaced and
    warned about (:func:`decode_utf8`)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return decode_utf8(f.read(), path)


def _as_str(value: Any, source: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        return decode_utf8(bytes(value), source)
    return str(value)


def expand_paths(patterns: str | Sequence[str], field: str) -> list[str]:
    """Globs -> sorted, de-duplicated files; sorted so every host sees the same list."""
    if isinstance(patterns, str):
        patterns = [patterns]
    files = sorted({f for p in patterns for f in glob.glob(p)})
    if not files:
        raise ValueError(
            f"data.{field}={list(patterns)!r} matches no files: fix the path or glob pattern.")
    directories = [f for f in files if os.path.isdir(f)]
    if directories:
        raise ValueError(
            f"data.{field} names the director{'ies' if len(directories) > 1 else 'y'} "
            f"{directories!r}, not files: name the files in it or a glob such as "
            f"'{os.path.join(directories[0], '*.txt')}'.")
    return files


def _hold_out(items: Sequence[Any], keys: Sequence[str], fraction: float, unit: str = "document",
              more: str = "more data.paths") -> tuple[list, list]:
    """(train, eval): eval is every item whose key is one of the round(fraction * k) (at least
    1) distinct keys of smallest CRC32 (ties by first appearance), of the k distinct keys.

    By content rather than position or seed: the eval set stays fixed across seeds, and
    duplicates of a held-out document are held out too: the cut is made between distinct keys,
    never inside a run of equal ones (it used to take the first n items of the CRC32 order, so
    a cut falling inside a run of copies trained on some of them). Both keep the input order.

    Raises ValueError when nothing is left to train on (e.g. a single distinct document: eval
    takes at least one), naming ``unit`` and the ways to ``more`` of them, data.eval_fraction
    and data.eval_paths.
    """
    first = {}  # each distinct key's first index: the tie-break of equal CRC32s, as before
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    distinct = sorted(first, key=lambda k: (zlib.crc32(k.encode("utf-8")), first[k]))
    n_eval = max(1, round(fraction * len(distinct)))
    if n_eval >= len(distinct):
        n, copies = len(distinct), len(keys) - len(distinct)
        have = f"only {n} {unit}{'' if n == 1 else 's'}" if n else f"no {unit}s"
        if copies:
            have += f" of distinct content ({len(keys)} with {copies} duplicate{'' if copies == 1 else 's'})"
        lower = ", lower data.eval_fraction" if n > 1 else ""  # one is held out in any case
        raise ValueError(
            f"data.paths: the data has {have}, and the held-out eval split "
            f"(data.eval_fraction={fraction:g}) takes {n_eval} (at least one"
            f"{', with every copy of it' if copies else ''}), leaving none to train on: give "
            f"{more}{lower}, or set data.eval_paths to separate eval files (then all of data.paths "
            "trains).")
    held_out = set(distinct[:n_eval])
    return ([x for x, k in zip(items, keys) if k not in held_out],
            [x for x, k in zip(items, keys) if k in held_out])


# A block is read whole: (path, a, b) = a parquet row group (a, -1), or the jsonl lines that
# start in bytes [a, b) of the file (b = -1: the whole file, for .gz).
Block = tuple[str, int, int]


def _list_blocks(files: Sequence[str], cfg: ml_collections.ConfigDict) -> list[Block]:
    blocks = []
    for path in files:
        if cfg.source == "parquet":
            with _extras.imports(__name__):
                import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

            pf = pq.ParquetFile(path)
            if cfg.text_key not in pf.schema_arrow.names:
                raise ValueError(f"data.text_key={cfg.text_key!r} is not a column of {path} "
                                 f"(columns: {pf.schema_arrow.names}).")
            blocks += [(path, g, -1) for g in range(pf.num_row_groups)]
        elif path.endswith(".gz"):
            blocks.append((path, 0, -1))  # gzip has no random access.
        else:
            size, step = os.path.getsize(path), cfg.jsonl_block_bytes
            blocks += [(path, a, min(a + step, size)) for a in range(0, size, step)]
    return blocks


def _read_block(block: Block, *, source: str, text_key: str) -> list[str]:
    """The documents of one block, in file order."""
    path, a, b = block
    if source == "parquet":
        with _extras.imports(__name__):
            import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

        column = pq.ParquetFile(path).read_row_group(a, columns=[text_key]).column(0)
        return [_as_str(t, f"{path} (row group {a})") for t in column.to_pylist()]
    docs = []
    with (gzip.open(path, "rb") if b < 0 else open(path, "rb")) as f:
        if a > 0:
            # A line belongs to the block holding its first byte: skip the tail of the line that
            # started in the previous block (a no-op when byte a-1 is the newline itself).
            f.seek(a - 1)
            f.readline()
        while b < 0 or f.tell() < b:
            line = f.readline()
            if not line:
                break
            if not line.strip():
                continue
            record = json.loads(line)
            if text_key not in record:
                raise ValueError(f"data.text_key={text_key!r} is not a field of the records in "
                                 f"{path} (fields: {sorted(record)}).")
            docs.append(_as_str(record[text_key], path))
    return docs


@dataclasses.dataclass(frozen=True)
class Split:
    """One split of the corpus: random access (``docs``) or whole-block reads (``blocks``)."""

    docs: grain.MapDataset | None = None
    blocks: tuple[Block, ...] = ()
    read_block: Callable[[Block], list[str]] | None = None

    def texts(self) -> Iterator[str]:
        """All documents in storage order, lazily (to train a tokenizer on a prefix)."""
        if self.docs is not None:
            yield from (self.docs[i] for i in range(len(self.docs)))
        else:
            for block in self.blocks:
                yield from self.read_block(block)


def text_file_splits(cfg: ml_collections.ConfigDict) -> tuple[Split, Split]:
    """(train, eval) documents of plain-text files: ``data.paths`` cut by ``data.doc_split``;
    the held-out split is ``data.eval_paths`` when set, else the ``data.eval_fraction`` of
    distinct documents of smallest CRC32 key, with every copy of each (the same documents for
    every seed; :func:`_hold_out`). Raises ValueError naming the field when nothing is left to
    train on."""
    def load(files):
        return [d for f in files for d in split_documents(read_text(f), cfg.doc_split)]

    train_docs = load(expand_paths(cfg.paths, "paths"))
    if cfg.eval_paths:
        eval_docs = load(expand_paths(cfg.eval_paths, "eval_paths"))
    else:
        finer = "entries" if cfg.doc_split == "paragraphs" else "paragraphs"
        more = (f"more documents (more data.paths, or data.doc_split={finer!r} to cut the files "
                f"differently than {cfg.doc_split!r})")
        train_docs, eval_docs = _hold_out(train_docs, train_docs, cfg.eval_fraction, "document",
                                          more)
    return (Split(docs=grain.MapDataset.source(train_docs)),
            Split(docs=grain.MapDataset.source(eval_docs)))


def tfds_split(cfg: ml_collections.ConfigDict, split: str, field: str) -> Split:
    """The documents of one TFDS split (``data.tfds_name`` read from ``data.tfds_data_dir``;
    nothing is downloaded), each record's ``data.text_key`` as a string; ``field`` names the
    config field that gave ``split`` in errors. Raises ValueError for a text key the dataset
    lacks, listing its features."""
    source = tfds_source.open_data_source(cfg.tfds_name, split, cfg.tfds_data_dir, name_field="data.tfds_name",
                                          split_field=f"data.{field}", dir_field="data.tfds_data_dir")
    if len(source) and cfg.text_key not in source[0]:
        raise ValueError(f"data.text_key={cfg.text_key!r} is not a feature of {cfg.tfds_name} "
                         f"(features: {sorted(source[0])}).")
    key, where = cfg.text_key, f"tfds {cfg.tfds_name}:{split}"
    return Split(docs=grain.MapDataset.source(source).map(lambda r: _as_str(r[key], where)))


def block_splits(cfg: ml_collections.ConfigDict) -> tuple[Split, Split]:
    """(train, eval) of jsonl / parquet corpora as blocks read lazily (byte ranges of jsonl
    files, parquet row groups): the held-out blocks are ``data.eval_paths``' when set, else the
    ``data.eval_fraction`` of blocks of smallest CRC32 key of their file name and range."""
    read = functools.partial(_read_block, source=cfg.source, text_key=cfg.text_key)
    train_blocks = _list_blocks(expand_paths(cfg.paths, "paths"), cfg)
    if cfg.eval_paths:
        eval_blocks = _list_blocks(expand_paths(cfg.eval_paths, "eval_paths"), cfg)
    else:
        keys = [f"{os.path.basename(p)}:{a}:{b}" for p, a, b in train_blocks]
        more = "more data.paths" + (" (or, for uncompressed jsonl, a lower "
                                    "data.jsonl_block_bytes: more blocks per file)"
                                    if cfg.source == "jsonl" else "")
        train_blocks, eval_blocks = _hold_out(train_blocks, keys, cfg.eval_fraction,
                                              "row group" if cfg.source == "parquet" else "block", more)
    return (Split(blocks=tuple(train_blocks), read_block=read),
            Split(blocks=tuple(eval_blocks), read_block=read))
