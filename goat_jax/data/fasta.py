"""DNA characters and FASTA files: the tokenizer and random access to genomes.

Tokens (the official GOAT genome recipe): the characters "ACGNT" are ids 0..4, vocabulary 5,
no special tokens (so N is id 3).

* Lowercase (soft-masked repeats in UCSC/Ensembl assemblies) reads as upper case.
* The other IUPAC nucleotide codes (R Y S W K M B D H V, and U) become N and are counted.
* Anything else (protein letters such as E F I L P Q, digits, gaps) is an error naming the file,
  the record and the position: a protein FASTA must not train a DNA model by accident.

FASTA files: plain or gzip (detected by content, not by name), any number of records, any line
width, LF or CRLF line ends. A record's name is the header up to its first whitespace.
:class:`Genome` gives random access to every record of one or more files:

* a file with a ``.fai`` index next to it (``samtools faidx FILE`` or ``pyfaidx.Faidx(FILE)``)
  is read through pyfaidx, a slice at a time, never whole (plain or bgzip-compressed FASTA;
  bgzip also needs the ``.gzi`` index that ``samtools faidx`` writes);
* a file without an index is read into memory (1 byte per base) if it is at most
  ``max_in_memory_bytes`` on disk; a larger one is an error that says how to index it.
"""

from __future__ import annotations

import gzip
import logging
import os
import threading
import zlib
from collections.abc import Sequence

import numpy as np

from goat_jax import _extras

ALPHABET = "ACGNT"
VOCAB_SIZE = len(ALPHABET)
N_ID = ALPHABET.index("N")
# IUPAC nucleotide ambiguity codes (and U, RNA's T): each reads as N, and is counted.
AMBIGUOUS = "RYSWKMBDHVU"

_INVALID = 255
_LUT = np.full(256, _INVALID, np.uint8)  # byte -> token id, _INVALID for non-nucleotides
_IS_AMBIGUOUS = np.zeros(256, bool)
for _i, _c in enumerate(ALPHABET):
    _LUT[ord(_c)] = _LUT[ord(_c.lower())] = _i
for _c in AMBIGUOUS:
    _LUT[ord(_c)] = _LUT[ord(_c.lower())] = N_ID
    _IS_AMBIGUOUS[ord(_c)] = _IS_AMBIGUOUS[ord(_c.lower())] = True


def encode(seq: str | bytes | np.ndarray, *, where: str = "sequence") -> tuple[np.ndarray, int]:
    """DNA text -> ``(ids [n] uint8, number of IUPAC codes read as N)``.

    Args:
      seq: the bases (str, ASCII bytes or a uint8 array of ASCII codes), no line breaks.
      where: names the source in errors, e.g. "chr17.fa record chr17 at base 1000".
    Raises:
      ValueError: a character that is not a nucleotide, with its position and ``where``.
    """
    if isinstance(seq, str):
        try:
            seq = seq.encode("ascii")
        except UnicodeEncodeError:
            pos = next(i for i, c in enumerate(seq) if ord(c) > 127)
            raise ValueError(f"{where}: non-ASCII character {seq[pos]!r} at position {pos}; a DNA "
                             f"sequence holds only {ALPHABET} and IUPAC codes {AMBIGUOUS}.") from None
    raw = np.frombuffer(seq, np.uint8) if isinstance(seq, (bytes, bytearray)) else np.asarray(seq, np.uint8)
    ids = _LUT[raw]
    bad = np.flatnonzero(ids == _INVALID)
    if bad.size:
        pos = int(bad[0])
        shown = "".join(sorted({chr(b) for b in raw[bad[:1000]].tolist()}))
        raise ValueError(
            f"{where}: invalid character {chr(raw[pos])!r} at position {pos} ({bad.size} invalid in "
            f"all; seen: {shown!r}). A DNA FASTA holds only {ALPHABET} and the IUPAC codes "
            f"{AMBIGUOUS}, in either case. Is this a protein FASTA?")
    return ids, int(np.count_nonzero(_IS_AMBIGUOUS[raw]))


