"""The LM text pipeline: packing, determinism, exact resume, host sharding, sources, errors.

Most tests use small corpora written to tmp_path so that several epochs pass in a few
batches; the Jargon File (the tiny config's corpus) is checked end to end once.
"""

import gzip
import json
import warnings

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from goat_jax.data import documents
from goat_jax.data import text as text_lib
from goat_jax.data import tokenizers

BOS, EOS, PAD = 1, 2, 0
BYTES = tokenizers.ByteTokenizer()


def _config(**overrides):
    cfg = text_lib.default_data_config()
    cfg.read_threads = 1
    cfg.update(overrides)
    return cfg


def _make(cfg, seq_len=16, batch=4, seed=0, process_index=0, process_count=1):
    return text_lib.make_lm_datasets(cfg, seq_len=seq_len, global_batch_size=batch, seed=seed,
                                     process_index=process_index, process_count=process_count)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for a, b in zip(batches_a, batches_b):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def _token_stream(batches):
    """The token stream the windows were cut from (batches in order, pad dropped)."""
    windows = [np.concatenate([b["inputs"][r], b["targets"][r, -1:]])
               for b in batches for r in range(len(b["inputs"]))]
    stream = np.concatenate(windows)
    return stream[stream != PAD]


def _documents(stream):
    """Complete BOS ... EOS documents of a stream, decoded; checks the boundary markers."""
    bos, eos = np.flatnonzero(stream == BOS), np.flatnonzero(stream == EOS)
    docs = [BYTES.decode(stream[b + 1:e]) for b, e in zip(bos, eos[np.searchsorted(eos, bos[0]):])]
    # Every EOS that is not the last token is immediately followed by the next BOS.
    follows = eos[eos + 1 < len(stream)] + 1
    assert np.all(stream[follows] == BOS)
    return docs


@pytest.fixture
def paragraphs_file(tmp_path):
    """20 short paragraph documents in a .gz file (an epoch is a few batches)."""
    docs = [f"Document {i}: " + " ".join(["lorem", "ipsum", "dolor"][: 1 + i % 3]) * (1 + i % 4)
            for i in range(20)]
    path = tmp_path / "corpus.txt.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n\n".join(docs) + "\n")
    return str(path), docs


def _paragraph_config(path):
    return _config(paths=[path], doc_split="paragraphs", eval_fraction=0.2, num_eval_batches=-1)


def test_split_documents_modes():
    text = "Heading\n   body line\n   :entry one: n.\n\n   Text of one.\n   :two: v.\n   More.\n"
    assert documents.split_documents(text, "entries") == [
        "Heading\nbody line", ":entry one: n.\n\nText of one.", ":two: v.\nMore."]
    assert documents.split_documents("a\nb\n\n \n\nc", "paragraphs") == ["a\nb", "c"]
    assert documents.split_documents("  a\n\nb  ", "files") == ["a\n\nb"]
    with pytest.raises(ValueError, match="data.doc_split"):
        documents.split_documents(text, "sentences")


def test_jargon_windows_shapes_shift_and_document_boundaries():
    train, make_eval, tok = _make(_config(num_eval_batches=2), seq_len=128, batch=4)
    assert tok.vocab_size == 259
    batches = _take(train, 6)
    for b in batches:
        assert b["inputs"].shape == b["targets"].shape == b["weights"].shape == (4, 128)
        assert b["inputs"].dtype == b["targets"].dtype == np.int32
        assert b["weights"].dtype == np.float32 and np.all(b["weights"] == 1.0)
        # The targets are the inputs shifted by one: both are cut from one window of 129.
        np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    stream = _token_stream(batches)
    assert stream[0] == BOS  # Training starts at a document boundary.
    docs = _documents(stream)
    assert len(docs) >= 2
    assert all(d.startswith(":") or d[0].isalnum() for d in docs)  # Entries and headings.
    eval_batches = list(make_eval())
    assert len(eval_batches) == 2
    eval_docs = set(_documents(_token_stream(eval_batches)))
    assert eval_docs and not eval_docs & set(docs)


