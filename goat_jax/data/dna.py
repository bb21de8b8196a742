"""The genome pipeline: FASTA or parquet chunks -> splits by record -> crops -> LM batches.

    records (FASTA files | parquet rows of the `human_reference_genome` dataset)
      -> train / valid / test by record name (or FASTA region)
      -> chunks: runs of allowed crop starts (the unit of shuffling and of host sharding)
      -> train: one crop of seq_len + 1 bases per chunk per epoch, at a random offset
         eval: one crop per chunk at a fixed offset, in storage order
      -> {'inputs': w[:-1], 'targets': w[1:], 'weights'} -> local batch

Entry point: ``make_dna_datasets(data_config, seq_len=, global_batch_size=, seed=)`` returns
``(train_iter, make_eval_iter, tokenizer)`` exactly like ``goat_jax.data.text.make_lm_datasets``,
so the language model and its loss train on it unchanged. Batches (b = global_batch_size //
process_count examples per host):

    inputs  int32   [b, seq_len]   base ids, "ACGNT" -> 0..4 (see goat_jax.data.fasta)
    targets int32   [b, seq_len]   the next base
    weights float32 [b, seq_len]   1; 0 where the target is N (an unknown base is not a base to
                                   predict) and on the padding windows of the last eval batches

N targets. The official recipe (``genome.py``) trains and evaluates on every character,
N included (it is one of the 5 tokens); goat-jax gives N targets weight 0 in training and
evaluation alike, so neither the loss nor bits per base or accuracy count an unknown base
(hg38 holds ~150 Mbp of N). N stays an input token. On N-free genomes (the E. coli references
of the tiny configs) both rules are the same.

Chunks. A FASTA piece (a record, or a region of one) of n bases has n - seq_len crop starts;
they are cut into chunks of ``fasta_stride`` consecutive starts (0: seq_len + 1, so the chunks'
crops at offset 0 tile the piece). A parquet row (the 6 kbp dataset: 6,200 bases, 100 of them
shared with each neighbour) is one chunk whose crops start in [0, max_offset], as in the official
run (offset uniform in [0, 200]).

Training. Each epoch visits every chunk of this host once, in a fresh order: FASTA chunks in a
full permutation; parquet chunks a row group at a time (row groups permuted, then rows within
each), because a parquet file is read a row group at a time. A chunk's crop starts at a uniform
offset among its starts; with ``reverse_complement`` the crop is reverse-complemented with
probability 1/2. Everything is a function of (seed, epoch, chunk): ``train_iter`` is a grain
iterator whose state is the index of the next batch, so ``set_state`` resumes exactly.

Evaluation. Crop offset 0 of every chunk (``eval_offsets='start'``; with the default stride the
held-out sequence is tiled by non-overlapping windows) or a fixed pseudo-random offset from a
CRC32 of the chunk's name and start (``'hashed'``, the official recipe); never seed-dependent.

Hosts. Chunks (parquet: row groups) are dealt round-robin to processes, so hosts read disjoint
crop starts; the eval split likewise, padded so every host runs ``num_eval_batches`` batches.

Data config fields: see ``default_dna_data_config()``; record specs are 'NAME' or
'NAME:START-END' (1-based, inclusive, as samtools writes regions; FASTA only).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import re
import sys
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import grain
    import ml_collections
import numpy as np

from goat_jax.data import hosts
from goat_jax.data import documents
from goat_jax.data import fasta as fasta_lib
from goat_jax.data import text as text_lib
from goat_jax.config.fields import Bool, Int, Section, Str, Strs, check_section

ECOLI_MG1655 = "/usr/share/doc/ragout/examples/E.Coli/references/MG1655-K12.fasta.gz"
ECOLI_DH1 = "/usr/share/doc/ragout/examples/E.Coli/references/DH1.fasta.gz"
HUMAN_CHR17_40KB = "/usr/share/doc/python-pyfaidx-examples/examples/chr17.hg19.part.fa"
# ~200 kbp of human GRCh37 in three records (named 1, 2, 3: pieces of chromosomes 1-3), Debian
# package artfastqgenerator-examples: a second human genome (another assembly and chromosomes than
# chr17's hg19 piece) for the DNA family's held-out evaluation.
HUMAN_GRCH37_CHR1_3 = "/usr/share/doc/artfastqgenerator/examples/miniReference.fasta.gz"
SOURCES = ("fasta", "parquet")
EVAL_SPLITS = ("valid", "test")  # data.eval_split: the held-out records evaluated
EVAL_OFFSETS = ("start", "hashed")  # data.eval_offsets: where eval crops start
SHORT_RECORDS = ("error", "skip")  # data.short_records: a record shorter than one crop
Batch = dict[str, np.ndarray]


# Every field of the ``data`` section, declared once: default, type, range or choices, doc (the
# engine checks FIELD_SPECS before any work); record names and files are checked by build_tables.
DATA = Section(
    source=("fasta", Str(choices=SOURCES, doc="'fasta': plain/gzip/bgzip, .fai for random access")),
    paths=((ECOLI_MG1655,), Strs(nonempty=True, doc="FASTA files, or parquet files/globs of the 6 kbp dataset")),
    train_records=((), Strs(doc="record specs NAME or NAME:START-END for training; empty: all not held out")),
    valid_records=(("K-12-MG1655:4175708-4639675",), Strs(doc="record specs NAME or NAME:START-END; default: the genome's last 10% (463,968 bp)")),
    test_records=((), Strs(doc="record specs NAME or NAME:START-END held out for test (never trained on)")),
    eval_split=("valid", Str(choices=EVAL_SPLITS, doc="the split make_eval_iter reads")),
    fasta_stride=(0, Int(min=0, doc="FASTA crop starts per chunk; 0: seq_len + 1 (eval crops tile)")),
    max_offset=(200, Int(min=0, doc="parquet: crops start in [0, max_offset] of each row (official: 200)")),
    eval_offsets=("start", Str(choices=EVAL_OFFSETS, doc="'start': offset 0, tiling; 'hashed': CRC32, official")),
    short_records=("error", Str(choices=SHORT_RECORDS, doc="a piece/row shorter than seq_len + 1: refuse, or skip it (counted)")),
    reverse_complement=(False, Bool(doc="train crops reverse-complemented w.p. 1/2 (official: off)")),
    max_in_memory_bytes=(1 << 30, Int(min=0, doc="unindexed FASTA above this size on disk is an error")),
    sequence_key=("sequence", Str(nonempty=True, doc="parquet column of the bases")),
    record_key=("chromosome", Str(nonempty=True, doc="parquet column of the record (chromosome) name")),
    num_eval_batches=(16, Int(doc="per make_eval_iter() call; <= 0: the whole held-out split (1 process only)")),
    read_threads=(2, Int(min=0, doc="grain threads reading crops ahead of the trainer")),
)
FIELD_SPECS = DATA.specs


def default_dna_data_config() -> ml_collections.ConfigDict:
    """Defaults: E. coli K-12 MG1655 (Debian ``ragout-examples``), its last 10% held out."""
    return DATA.defaults()


# ----------------------------------------------------------------------------------------
# Splits: record specs -> pieces (name, start, end), 0-based half-open.


def parse_record_spec(spec: str, lengths: dict[str, int], *, field: str) -> tuple[str, int, int]:
    """'NAME' or 'NAME:START-END' (1-based inclusive) -> ``(name, start, end)`` 0-based half-open.

    A whole spec that is a record name wins over the region reading (names may hold ':').
    Raises ValueError naming ``field`` for an unknown record or a region outside it.
    """
    if spec in lengths:
        return spec, 0, lengths[spec]
    m = re.fullmatch(r"(.+):([\d,]+)-([\d,]+)", spec)
    name = m.group(1) if m else spec
    if name not in lengths:
        known = list(lengths)
        shown = known[:20] + (["..."] if len(known) > 20 else [])
        raise ValueError(f"data.{field}: record {name!r} (from {spec!r}) is not in the data; its "
                         f"records are {shown}.")
    start, end = (int(g.replace(",", "")) for g in m.groups()[1:])
    if not 1 <= start <= end <= lengths[name]:
        raise ValueError(f"data.{field}: region {spec!r} is outside record {name!r} of length "
                         f"{lengths[name]} (regions are 1-based, inclusive).")
    return name, start - 1, end


def _subtract(piece: tuple[str, int, int], holes: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
    name, a, b = piece
    out = []
    for s, e in sorted(holes):
        if s > a:
            out.append((name, a, min(s, b)))
        a = max(a, e)
    if a < b:
        out.append((name, a, b))
    return [p for p in out if p[2] > p[1]]


def split_pieces(cfg: ml_collections.ConfigDict, lengths: dict[str, int], *,
                 allow_regions: bool) -> dict[str, list[tuple[str, int, int]]]:
    """``{'train' | 'valid' | 'test': [(name, start, end)]}`` from the config's record specs.

    Held-out specs may not overlap each other; explicit train specs may not overlap them; empty
    ``train_records`` means every base of every record that is not held out.
    """
    out = {}
    for split in ("train", "valid", "test"):
        field = f"{split}_records"
        specs = cfg[field]
        if isinstance(specs, str):
            specs = [specs]
        pieces = [parse_record_spec(s, lengths, field=field) for s in specs]
        if not allow_regions:
            for (name, a, b), spec in zip(pieces, specs):
                if (a, b) != (0, lengths[name]):
                    raise ValueError(f"data.{field}: {spec!r} is a region; parquet data splits by "
                                     "whole records only.")
        out[split] = pieces
    held = out["valid"] + out["test"]
    for i, (n1, a1, b1) in enumerate(held):
        for j, (n2, a2, b2) in enumerate(held[:i] + (out["train"])):
            if n1 == n2 and a1 < b2 and a2 < b1:
                raise ValueError(f"data: record specs overlap on {n1!r} [{max(a1, a2) + 1}, "
                                 f"{min(b1, b2)}]: train, valid and test must be disjoint.")
    if not out["train"]:
        holes: dict[str, list[tuple[int, int]]] = {}
        for name, a, b in held:
            holes.setdefault(name, []).append((a, b))
        out["train"] = [p for name in lengths for p in _subtract((name, 0, lengths[name]),
                                                                 holes.get(name, []))]
    if not out["train"]:
        raise ValueError("data: nothing is left for training; valid_records/test_records hold out "
                         "every record.")
    return out


# ----------------------------------------------------------------------------------------
# Chunk tables: where crops may start, with a reader of windows.


@dataclasses.dataclass
class ChunkTable:
    """Chunks of one split. Chunk i: record ``names[rec[i]]``, crops start at ``start[i] + o``
    for o in [0, n_starts[i]) (FASTA: base coordinates; parquet: offsets in row ``start[i]`` of
    row group ``block[i]``). ``read(i, o, n)`` returns the n bases there as uint8 ids."""

    names: list[str]
    rec: np.ndarray  # [C] int32
    start: np.ndarray  # [C] int64
    n_starts: np.ndarray  # [C] int64
    block: np.ndarray  # [C] int64: the unit read at once (FASTA: the chunk itself)
    read: Callable[[int, int, int], np.ndarray]
    skipped: list[str] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rec)


def _short(cfg, what: str, length: int, window: int, skipped: list[str]) -> None:
    if cfg.short_records == "skip":
        skipped.append(what)
        return
    raise ValueError(f"{what} has {length} bases, fewer than one crop of seq_len + 1 = {window}. "
                     "Remove it from the split, shorten seq_len, or set "
                     "data.short_records='skip' to skip (and count) such records.")


def fasta_chunks(genome: fasta_lib.Genome, pieces, *, seq_len: int, stride: int, cfg) -> ChunkTable:
    """The chunk table of FASTA ``pieces`` (see the module docstring)."""
    names = list(genome.names)
    index = {n: i for i, n in enumerate(names)}
    recs, starts, counts, skipped = [], [], [], []
    for name, a, b in pieces:
        n_valid = (b - a) - seq_len
        if n_valid < 1:
            _short(cfg, f"{genome.paths[name]} record {name!r} [{a + 1}, {b}]", b - a, seq_len + 1,
                   skipped)
            continue
        k = np.arange(0, n_valid, stride, dtype=np.int64)
        recs.append(np.full(len(k), index[name], np.int32))
        starts.append(a + k)
        counts.append(np.minimum(stride, n_valid - k))
    if not recs:
        return ChunkTable(names, *(np.zeros(0, t) for t in (np.int32, np.int64, np.int64, np.int64)),
                          read=None, skipped=skipped)
    rec, start = np.concatenate(recs), np.concatenate(starts)

    def read(i: int, offset: int, n: int) -> np.ndarray:
        s = int(start[i]) + offset
        return genome.fetch(names[rec[i]], s, s + n)

    return ChunkTable(names, rec, start, np.concatenate(counts), np.arange(len(rec)), read, skipped)


class _RowGroupCache:
    """The sequences of recently read parquet row groups (a few; shared by reader threads)."""

    def __init__(self, groups: Sequence[tuple[str, int]], key: str, size: int = 8):
        self._groups, self._key, self._size = groups, key, size
        self._cache: dict[int, list] = {}
        self._lock = threading.Lock()

    def get(self, g: int) -> list:
        with self._lock:
            if g in self._cache:
                return self._cache[g]
        with _extras.imports(__name__):
            import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

        path, rg = self._groups[g]
        seqs = pq.ParquetFile(path).read_row_group(rg, columns=[self._key]).column(0).to_pylist()
        with self._lock:
            if len(self._cache) >= self._size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[g] = seqs
        return seqs


def parquet_chunks(files: Sequence[str], cfg, *, seq_len: int) -> dict[str, ChunkTable]:
    """``{split: ChunkTable}`` of the parquet rows, split by the record column.

    One pass over the files reads the record column and the sequence lengths (to know every
    row's allowed crop starts and to report short rows before training starts).
    """
    with _extras.imports(__name__):
        import pyarrow.compute as pc  # pylint: disable=g-import-not-at-top
        import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

    groups, rows = [], []  # rows: (group, row, record, length)
    for path in files:
        pf = pq.ParquetFile(path)
        for key in (cfg.sequence_key, cfg.record_key):
            if key not in pf.schema_arrow.names:
                raise ValueError(f"data.{'sequence_key' if key == cfg.sequence_key else 'record_key'}"
                                 f"={key!r} is not a column of {path} (columns: {pf.schema_arrow.names}).")
        for rg in range(pf.num_row_groups):
            t = pf.read_row_group(rg, columns=[cfg.sequence_key, cfg.record_key])
            seq = t.column(cfg.sequence_key)
            lengths = (pc.utf8_length(seq) if seq.type in ("string", "large_string")
                       else pc.binary_length(seq)).to_numpy(zero_copy_only=False)
            recs = [str(r) for r in t.column(cfg.record_key).to_pylist()]
            rows += [(len(groups), r, recs[r], int(lengths[r])) for r in range(len(recs))]
            groups.append((path, rg))
    if not rows:
        raise ValueError(f"data.paths={list(files)!r}: the parquet files hold no rows.")
    record_lengths: dict[str, int] = {}
    for _, _, name, n in rows:
        record_lengths[name] = record_lengths.get(name, 0) + n
    splits = split_pieces(cfg, record_lengths, allow_regions=False)
    cache = _RowGroupCache(groups, cfg.sequence_key)
    names = list(record_lengths)
    index = {n: i for i, n in enumerate(names)}
    out = {}
    for split, pieces in splits.items():
        wanted = {name for name, _, _ in pieces}
        picked, skipped = [], []
        for g, r, name, n in rows:
            if name not in wanted:
                continue
            if n - seq_len < 1:
                _short(cfg, f"{groups[g][0]} row group {groups[g][1]} row {r} ({cfg.record_key}="
                       f"{name!r})", n, seq_len + 1, skipped)
                continue
            picked.append((g, r, index[name], min(cfg.max_offset + 1, n - seq_len)))
        arr = np.array(picked, np.int64).reshape(-1, 4)

        def read(i: int, offset: int, n: int, arr=arr) -> np.ndarray:
            g, r = int(arr[i, 0]), int(arr[i, 1])
            seq = cache.get(g)[r][offset:offset + n]
            path, rg = groups[g]
            return fasta_lib.encode(seq, where=f"{path} row group {rg} row {r} "
                                    f"({cfg.record_key}={names[arr[i, 2]]!r})")[0]

        out[split] = ChunkTable(names, arr[:, 2].astype(np.int32), arr[:, 1], arr[:, 3], arr[:, 0],
                                read, skipped)
    return out


# ----------------------------------------------------------------------------------------
# Crops as grain datasets.


def _rng(*key: int) -> np.random.Generator:
    # Four-integer keys (seed, epoch, stream, id) keep the streams below from sharing seeds.
    return np.random.default_rng([int(k) for k in key])


def crop_example(window: np.ndarray) -> Batch:
    """A crop of seq_len + 1 base ids -> one example; targets that are N (an unknown base:
    assembly gaps, IUPAC codes read as N) get weight 0, so N is never trained or scored as a
    base (goat_jax/eval/dna.py excludes them likewise)."""
    example = text_lib._window_example(np.asarray(window, np.int32), len(window))  # pylint: disable=protected-access
    example["weights"] = example["weights"] * (example["targets"] != fasta_lib.N_ID)
    return example


class TrainCrops(grain.MapDataset):
    """Example ``i`` of this host's endless training stream (see the module docstring).

    Index i is example ``i % C`` of epoch ``i // C``, C = this host's chunk count. Random access
    makes grain's iterator state (the next index) an exact resume point.
    """

    def __init__(self, table: ChunkTable, chunks: np.ndarray, *, seq_len: int, seed: int,
                 reverse_complement: bool):
        super().__init__()
        self._table, self._chunks = table, np.asarray(chunks, np.int64)
        self._seq_len, self._seed, self._rc = seq_len, seed, reverse_complement
        blocks = table.block[self._chunks]
        self._block_ids, inverse = np.unique(blocks, return_inverse=True)
        self._singletons = len(self._block_ids) == len(self._chunks)
        self._members = None
        if not self._singletons:  # chunks grouped by block, in id order within each
            grouped = self._chunks[np.argsort(inverse, kind="stable")]
            self._members = np.split(grouped, np.cumsum(np.bincount(inverse))[:-1])
        self._orders: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return sys.maxsize

    def __str__(self) -> str:
        return f"TrainCrops({len(self._chunks)} chunks/epoch, seq_len={self._seq_len})"

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The chunk ids of ``epoch`` in visiting order."""
        with self._lock:
            if epoch in self._orders:
                return self._orders[epoch]
        perm = _rng(self._seed, epoch, 0, 0).permutation(len(self._block_ids))
        if self._singletons:
            order = self._chunks[perm]  # one chunk per block, both sorted by id
        else:
            order = np.concatenate([
                m[_rng(self._seed, epoch, 1, self._block_ids[j]).permutation(len(m))]
                for j, m in ((j, self._members[j]) for j in perm)])
        with self._lock:
            if len(self._orders) > 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return order

    def __getitem__(self, index: int) -> Batch:
        epoch, i = divmod(int(index), len(self._chunks))
        chunk = int(self.epoch_order(epoch)[i])
        rng = _rng(self._seed, epoch, 2, chunk)
        offset = int(rng.integers(self._table.n_starts[chunk]))
        window = self._table.read(chunk, offset, self._seq_len + 1)
        if self._rc and rng.random() < 0.5:
            window = fasta_lib.reverse_complement(window)
        return crop_example(window)


def eval_offset(table: ChunkTable, i: int, mode: str) -> int:
    """The fixed crop offset of eval chunk ``i``: 0 ('start') or CRC32-hashed ('hashed')."""
    if mode == "start":
        return 0
    key = f"{table.names[table.rec[i]]}:{table.block[i]}:{table.start[i]}".encode()
    return zlib.crc32(key) % int(table.n_starts[i])


class EvalCrops(grain.MapDataset):
    """The eval crops of ``chunks`` in storage order, each at :func:`eval_offset`."""

    def __init__(self, table: ChunkTable, chunks: np.ndarray, *, seq_len: int, mode: str):
        super().__init__()
        self._table, self._chunks, self._seq_len, self._mode = table, chunks, seq_len, mode

    def __len__(self) -> int:
        return len(self._chunks)

    def __str__(self) -> str:
        return f"EvalCrops({len(self._chunks)} crops, seq_len={self._seq_len})"

    def __getitem__(self, index: int) -> Batch:
        chunk = int(self._chunks[index])
        window = self._table.read(chunk, eval_offset(self._table, chunk, self._mode), self._seq_len + 1)
        return crop_example(window)


def host_chunks(table: ChunkTable, process_index: int, process_count: int) -> np.ndarray:
    """This host's chunk ids: blocks (FASTA chunks, parquet row groups) dealt round-robin."""
    blocks = np.unique(table.block)
    mine = np.isin(table.block, blocks[process_index::process_count])
    return np.flatnonzero(mine)


# ----------------------------------------------------------------------------------------
# Entry point.


def _check_config(cfg: ml_collections.ConfigDict) -> None:
    """Each field's type and range (:data:`FIELD_SPECS`), also when called outside the engine;
    record names and files are checked while building the tables."""
    check_section(cfg, FIELD_SPECS, "data")


def build_tables(cfg: ml_collections.ConfigDict, *, seq_len: int) -> dict[str, ChunkTable]:
    """``{'train' | 'valid' | 'test': ChunkTable}`` for the data config (no batching)."""
    _check_config(cfg)
    patterns = [cfg.paths] if isinstance(cfg.paths, str) else list(cfg.paths)
    if cfg.source == "parquet":
        files = documents.expand_paths(patterns, "paths")
        return parquet_chunks(files, cfg, seq_len=seq_len)
    files = [f for p in patterns for f in (sorted(glob.glob(p)) or [p])]
    genome = fasta_lib.Genome(files, max_in_memory_bytes=cfg.max_in_memory_bytes)
    stride = cfg.fasta_stride or seq_len + 1
    return {split: fasta_chunks(genome, pieces, seq_len=seq_len, stride=stride, cfg=cfg)
            for split, pieces in split_pieces(cfg, genome.lengths, allow_regions=True).items()}


def make_dna_datasets(
    data_config: ml_collections.ConfigDict,
    *,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    process_index: int | None = None,
    process_count: int | None = None,
    require_eval: bool = False,
) -> tuple[grain.DatasetIterator, Callable[[], Iterator[Batch]], fasta_lib.DnaTokenizer]:
    """Builds the training iterator, the eval-iterator factory and the tokenizer.

    Same contract as ``goat_jax.data.text.make_lm_datasets`` (see the module docstring for the
    sampling). Raises ValueError naming the field or file for bad input: unknown records,
    overlapping splits, short records (unless ``short_records='skip'``), invalid characters,
    and with ``require_eval`` (the trainer evaluates) an empty ``data.eval_split``, here rather
    than at the first evaluation.
    """
    cfg = data_config
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1.")
    process_index, process_count, local_batch = hosts.host_split(
        global_batch_size, seed, process_index, process_count)
    if cfg.num_eval_batches <= 0 and process_count > 1:
        raise ValueError(f"data.num_eval_batches={cfg.num_eval_batches}: a whole-split eval needs a "
                         "single process; set a positive number so all hosts agree.")
    tables = build_tables(cfg, seq_len=seq_len)
    for split, table in tables.items():
        if table.skipped:
            logging.warning("DNA %s split: skipped %d record(s) shorter than %d bases: %s", split,
                            len(table.skipped), seq_len + 1, table.skipped[:10])
    train = tables["train"]
    if len(np.unique(train.block)) < process_count:
        raise ValueError(f"data.paths: the training split has {len(np.unique(train.block))} chunks "
                         f"(parquet: row groups) for process_count={process_count} hosts; add data "
                         "or lower data.fasta_stride.")
    crops = TrainCrops(train, host_chunks(train, process_index, process_count), seq_len=seq_len,
                       seed=seed, reverse_complement=cfg.reverse_complement)
    train_iter = iter(crops.batch(local_batch, drop_remainder=True).to_iter_dataset(
        grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=4 * local_batch)))

    eval_table = tables[cfg.eval_split]
    if require_eval and not len(eval_table):
        skipped = eval_table.skipped
        why = (f": all {len(skipped)} of its record(s) were skipped as shorter than seq_len + 1 = "
               f"{seq_len + 1} bases (data.short_records='skip'): {skipped[:5]}" if skipped else "")
        raise ValueError(f"data.eval_split={cfg.eval_split!r}: the split is empty{why}. Set "
                         f"data.{cfg.eval_split}_records to longer held-out records, shorten "
                         "seq_len, or set eval_every_steps=0 to train without evaluation.")
    eval_chunks = host_chunks(eval_table, process_index, process_count)
    padding = text_lib._window_example(np.full(seq_len + 1, fasta_lib.N_ID, np.int32), 0)  # pylint: disable=protected-access

    def make_eval_iter() -> Iterator[Batch]:
        if not len(eval_table):
            raise ValueError(f"data.eval_split={cfg.eval_split!r}: the split is empty; set "
                             f"data.{cfg.eval_split}_records.")
        windows = iter(EvalCrops(eval_table, eval_chunks, seq_len=seq_len, mode=cfg.eval_offsets)
                       .to_iter_dataset(grain.ReadOptions(num_threads=cfg.read_threads)))
        return text_lib._eval_batches(windows, local_batch, cfg.num_eval_batches, padding, what="bases")  # pylint: disable=protected-access

    return train_iter, make_eval_iter, fasta_lib.DnaTokenizer()