def decode(ids: Sequence[int] | np.ndarray) -> str:
    """Token ids -> upper-case DNA text (an id outside 0..4 is a ValueError)."""
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
        raise ValueError(f"DNA token ids must be in [0, {VOCAB_SIZE}), got {ids.min()}..{ids.max()}.")
    return np.frombuffer(ALPHABET.encode(), np.uint8)[ids.astype(np.int64)].tobytes().decode("ascii")


# Complement in id space: A <-> T, C <-> G, N <-> N.
_COMPLEMENT = np.array([ALPHABET.index(c) for c in "TGCNA"], np.uint8)


def reverse_complement(ids: np.ndarray) -> np.ndarray:
    """The reverse complement of token ids ``[..., n]`` (last axis reversed, bases complemented)."""
    ids = np.asarray(ids)
    return _COMPLEMENT[ids[..., ::-1]].astype(ids.dtype)


class DnaTokenizer:
    """The character tokenizer as an object, for code written against the text tokenizers.

    ``vocab_size`` 5; there is no BOS/EOS/PAD (``pad_id`` is N, and padded targets carry weight 0).
    """

    vocab_size = VOCAB_SIZE
    pad_id = N_ID
    bos_id = eos_id = None

    def encode(self, text: str) -> list[int]:
        """DNA text -> token ids (IUPAC codes -> N; invalid characters raise)."""
        return encode(text)[0].astype(np.int32).tolist()

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids -> upper-case DNA text."""
        return decode(ids)


# ----------------------------------------------------------------------------------------
# FASTA files.


def _damaged(path: str, error: BaseException, what: str = "") -> ValueError:
    """The one-line error of a truncated or corrupt (b)gzip FASTA: the file, the cause, the fix."""
    return ValueError(
        f"{path}: the compressed FASTA is truncated or corrupt{what} ({type(error).__name__}: "
        f"{error}). Copy or download it again (`gzip -t {path}` checks a copy); if it is indexed, "
        f"re-index the new copy (`samtools faidx {path}`).")


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    try:
        with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
            return f.read()
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # cut short, bad data, bad CRC/length
        raise _damaged(path, e) from e


def parse_fasta(data: bytes, path: str = "<bytes>") -> list[tuple[str, bytes]]:
    """FASTA text -> ``[(name, bases)]`` in file order, bases with line breaks removed.

    Raises ValueError (naming ``path``) for a file with no records, text before the first
    header, an empty name, or a name used twice.
    """
    body = data.lstrip()
    if not body:
        raise ValueError(f"{path}: no FASTA records (the file is empty).")
    if not body.startswith(b">"):
        raise ValueError(f"{path}: no FASTA header: the first non-blank line must start with '>', "
                         f"found {body[:40]!r}.")
    records, seen = [], set()
    for chunk in (b"\n" + body).split(b"\n>")[1:]:
        header, _, seq = chunk.partition(b"\n")
        words = header.split()
        if not words:
            raise ValueError(f"{path}: record {len(records) + 1} has an empty header line ('>').")
        name = words[0].decode("utf-8", errors="replace")
        if name in seen:
            raise ValueError(f"{path}: record name {name!r} appears twice; record names must be unique.")
        seen.add(name)
        # Lines may end in \r\n; ';' comment lines are pre-FASTA legacy and not supported.
        records.append((name, seq.translate(None, b"\r\n \t")))
    return records


class Genome:
    """Random access to the records of FASTA files: ``fetch(name, start, end) -> ids``.

    Attributes:
      names: record names in file order (unique over all files).
      lengths: ``{name: number of bases}``.
      paths: ``{name: the file it comes from}``.
      ambiguous: ``{name: IUPAC codes read as N}``; exact for in-memory files, counted as
        slices are read for indexed ones.
    """

    def __init__(self, paths: Sequence[str], *, max_in_memory_bytes: int = 1 << 30):
        if isinstance(paths, str):
            paths = [paths]
        if not paths:
            raise ValueError("Genome needs at least one FASTA file.")
        self.names: list[str] = []
        self.lengths: dict[str, int] = {}
        self.paths: dict[str, str] = {}
        self.ambiguous: dict[str, int] = {}
        self._memory: dict[str, np.ndarray] = {}
        self._indexed: dict[str, object] = {}  # name -> pyfaidx.Fasta of its file
        self._lock = threading.Lock()
        for path in paths:
            if not os.path.isfile(path):
                raise ValueError(f"FASTA file {path!r} does not exist.")
            if os.path.exists(path + ".fai"):
                records = self._open_indexed(path)
            elif os.path.getsize(path) <= max_in_memory_bytes:
                records = self._load(path)
            else:
                raise ValueError(
                    f"{path} is {os.path.getsize(path) / 2**30:.1f} GiB with no index ({path}.fai), "
                    f"more than max_in_memory_bytes={max_in_memory_bytes}. Index it once with "
                    f"`samtools faidx {path}` or `python -c \"import pyfaidx; pyfaidx.Faidx('{path}')\"` "
                    "(a gzip file must first be recompressed with `bgzip`, or decompressed).")
            for name, length in records:
                if name in self.lengths:
                    raise ValueError(f"record {name!r} is in both {self.paths[name]} and {path}; "
                                     "record names must be unique over all FASTA files.")
                self.names.append(name)
                self.lengths[name], self.paths[name] = length, path
        n_amb = {n: c for n, c in self.ambiguous.items() if c}
        if n_amb:
            logging.info("FASTA: IUPAC ambiguity codes read as N: %s", n_amb)

    def _load(self, path: str) -> list[tuple[str, int]]:
        records = parse_fasta(_read_bytes(path), path)
        out = []
        for name, seq in records:
            ids, n_amb = encode(seq, where=f"{path} record {name!r}")
            self._memory[name], self.ambiguous[name] = ids, n_amb
            out.append((name, len(ids)))
        return out

    def _open_indexed(self, path: str) -> list[tuple[str, int]]:
        with _extras.imports(__name__):
            import pyfaidx  # pylint: disable=g-import-not-at-top

        try:
            fasta = pyfaidx.Fasta(path, as_raw=True, sequence_always_upper=False, rebuild=False,
                                  build_index=False)
        except Exception as e:  # pyfaidx raises several types for unreadable / non-bgzip files
            raise ValueError(f"{path}: could not open with its index {path}.fai ({type(e).__name__}: "
                             f"{e}). Either the file is truncated or corrupt, or its index is "
                             "stale (copy it again and re-index it with `samtools faidx`), or it "
                             "is plain gzip: a compressed FASTA must be bgzip with a .gzi index: "
                             f"`bgzip {path[:-3] if path.endswith('.gz') else path}` then "
                             "`samtools faidx` on the result.") from e
        out = []
        for name in fasta.keys():
            self._indexed[name] = fasta
            self.ambiguous[name] = 0
            n = len(fasta[name])
            # The last base of every record: a truncated file (or a stale index) fails here,
            # before training, instead of in a reader thread hours later.
            try:
                fasta[name][max(n - 1, 0):n]
            except Exception as e:  # pylint: disable=broad-except  # zlib, EOF, bgzf, pyfaidx errors
                raise _damaged(path, e, f" or its index is stale (record {name!r} ends at base "
                                        f"{n} by {path}.fai but cannot be read there)") from e
            out.append((name, n))
        if not out:
            raise ValueError(f"{path}: no FASTA records in its index {path}.fai.")
        return out

    def fetch(self, name: str, start: int, end: int) -> np.ndarray:
        """Bases ``[start, end)`` (0-based, half-open) of record ``name`` as uint8 token ids."""
        if name not in self.lengths:
            raise KeyError(f"record {name!r} is not in {sorted(self.paths.values())}.")
        if not 0 <= start <= end <= self.lengths[name]:
            raise ValueError(f"[{start}, {end}) is outside record {name!r} of length {self.lengths[name]}.")
        if name in self._memory:
            return self._memory[name][start:end]
        seq = self._indexed[name][name][start:end]
        ids, n_amb = encode(seq, where=f"{self.paths[name]} record {name!r} (slice starting at base {start})")
        if n_amb:
            with self._lock:
                self.ambiguous[name] += n_amb
        return ids

    def record(self, name: str) -> np.ndarray:
        """A whole record as uint8 token ids."""
        return self.fetch(name, 0, self.lengths[name])