def test_eval_is_finite_unshuffled_padded_and_repeatable(paragraphs_file):
    path, docs = paragraphs_file
    cfg = _paragraph_config(path)
    _, make_eval, _ = _make(cfg, seq_len=16, batch=4)
    first, second = list(make_eval()), list(make_eval())
    _assert_same(first, second)
    held_out = _documents(_token_stream(first))
    assert len(held_out) == 4  # 20% of 20 documents, in file order.
    assert held_out == [d for d in docs if d in held_out]
    # The tail is padding with weight 0; real targets keep weight 1.
    last = first[-1]
    real_targets = (last["targets"] != PAD).astype(np.float32)
    np.testing.assert_array_equal(last["weights"], real_targets)
    assert last["weights"].sum() < last["weights"].size
    # A fixed number of batches: padded with all-zero-weight batches past the end.
    cfg.num_eval_batches = len(first) + 2
    _, make_eval, _ = _make(cfg, seq_len=16, batch=4)
    padded = list(make_eval())
    _assert_same(padded[: len(first)], first)
    assert len(padded) == len(first) + 2 and padded[-1]["weights"].sum() == 0


def test_training_covers_every_train_document_each_epoch(paragraphs_file):
    path, docs = paragraphs_file
    train, make_eval, _ = _make(_paragraph_config(path), seq_len=16, batch=4)
    held_out = set(_documents(_token_stream(list(make_eval()))))
    seen = _documents(_token_stream(_take(train, 60)))
    # The first 16 documents are one epoch: a permutation of the train documents.
    assert sorted(seen[:16]) == sorted(d for d in docs if d not in held_out)
    assert seen[:16] != seen[16:32]  # Reshuffled every epoch.


def test_same_seed_same_batches_other_seed_other_batches(paragraphs_file):
    cfg = _paragraph_config(paragraphs_file[0])
    a = _take(_make(cfg, seed=3)[0], 5)
    _assert_same(a, _take(_make(cfg, seed=3)[0], 5))
    b = _take(_make(cfg, seed=4)[0], 5)
    assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b))


def _check_resume(cfg, *, n_total=30, points=(0, 1, 7, 19), **make_kwargs):
    """Restoring the JSON-round-tripped state after k batches continues with batch k."""
    train = _make(cfg, **make_kwargs)[0]
    states, batches = [], []
    for _ in range(n_total):
        states.append(json.loads(json.dumps(train.get_state())))
        batches.append(next(train))
    for k in points:
        fresh = _make(cfg, **make_kwargs)[0]
        fresh.set_state(states[k])
        _assert_same(_take(fresh, n_total - k), batches[k:])


def test_resume_text_files_across_epochs(paragraphs_file):
    _check_resume(_paragraph_config(paragraphs_file[0]), seq_len=16, batch=4)


def _write_records(tmp_path):
    """FineWeb-style shards: the same 60 records as 3 parquet and as 3 jsonl(.gz) files."""
    records = [{"text": f"record {i} " + "abc " * (i % 7), "id": i} for i in range(60)]
    for s in range(3):
        shard = records[20 * s: 20 * (s + 1)]
        pq.write_table(pa.Table.from_pylist(shard), tmp_path / f"shard-{s}.parquet",
                       row_group_size=5)
        lines = "".join(json.dumps(r) + "\n" for r in shard)
        if s == 2:
            with gzip.open(tmp_path / f"shard-{s}.jsonl.gz", "wt") as f:
                f.write(lines)
        else:
            (tmp_path / f"shard-{s}.jsonl").write_text(lines)
    return [r["text"] for r in records]


@pytest.mark.parametrize("source,pattern", [("parquet", "shard-*.parquet"),
                                            ("jsonl", "shard-*.jsonl*")])
