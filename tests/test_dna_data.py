"""The DNA tokenizer, FASTA reading and the genome crop pipeline (goat_jax.data.fasta / dna)."""

import gzip
import os
import warnings

import numpy as np
import pytest

from goat_jax.data import dna, fasta

BASES = np.array(list("ACGT"))


def _random_dna(rng, n, alphabet="ACGT"):
    return "".join(rng.choice(list(alphabet), n))


def _write_fasta(path, records, *, width=60, crlf=False, gz=False):
    """Writes records {name: seq} with lines of ``width`` (0 = one line per record)."""
    nl = "\r\n" if crlf else "\n"
    out = []
    for name, seq in records.items():
        out.append(f">{name} some description{nl}")
        step = width or max(len(seq), 1)
        out += [seq[i:i + step] + nl for i in range(0, len(seq), step)]
    data = "".join(out).encode()
    with (gzip.open(path, "wb") if gz else open(path, "wb")) as f:
        f.write(data)
    return path


def _independent_parse(path):
    """A plain line-by-line FASTA parse, written separately from goat_jax's."""
    raw = open(path, "rb").read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    records, name = {}, None
    for line in raw.decode().splitlines():
        line = line.strip()
        if line.startswith(">"):
            name = line[1:].split()[0]
            records[name] = []
        elif line:
            records[name].append(line)
    return {k: "".join(v) for k, v in records.items()}


def _cfg(paths, **overrides):
    c = dna.default_dna_data_config()
    c.paths = [str(p) for p in paths]
    c.valid_records = []
    c.read_threads = 0
    c.update(overrides)
    return c


# ----------------------------------------------------------------------------------------
# Tokenizer.


def test_tokenizer_round_trip_and_official_ids(rng):
    seq = _random_dna(rng, 1000, "ACGTN")
    ids, n_amb = fasta.encode(seq)
    assert n_amb == 0 and ids.dtype == np.uint8
    assert [fasta.encode(c)[0][0] for c in "ACGNT"] == [0, 1, 2, 3, 4]
    assert fasta.decode(ids) == seq
    tok = fasta.DnaTokenizer()
    assert tok.vocab_size == 5 and tok.decode(tok.encode(seq)) == seq


def test_lowercase_reads_as_upper_and_iupac_becomes_n_counted(rng):
    seq = _random_dna(rng, 500, "ACGTNacgtn")
    ids, n_amb = fasta.encode(seq)
    assert fasta.decode(ids) == seq.upper() and n_amb == 0
    ambiguous = "RYSWKMBDHVUryswkmbdhvu"
    ids, n_amb = fasta.encode("AC" + ambiguous + "gt")
    assert fasta.decode(ids) == "AC" + "N" * len(ambiguous) + "GT"
    assert n_amb == len(ambiguous)


@pytest.mark.parametrize("bad", ["ACGTE", "MKLPQE", "ACG-T", "AC1GT", "ACGé"])
def test_invalid_characters_are_errors(bad):
    with pytest.raises(ValueError, match="myfile.fa record 'r1'"):
        fasta.encode(bad, where="myfile.fa record 'r1'")


def test_reverse_complement_in_id_space(rng):
    seq = _random_dna(rng, 300, "ACGTN")
    comp = {"A": "T", "C": "G", "G": "C", "T": "A", "N": "N"}
    expected = "".join(comp[c] for c in reversed(seq))
    assert fasta.decode(fasta.reverse_complement(fasta.encode(seq)[0])) == expected


# ----------------------------------------------------------------------------------------
# FASTA files.


@pytest.mark.parametrize("gz,crlf", [(False, False), (True, False), (False, True), (True, True)])
def test_fasta_reading_matches_independent_parse(tmp_path, rng, gz, crlf):
    records = {f"rec{i}": _random_dna(rng, int(rng.integers(1, 3000)), "ACGTNacgtRY")
               for i in range(4)}
    files = []
    for i, width in enumerate([1, 7, 61, 0]):  # odd widths and one unwrapped file
        name = f"rec{i}"
        files.append(_write_fasta(tmp_path / f"f{i}.fa{'.gz' if gz else ''}",
                                  {name: records[name]}, width=width, crlf=crlf, gz=gz))
    # One more file with several records and a different width.
    multi = {f"multi{i}": _random_dna(rng, int(rng.integers(1, 500))) for i in range(3)}
    files.append(_write_fasta(tmp_path / "multi.fa", multi, width=13, crlf=crlf, gz=gz))
    genome = fasta.Genome([str(f) for f in files])
    expected = {}
    for f in files:
        expected.update(_independent_parse(f))
    assert genome.names == list(expected)
    for name, seq in expected.items():
        assert genome.lengths[name] == len(seq)
        assert fasta.decode(genome.record(name)) == seq.upper().replace("R", "N").replace("Y", "N")
        assert genome.ambiguous[name] == sum(seq.upper().count(c) for c in "RY")
        a = int(rng.integers(0, len(seq)))
        b = int(rng.integers(a, len(seq) + 1))
        assert fasta.decode(genome.fetch(name, a, b)) == seq[a:b].upper().replace("R", "N").replace("Y", "N")