def test_sharded_files_read_every_record_once_and_resume(tmp_path, source, pattern):
    texts = _write_records(tmp_path)
    glob_pattern = str(tmp_path / pattern)
    # Blocks as long as the first line: the second block starts exactly at a line start,
    # later ones mid-line, and some hold no line start at all.
    block_bytes = len((tmp_path / "shard-0.jsonl").read_bytes().split(b"\n")[0]) + 1
    # Reading all files as the (unshuffled) eval split yields every record once, in order.
    cfg = _config(source=source, paths=[glob_pattern], eval_paths=[glob_pattern],
                  jsonl_block_bytes=block_bytes, num_eval_batches=-1)
    _, make_eval, _ = _make(cfg, seq_len=32, batch=2)
    assert _documents(_token_stream(list(make_eval()))) == texts

    cfg = _config(source=source, paths=[glob_pattern], jsonl_block_bytes=block_bytes,
                  eval_fraction=0.25, num_eval_batches=-1)
    train, make_eval, _ = _make(cfg, seq_len=32, batch=2)
    held_out = set(_documents(_token_stream(list(make_eval()))))
    seen = set(_documents(_token_stream(_take(train, 40))))
    assert held_out and not held_out & seen and held_out | seen == set(texts)
    _check_resume(cfg, seq_len=32, batch=2, n_total=40, points=(0, 3, 17, 31))


@pytest.fixture
def mock_c4():
    tfds = pytest.importorskip("tensorflow_datasets")
    # Without TensorFlow, `import tensorflow_datasets` cannot register every builder (the
    # text package import fails), so `tfds.data_source('c4/en')` would not find the C4
    # builder class that mock_data needs. Its own module imports fine without TF: import it
    # to register it. (Real runs need no class: tfds reads the prepared data_dir metadata.)
    from tensorflow_datasets.text import c4  # noqa: F401  (registers the builder)
    # MockPolicy.USE_CODE: random examples from the feature spec, served through the real
    # ArrayRecordDataSource class (the array_record reader itself is mocked).
    with tfds.testing.mock_data(num_examples=40, policy=tfds.testing.MockPolicy.USE_CODE):
        yield _config(source="tfds", tfds_name="c4/en", tfds_data_dir="/nonexistent",
                      num_eval_batches=3)


def test_tfds_data_source_with_mock_c4(mock_c4):
    train, make_eval, _ = _make(mock_c4, seq_len=32, batch=2)
    docs = _documents(_token_stream(_take(train, 20)))
    assert docs and all(set(d) <= set(" abcdefghij") for d in docs)  # The mock's alphabet.
    assert len(list(make_eval())) == 3
    _check_resume(mock_c4, seq_len=32, batch=2, n_total=25, points=(0, 2, 13))


def test_two_hosts_read_disjoint_shards_that_cover_the_data(paragraphs_file):
    path, docs = paragraphs_file
    cfg = _paragraph_config(path)
    single_eval = _documents(_token_stream(list(_make(cfg, batch=4)[1]())))
    cfg.num_eval_batches = 4  # Whole-split eval is single-process only.
    train_docs, eval_docs, first_batches = [], [], []
    for host in range(2):
        train, make_eval, _ = _make(cfg, batch=4, process_index=host, process_count=2)
        batches = _take(train, 12)  # More than an epoch of this host's 8 documents.
        assert all(b["inputs"].shape == (2, 16) for b in batches)  # The local half of 4.
        first_batches.append(batches[0])
        train_docs.append(set(_documents(_token_stream(batches))))
        eval_batches = list(make_eval())
        assert len(eval_batches) == 4  # Same number of eval steps on every host.
        eval_docs.append(_documents(_token_stream(eval_batches)))
    assert not train_docs[0] & train_docs[1]
    assert train_docs[0] | train_docs[1] == set(docs) - set(single_eval)
    assert not set(eval_docs[0]) & set(eval_docs[1])
    assert sorted(eval_docs[0] + eval_docs[1]) == sorted(single_eval)
    # The global batch is the local batches stacked in process order.
    stacked = np.concatenate([b["inputs"] for b in first_batches])
    assert stacked.shape == (4, 16) and len({r.tobytes() for r in stacked}) == 4


def test_to_global_array_single_process():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    n = 2 * len(jax.devices())
    local = {"inputs": np.arange(n * 8, dtype=np.int32).reshape(n, 8),
             "weights": np.ones((n, 8), np.float32)}
    global_batch = text_lib.to_global_array(local, sharding)
    assert global_batch["inputs"].shape == (n, 8) and global_batch["inputs"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(global_batch["inputs"]), local["inputs"])


@pytest.mark.parametrize("overrides,kwargs,field", [
    ({"source": "hdf5"}, {}, "data.source"),
    ({"paths": ["/nonexistent/*.txt"]}, {}, "data.paths"),
    ({"eval_fraction": 0.0}, {}, "data.eval_fraction"),
    ({"tokenizer": "bpe"}, {}, "data.tokenizer"),
    ({}, {"seq_len": 0}, "seq_len"),
    ({}, {"batch": 3, "process_count": 2}, "global_batch_size"),
    ({}, {"process_index": 2, "process_count": 2}, "process_index"),
    ({"num_eval_batches": 0}, {"process_count": 2}, "data.num_eval_batches"),
    ({"source": "tfds", "tfds_name": "c4/en", "tfds_data_dir": "/nonexistent"}, {},
     "data.tfds_name"),
])
def test_bad_values_raise_naming_the_field(overrides, kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        _make(_config(**overrides), **kwargs)


def test_wrong_text_key_raises_naming_the_field(tmp_path):
    _write_records(tmp_path)
    for source, pattern in [("parquet", "*.parquet"), ("jsonl", "*.jsonl")]:
        cfg = _config(source=source, paths=[str(tmp_path / pattern)], text_key="body")
        with pytest.raises(ValueError, match=r"data\.text_key"):
            next(_make(cfg)[0])


def test_invalid_utf8_is_counted_and_reported(tmp_path):
    # Latin-1 prose: valid ASCII plus 2 bytes that are not UTF-8 (0xe9 'e acute', 0xfc 'u umlaut').
    raw = ("Caf\xe9 menu: " + "plain ascii words " * 20 + "M\xfcller\n\n").encode("latin-1") * 3
    path = tmp_path / "latin1.txt"
    path.write_bytes(raw)
    with pytest.warns(UserWarning, match=rf"latin1\.txt: 6 of {len(raw)} bytes are not valid UTF-8"):
        text = documents.read_text(str(path))
    # Independent count: every invalid byte became exactly one U+FFFD, the rest is unchanged.
    assert text.count("\ufffd") == 6
    assert text == raw.decode("utf-8", errors="replace")
    # A genuine U+FFFD in valid UTF-8 text is not a replacement: no warning.
    good = tmp_path / "good.txt"
    good.write_bytes("a real \ufffd character and caf\u00e9\n".encode("utf-8"))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert documents.read_text(str(good)) == "a real \ufffd character and caf\u00e9\n"


def test_binary_file_is_refused_naming_file_and_fraction(tmp_path, rng):
    path = tmp_path / "weights.bin"
    data = rng.integers(0, 256, size=4096, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    # Independent fraction: bytes in invalid UTF-8 sequences plus C0 controls.
    decoded = data.decode("utf-8", errors="surrogateescape")
    invalid = sum(0xDC80 <= ord(c) <= 0xDCFF for c in decoded)
    controls = sum(b < 0x20 and b not in (9, 10, 11, 12, 13) or b == 0x7F for b in data)
    fraction = (invalid + controls) / len(data)
    assert fraction > 0.5
    with pytest.raises(ValueError, match=rf"weights\.bin does not look like UTF-8 text: "
                                         rf"{round(100 * fraction)}% of its 4096 bytes"):
        next(_make(_config(paths=[str(path)], doc_split="files", eval_fraction=0.5))[0])
    # NUL-heavy data that happens to be valid UTF-8 (e.g. a float32 array) is refused too.
    zeros = tmp_path / "array.npy"
    zeros.write_bytes(np.arange(1000, dtype=np.int32).tobytes())
    with pytest.raises(ValueError, match=r"array\.npy does not look like UTF-8 text"):
        documents.read_text(str(zeros))


def test_bos_windows_start_with_bos_and_keep_every_token_once(tmp_path, paragraphs_file):
    """GPT-2 BPE (a small local vocabulary) with BOS windows: position 0 of every window is
    BOS (= EOS), documents end with EOS, and the targets are exactly the token stream."""
    from tests.test_tokenizers import write_small_ranks

    path, docs = paragraphs_file
    ranks = write_small_ranks(tmp_path / "small.tiktoken")
    cfg = _config(paths=[path], eval_paths=[path], doc_split="paragraphs", num_eval_batches=-1,
                  tokenizer="gpt2", bpe_ranks_path=ranks, bos_windows=True)
    train, make_eval, tok = _make(cfg, seq_len=16, batch=4)
    bos = tok.bos_id
    expected = np.concatenate([[*tok.encode(d), tok.eos_id] for d in docs])
    batches = list(make_eval())
    inputs, targets, weights = (np.concatenate([b[k] for b in batches])
                                for k in ("inputs", "targets", "weights"))
    assert np.all(inputs[:, 0] == bos)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    # Each window holds the next 16 stream tokens after its BOS: nothing lost or repeated.
    np.testing.assert_array_equal(targets[weights > 0], expected)
    flat = weights.ravel()  # Only the tail is padding (the last window, then padding windows).
    assert flat[:len(expected)].all() and not flat[len(expected):].any()
    # Training windows (shuffled documents) too, and resume stays exact.
    for b in _take(train, 12):
        assert np.all(b["inputs"][:, 0] == bos)
    _check_resume(cfg, n_total=12, points=(0, 5), seq_len=16, batch=4)


def test_every_copy_of_a_held_out_document_is_held_out(tmp_path):
    """The held-out split promised "duplicates of a held-out document are held out too", but took
    the first n documents of the CRC32 order, so a cut inside a run of copies trained on some of
    them (issue #67). Ten distinct paragraphs, the one of smallest CRC32 three times: 10% holds
    out one distinct document, with all three copies, and none of them trains."""
    import zlib  # pylint: disable=g-import-not-at-top

    distinct = [f"Paragraph {i} about x{'y' * i}" for i in range(10)]
    first = min(distinct, key=lambda d: zlib.crc32(d.encode("utf-8")))
    docs = distinct + [first, first]
    path = tmp_path / "dup.txt"
    path.write_text("\n\n".join(docs) + "\n")
    train, held = documents.text_file_splits(_config(paths=[str(path)], doc_split="paragraphs", eval_fraction=0.1))
    train_docs, held_docs = list(train.texts()), list(held.texts())
    assert held_docs == [first] * 3
    assert first not in train_docs and sorted(train_docs) == sorted(set(distinct) - {first})
    # Distinct documents only are counted: copies of the only other document leave nothing to train.
    with pytest.raises(ValueError, match=r"only 1 document of distinct content \(3 with 2 duplicates\)"):
        documents._hold_out(["a", "a", "a"], ["a", "a", "a"], 0.1)  # pylint: disable=protected-access


@pytest.mark.parametrize("eval_text, batches, says", [
    ("Held out.", 2, r"fills less than one window \(16 tokens\): eval_loss / eval_ppl are over (\d+) tokens"),
    ("Held-out text, a bit longer.", 4,
     r"fills 2 of the 16 windows asked for \(data.num_eval_batches=4 x 4 per host\): eval_loss / eval_ppl are over (\d+) tokens"),
])
def test_a_tiny_held_out_split_warns_and_counts_its_tokens(tmp_path, paragraphs_file, eval_text, batches, says):
    """A held-out split far smaller than the eval asks for was reported as an ordinary eval_ppl
    (issue #67): it warns, naming the tokens scored, which are exactly what the weights count."""
    held = tmp_path / "held.txt"
    held.write_text(eval_text)
    cfg = _config(paths=[paragraphs_file[0]], doc_split="paragraphs", eval_paths=[str(held)],
                  num_eval_batches=batches)
    _, make_eval, _ = _make(cfg)
    with pytest.warns(UserWarning, match=says) as caught:
        batches_out = list(make_eval())
    assert len(batches_out) == batches
    scored = sum(float(b["weights"].sum()) for b in batches_out)
    import re  # pylint: disable=g-import-not-at-top
    quoted = [int(m.group(1)) for w in caught if (m := re.search(says, str(w.message)))]
    assert quoted == [scored]
    with warnings.catch_warnings():  # a split that fills what is asked says nothing
        warnings.simplefilter("error")
        list(_make(_config(paths=[paragraphs_file[0]], doc_split="paragraphs", eval_paths=[paragraphs_file[0]],
                           num_eval_batches=1))[1]())