def test_indexed_fasta_plain_and_bgzip(tmp_path, rng):
    pyfaidx = pytest.importorskip("pyfaidx")
    bgzf = pytest.importorskip("Bio.bgzf")
    records = {"chrA": _random_dna(rng, 5000, "ACGTacgtN"), "chrB": _random_dna(rng, 777)}
    plain = _write_fasta(tmp_path / "g.fa", records, width=60)
    data = open(plain, "rb").read()
    with bgzf.BgzfWriter(str(tmp_path / "g.fa.gz"), "wb") as w:
        w.write(data)
    for path in (str(plain), str(tmp_path / "g.fa.gz")):
        pyfaidx.Faidx(path).close()  # writes .fai (and .gzi for bgzip)
        genome = fasta.Genome([path], max_in_memory_bytes=0)  # must not read it into memory
        assert not genome._memory and set(genome._indexed) == set(records)  # pylint: disable=protected-access
        for name, seq in records.items():
            a = int(rng.integers(0, len(seq) - 10))
            assert fasta.decode(genome.fetch(name, a, a + 10)) == seq[a:a + 10].upper()
            assert fasta.decode(genome.record(name)) == seq.upper()


def test_fasta_errors(tmp_path):
    empty = tmp_path / "empty.fa"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.fa: no FASTA records"):
        fasta.Genome([str(empty)])
    headless = tmp_path / "headless.fa"
    headless.write_text("ACGT\n")
    with pytest.raises(ValueError, match="headless.fa: no FASTA header"):
        fasta.Genome([str(headless)])
    protein = _write_fasta(tmp_path / "protein.fa", {"P12345": "MKTAYIAKQRQISFVKSHFSRQ"})
    with pytest.raises(ValueError, match=r"protein.fa record 'P12345'.*protein FASTA"):
        fasta.Genome([str(protein)])
    dup = _write_fasta(tmp_path / "dup.fa", {"x": "ACGT"})
    with open(dup, "a") as f:
        f.write(">x\nACGT\n")
    with pytest.raises(ValueError, match="'x' appears twice"):
        fasta.Genome([str(dup)])
    big = _write_fasta(tmp_path / "big.fa", {"x": "ACGT" * 100})
    with pytest.raises(ValueError, match=r"no index .*samtools faidx .*big.fa"):
        fasta.Genome([str(big)], max_in_memory_bytes=100)
    with pytest.raises(ValueError, match="does not exist"):
        fasta.Genome([str(tmp_path / "missing.fa")])


# ----------------------------------------------------------------------------------------
# Crops, splits, resume, hosts.


def _locate(window: str, records: dict) -> tuple[str, int]:
    """(record, 0-based start) of ``window`` (unique in random sequence)."""
    hits = [(n, s.find(window)) for n, s in records.items() if window in s]
    assert len(hits) == 1, f"window found {len(hits)} times"
    return hits[0]


def _window(batch, i):
    return fasta.decode(np.concatenate([batch["inputs"][i], batch["targets"][i][-1:]]))


def test_training_crops_cover_each_chunk_once_per_epoch_inside_the_train_split(tmp_path, rng):
    seq_len, stride = 31, 50
    records = {"chr1": _random_dna(rng, 2000), "chr2": _random_dna(rng, 1500)}
    path = _write_fasta(tmp_path / "g.fa", records)
    cfg = _cfg([path], valid_records=["chr1:1001-1400"], fasta_stride=stride)
    tables = dna.build_tables(cfg, seq_len=seq_len)
    train = tables["train"]
    # Pieces: chr1 [0,1000) and [1400,2000), chr2 [0,1500): starts per piece = length - seq_len.
    pieces = [("chr1", 0, 1000), ("chr1", 1400, 2000), ("chr2", 0, 1500)]
    expected_chunks = sum(-(-(b - a - seq_len) // stride) for _, a, b in pieces)
    assert len(train) == expected_chunks
    it, _, _ = dna.make_dna_datasets(cfg, seq_len=seq_len, global_batch_size=1, seed=3,
                                     process_index=0, process_count=1)
    seen = []
    for _ in range(2 * expected_chunks):
        b = next(it)
        assert b["inputs"].shape == (1, seq_len) and np.all(b["weights"] == 1)
        np.testing.assert_array_equal(b["inputs"][0, 1:], b["targets"][0, :-1])
        name, start = _locate(_window(b, 0), records)
        piece = [p for p in pieces if p[0] == name and p[1] <= start and start + seq_len + 1 <= p[2]]
        assert piece, f"crop {name}:{start} leaves the training pieces"
        _, a, _ = piece[0]
        seen.append((name, a + (start - a) // stride * stride))  # the chunk it came from
    epoch1, epoch2 = seen[:expected_chunks], seen[expected_chunks:]
    assert len(set(epoch1)) == expected_chunks and set(epoch1) == set(epoch2)
    assert epoch1 != epoch2  # a new order every epoch


def test_eval_crops_tile_the_held_out_region_at_fixed_offsets(tmp_path, rng):
    seq_len = 63
    records = {"chr1": _random_dna(rng, 3000)}
    path = _write_fasta(tmp_path / "g.fa", records)
    cfg = _cfg([path], valid_records=["chr1:1001-2000"], num_eval_batches=0)
    _, make_eval, _ = dna.make_dna_datasets(cfg, seq_len=seq_len, global_batch_size=4, seed=0,
                                            process_index=0, process_count=1)
    starts = []
    for b in make_eval():
        for i in range(len(b["inputs"])):
            if b["weights"][i].any():
                starts.append(_locate(_window(b, i), records)[1])
            else:
                assert not b["weights"][i].any()
    # 1000 held-out bases, windows of 64 at offset 0 of each stride-64 chunk: 15 full windows.
    assert starts == [1000 + 64 * k for k in range(15)]
    assert [len(list(make_eval())) for _ in range(2)] == [4, 4]  # fresh, finite, repeatable
    cfg.eval_offsets = "hashed"
    table = dna.build_tables(cfg, seq_len=seq_len)["valid"]
    offsets = [dna.eval_offset(table, i, "hashed") for i in range(len(table))]
    assert all(0 <= o < n for o, n in zip(offsets, table.n_starts)) and any(offsets)


def test_resume_is_exact(tmp_path, rng):
    path = _write_fasta(tmp_path / "g.fa", {"c": _random_dna(rng, 5000)})
    cfg = _cfg([path], valid_records=["c:4001-5000"], reverse_complement=True, read_threads=2)
    kw = dict(seq_len=40, global_batch_size=4, seed=11, process_index=0, process_count=1)
    it, _, _ = dna.make_dna_datasets(cfg, **kw)
    for _ in range(int(rng.integers(1, 40))):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(30)]  # crosses epoch boundaries (~24 chunks/epoch)
    resumed, _, _ = dna.make_dna_datasets(cfg, **kw)
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    other, _, _ = dna.make_dna_datasets(cfg, **{**kw, "seed": 12})
    assert not np.array_equal(next(other)["inputs"], expected[0]["inputs"])


def test_reverse_complement_augmentation(tmp_path, rng):
    records = {"c": _random_dna(rng, 4000)}
    path = _write_fasta(tmp_path / "g.fa", records)
    rc_records = {"c_rc": fasta.decode(fasta.reverse_complement(fasta.encode(records["c"])[0]))}
    kw = dict(seq_len=40, global_batch_size=8, seed=0, process_index=0, process_count=1)
    flips = []
    for rc in (False, True):
        it, _, _ = dna.make_dna_datasets(_cfg([path], reverse_complement=rc), **kw)
        for _ in range(5):
            b = next(it)
            for i in range(8):
                flips.append((rc, _locate(_window(b, i), {**records, **rc_records})[0] == "c_rc"))
    assert not any(f for rc, f in flips if not rc)  # off by default: never flipped
    n_flipped = sum(f for rc, f in flips if rc)
    assert 5 <= n_flipped <= 35  # ~1/2 of 40


def test_host_shards_are_disjoint_and_cover_the_split(tmp_path, rng):
    records = {"c": _random_dna(rng, 6000)}
    path = _write_fasta(tmp_path / "g.fa", records)
    cfg = _cfg([path], fasta_stride=100)
    table = dna.build_tables(cfg, seq_len=30)["train"]
    chunks = [set(dna.host_chunks(table, p, 3).tolist()) for p in range(3)]
    assert set.union(*chunks) == set(range(len(table)))
    assert sum(map(len, chunks)) == len(table)
    starts = []
    for p in range(3):
        it, _, _ = dna.make_dna_datasets(cfg, seq_len=30, global_batch_size=3, seed=5,
                                         process_index=p, process_count=3)
        batches = [next(it) for _ in range(len(chunks[p]))]  # one epoch of this host
        starts.append({_locate(_window(b, 0), records)[1] // 100 for b in batches})
        assert starts[-1] == {int(table.start[c]) // 100 for c in chunks[p]}
    assert not (starts[0] & starts[1]) and not (starts[0] & starts[2]) and not (starts[1] & starts[2])


def test_split_and_length_errors(tmp_path, rng):
    path = _write_fasta(tmp_path / "g.fa", {"chr1": _random_dna(rng, 500), "tiny": "ACGTACGT"})
    kw = dict(seq_len=20, global_batch_size=2, seed=0, process_index=0, process_count=1)
    with pytest.raises(ValueError, match=r"data.valid_records: record 'chrX'.*not in the data"):
        dna.make_dna_datasets(_cfg([path], valid_records=["chrX"]), **kw)
    with pytest.raises(ValueError, match=r"data.test_records: region 'chr1:400-600' is outside"):
        dna.make_dna_datasets(_cfg([path], test_records=["chr1:400-600"]), **kw)
    with pytest.raises(ValueError, match="overlap on 'chr1'"):
        dna.make_dna_datasets(_cfg([path], valid_records=["chr1:1-100"],
                                   test_records=["chr1:50-150"]), **kw)
    with pytest.raises(ValueError, match=r"g.fa record 'tiny' \[1, 8\] has 8 bases, fewer than"):
        dna.make_dna_datasets(_cfg([path], valid_records=["chr1:401-500"]), **kw)
    cfg = _cfg([path], valid_records=["chr1:401-500"], short_records="skip")
    tables = dna.build_tables(cfg, seq_len=20)
    assert len(tables["train"].skipped) == 1 and "tiny" in tables["train"].skipped[0]
    with pytest.raises(ValueError, match=r"data.eval_offsets='middle' is not allowed: allowed is one of \['start', 'hashed'\]"):
        dna.make_dna_datasets(_cfg([path], eval_offsets="middle"), **kw)


# ----------------------------------------------------------------------------------------
# Parquet chunks (the layout of the human_reference_genome 6 kbp dataset).


def _write_parquet(path, rows, row_group_size):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"sequence": [s for _, s in rows], "chromosome": [c for c, _ in rows],
                      "start_pos": list(range(len(rows))), "end_pos": list(range(len(rows)))})
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


def test_parquet_chunks_splits_offsets_and_short_rows(tmp_path, rng):
    seq_len, max_offset = 50, 20
    rows = [(c, _random_dna(rng, 120)) for c in ["1"] * 7 + ["2"] * 5 + ["22"] * 4]
    rows.append(("22", "ACGT" * 5))  # a short chromosome tail
    files = [_write_parquet(tmp_path / "a.parquet", rows[:9], 4),
             _write_parquet(tmp_path / "b.parquet", rows[9:], 3)]
    cfg = _cfg([str(tmp_path / "*.parquet")], source="parquet", valid_records=["22"],
               max_offset=max_offset, short_records="skip", eval_offsets="hashed",
               num_eval_batches=0)
    tables = dna.build_tables(cfg, seq_len=seq_len)
    assert len(tables["train"]) == 12 and len(tables["valid"]) == 4
    assert len(tables["valid"].skipped) == 1 and "chromosome='22'" in tables["valid"].skipped[0]
    by_seq = {s: c for c, s in rows}
    it, make_eval, _ = dna.make_dna_datasets(cfg, seq_len=seq_len, global_batch_size=2, seed=1,
                                             process_index=0, process_count=1)
    for _ in range(12):
        b = next(it)
        for i in range(2):
            w = _window(b, i)
            (seq,) = [s for s in by_seq if w in s]
            assert by_seq[seq] in ("1", "2") and seq.find(w) <= max_offset
    ev = [_window(b, i) for b in make_eval() for i in range(2) if b["weights"][i].any()]
    assert len(ev) == 4 and all(by_seq[[s for s in by_seq if w in s][0]] == "22" for w in ev)
    assert ev == [_window(b, i) for b in make_eval() for i in range(2) if b["weights"][i].any()]
    with pytest.raises(ValueError, match="data.record_key='chrom' is not a column"):
        dna.build_tables(_cfg(files, source="parquet", record_key="chrom"), seq_len=seq_len)
    with pytest.raises(ValueError, match="parquet data splits by whole records"):
        dna.build_tables(_cfg(files, source="parquet", valid_records=["1:1-100"]), seq_len=seq_len)
    cfg.short_records = "error"
    with pytest.raises(ValueError, match=r"b.parquet row group \d row \d \(chromosome='22'\) has 20"):
        dna.build_tables(cfg, seq_len=seq_len)


def _fasta_text(rng, n=120_000):
    seq = _random_dna(rng, n)
    return (">r1\n" + "\n".join(seq[i:i + 60] for i in range(0, n, 60)) + "\n").encode()


def test_truncated_or_corrupt_gzip_is_one_error_naming_the_file(tmp_path, rng):
    """A cut-short gzip (EOFError), a damaged one (CRC / zlib.error) and a truncated bgzip with
    its index all give one ValueError naming the file and the fix, at open time."""
    data = gzip.compress(_fasta_text(rng))
    cut = tmp_path / "cut.fa.gz"
    cut.write_bytes(data[:len(data) // 2])
    flipped = bytearray(data)
    for i in range(len(flipped) // 3, len(flipped) // 3 + 64):
        flipped[i] ^= 0x5A
    bad = tmp_path / "bad.fa.gz"
    bad.write_bytes(bytes(flipped))
    for path in (cut, bad):
        with pytest.raises(ValueError, match=rf"{path}: the compressed FASTA is truncated or corrupt"
                                             r" \((EOFError|BadGzipFile|error): .*Copy or download it again"):
            fasta.Genome([str(path)])


def test_truncated_bgzip_with_its_index_is_found_at_open(tmp_path, rng):
    pyfaidx = pytest.importorskip("pyfaidx")
    bgzf = pytest.importorskip("Bio.bgzf")
    path = tmp_path / "g.fa.gz"
    with bgzf.BgzfWriter(str(path), "wb") as w:
        w.write(_fasta_text(rng, 600_000))  # ~10 bgzip blocks
    pyfaidx.Faidx(str(path)).close()
    raw = path.read_bytes()
    # Cut in the middle (pyfaidx opens it; the last base fails) or near the start (the open fails).
    for keep, expected in ((len(raw) // 2, "the compressed FASTA is truncated or corrupt or its index is stale"),
                           (30, "could not open with its index .* the file is truncated or corrupt")):
        path.write_bytes(raw[:keep])
        with warnings.catch_warnings(), pytest.raises(ValueError, match=rf"{path}: {expected}"):
            warnings.simplefilter("ignore", RuntimeWarning)  # pyfaidx: the index is older
            fasta.Genome([str(path)], max_in_memory_bytes=0)


def test_n_targets_get_weight_zero_in_training_and_eval_crops():
    """N is never a target to learn or score (goat_jax/data/dna.py, 'N targets'); N inputs stay."""
    window = fasta.encode("ACGNNTTNA")[0]
    ex = dna.crop_example(window)
    np.testing.assert_array_equal(ex["inputs"], window[:-1])
    np.testing.assert_array_equal(ex["targets"], window[1:])
    np.testing.assert_array_equal(ex["weights"], [1, 1, 0, 0, 1, 1, 0, 1])  # targets CGNNTTNA
    assert ex["weights"].dtype == np.float32


def test_an_empty_eval_split_after_skipping_short_records_is_refused_before_training(tmp_path, rng):
    """Every held-out record skipped as short: the trainer stops before its first step (it used
    to train, checkpoint, and only fail at the first evaluation)."""
    from configs import dna_tiny  # pylint: disable=g-import-not-at-top
    from goat_jax.train import trainer  # pylint: disable=g-import-not-at-top

    path = _write_fasta(tmp_path / "g.fa", {"chr1": _random_dna(rng, 2000), "tiny": "ACGTACGTAC"})
    cfg = _cfg([path], valid_records=["tiny"], short_records="skip")
    kw = dict(seq_len=20, global_batch_size=2, seed=0, process_index=0, process_count=1)
    dna.make_dna_datasets(cfg, **kw)  # no evaluation asked for: fine
    with pytest.raises(ValueError, match=r"data.eval_split='valid': the split is empty: all 1 of its "
                                         r"record\(s\) were skipped as shorter than seq_len \+ 1 = 21"):
        dna.make_dna_datasets(cfg, require_eval=True, **kw)
    config = dna_tiny.get_config("goat,smoke")
    config.progress_bar = False
    config.data.paths, config.data.valid_records, config.data.short_records = (str(path),), ("tiny",), "skip"
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match="the split is empty"):
        trainer.train_and_evaluate(config, str(workdir))
    assert not (workdir / "checkpoints").exists() or not os.listdir(workdir / "checkpoints")
