"""Document-aware packing (``data.packing='documents'``, goat_jax/data/packing.py): every token
in exactly the expected pieces, per-document positions, contiguous segment ids, weight-0
padding, exact resume mid-round, host split, and the errors."""

import collections
import json

import numpy as np
import pytest

from goat_jax.data import packing
from goat_jax.data import text as text_lib
from goat_jax.data import tokenizers

BYTES = tokenizers.ByteTokenizer()
SEQ_LEN = 24


@pytest.fixture
def corpus(tmp_path, rng):
    """30 paragraph documents of 3 to ~80 bytes (several longer than SEQ_LEN)."""
    words = ["ab", "cde", "fghij", "k", "lmnopq"]
    docs = [f"d{i} " + " ".join(rng.choice(words, size=int(rng.integers(0, 14))))
            for i in range(30)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return str(path), [d.strip() for d in docs]


def _config(path, **overrides):
    cfg = text_lib.default_data_config()
    cfg.update(paths=[path], eval_paths=[path], doc_split="paragraphs", packing="documents",
               read_threads=1, num_eval_batches=-1)
    cfg.update(overrides)
    return cfg


def _make(cfg, batch=4, seed=0, process_index=0, process_count=1):
    return text_lib.make_lm_datasets(cfg, seq_len=SEQ_LEN, global_batch_size=batch, seed=seed,
                                     process_index=process_index, process_count=process_count)


def _expected_pieces(docs, seq_len=SEQ_LEN):
    """Pieces written from the spec: [BOS, bytes, EOS] cut at seq_len + 1 tokens, overlapping by
    one token; as a multiset of token tuples."""
    pieces = collections.Counter()
    for d in docs:
        toks = [BYTES.bos_id, *BYTES.encode(d), BYTES.eos_id]
        for a in range(0, len(toks) - 1, seq_len):
            pieces[tuple(toks[a:a + seq_len + 1])] += 1
    return pieces


def _check_rows_and_collect(batches):
    """Checks the layout of every row; returns the multiset of its pieces (inputs + last target)."""
    pieces = collections.Counter()
    for b in batches:
        assert set(b) == {"inputs", "targets", "weights", "segment_ids", "positions"}
        for row in range(len(b["inputs"])):
            seg, pos, w = b["segment_ids"][row], b["positions"][row], b["weights"][row]
            pad = seg == packing.PAD_SEGMENT_ID
            assert np.all(np.diff(seg.astype(np.int64)) >= 0), "segment ids must not decrease"
            real_ids = np.unique(seg[~pad])
            np.testing.assert_array_equal(real_ids, np.arange(1, len(real_ids) + 1))
            np.testing.assert_array_equal(w, (~pad).astype(np.float32))  # padding weight 0
            assert np.all(b["inputs"][row][pad] == BYTES.pad_id)
            # Positions restart at 0 at every segment start and count up by one inside it.
            starts = np.r_[True, seg[1:] != seg[:-1]]
            np.testing.assert_array_equal(pos[starts], 0)
            np.testing.assert_array_equal(pos[~starts], pos[np.flatnonzero(~starts) - 1] + 1)
            for s in real_ids:
                at = seg == s
                # Inside a piece the targets are the inputs shifted by one (no boundary crossed).
                np.testing.assert_array_equal(b["inputs"][row][at][1:], b["targets"][row][at][:-1])
                pieces[tuple(b["inputs"][row][at]) + (int(b["targets"][row][at][-1]),)] += 1
    return pieces


def test_every_token_lands_in_exactly_the_expected_pieces(corpus):
    path, docs = corpus
    _, make_eval, _ = _make(_config(path))
    batches = list(make_eval())
    assert any(len(BYTES.encode(d)) + 2 > SEQ_LEN + 1 for d in docs)  # splitting is exercised
    assert _check_rows_and_collect(batches) == _expected_pieces(docs)
    # Packing is dense: all windows but the last round's are mostly full.
    fill = np.mean([b["weights"].mean() for b in batches[:-1]])
    assert fill > 0.8, fill


def test_training_resumes_exactly_mid_round_and_state_is_json(corpus):
    path, _ = corpus
    cfg = _config(path)
    train, _, _ = _make(cfg, seed=3)
    # 16 windows per round = 4 batches of 4: stop inside the second round, past the epoch end.
    for _ in range(6):
        next(train)
    state = json.loads(json.dumps(train.get_state()))
    want = [next(train) for _ in range(7)]
    resumed, _, _ = _make(cfg, seed=3)
    resumed.set_state(state)
    got = [next(resumed) for _ in range(7)]
    for a, b in zip(want, got):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    _check_rows_and_collect(want)


def test_two_hosts_pack_disjoint_documents_that_cover_the_split(corpus):
    path, docs = corpus
    cfg = _config(path, num_eval_batches=40)  # more than either host needs: the rest is padding
    per_host = []
    for index in range(2):
        _, make_eval, _ = _make(cfg, batch=4, process_index=index, process_count=2)
        batches = list(make_eval())
        assert all(len(b["inputs"]) == 2 for b in batches)  # local batch = 4 / 2
        per_host.append(_check_rows_and_collect(batches))
    assert per_host[0] + per_host[1] == _expected_pieces(docs)
    # Disjoint documents: the "d<i>" heads of the first pieces (continuations may coincide).
    heads = [{BYTES.decode(list(p[1:])).split(" ")[0] for p in host if p[0] == BYTES.bos_id}
             for host in per_host]
    assert heads[0] and heads[1] and not heads[0] & heads[1]


def test_concat_stays_the_default_with_its_batch_format(corpus):
    path, _ = corpus
    assert text_lib.default_data_config().packing == "concat"
    train, _, _ = _make(_config(path, packing="concat"))
    assert set(next(train)) == {"inputs", "targets", "weights"}


@pytest.mark.parametrize("overrides, match", [
    (dict(packing="docs"), r"data.packing='docs' is not allowed: allowed is one of \['concat', 'documents'\]"),
    (dict(bos_windows=True), "data.bos_windows=True"),
])
def test_bad_packing_config_names_the_field(corpus, overrides, match):
    with pytest.raises(ValueError, match=match):
        _make(_config(corpus[0], **overrides))


def test_pieces_of_a_long_document_restart_positions():
    # A 60-token document, seq_len 24: pieces [0:25), [24:49), [48:60) of the token array.
    tokens = np.arange(100, 160, dtype=np.int32)
    ds = packing.pack_documents(_ListIterDataset([tokens]), seq_len=SEQ_LEN, pad_id=0, num_bins=3)
    rows = list(ds)
    assert len(rows) == 3
    for row, start in zip(rows, (0, 24, 48)):
        n = int(row["weights"].sum())
        np.testing.assert_array_equal(row["inputs"][:n], tokens[start:start + n])
        np.testing.assert_array_equal(row["targets"][:n], tokens[start + 1:start + n + 1])
        np.testing.assert_array_equal(row["positions"][:n], np.arange(n))
    assert [int(r["weights"].sum()) for r in rows] == [24, 24, 11]


class _ListIterDataset(text_lib.grain.IterDataset):
    """A finite IterDataset over a list (grain's MapDataset.source would do, minus threads)."""

    def __init__(self, items):
        super().__init__()
        self._items = items

    def __iter__(self):
        return iter(text_lib.grain.MapDataset.source(self._items).to_iter_dataset())


def test_lm_task_accepts_documents_and_feeds_their_fields_to_the_model():
    from goat_jax.tasks import lm as lm_task
    from tests import config_helpers

    lm_task.validate(config_helpers.lm_smoke_config())  # 'concat' passes
    lm_task.validate(config_helpers.lm_smoke_config(**{"data.packing": "documents"}))
    batch = {"inputs": 0, "segment_ids": 1, "positions": 2}
    assert lm_task.document_inputs(batch) == {"segment_ids": 1, "positions": 2}
    assert lm_task.document_inputs({"inputs": 0}) == {}


def test_segment_positions_reproduce_the_packers_positions(corpus, rng):
    import jax.numpy as jnp

    from goat_jax.prior import segments

    _, make_eval, _ = _make(_config(corpus[0]))
    for b in make_eval():
        np.testing.assert_array_equal(np.asarray(segments.segment_positions(b["segment_ids"])),
                                      b["positions"])
    # Any ids (runs may repeat an id): a loop written from the definition.
    ids = rng.integers(0, 3, size=(3, 40)).astype(np.int32)
    want = np.zeros_like(ids)
    for r in range(3):
        for i in range(1, 40):
            want[r, i] = 0 if ids[r, i] != ids[r, i - 1] else want[r, i - 1] + 1
    np.testing.assert_array_equal(np.asarray(segments.segment_positions(jnp.asarray(ids))), want)
    with pytest.raises(ValueError, match="segment_ids must be integer ids"):
        segments.segment_positions(jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"segment_ids must be \[B, T\]"):
        segments.segment_positions(jnp.zeros((4,), jnp.int32))


def _runs(row_ids):
    return int(1 + np.count_nonzero(row_ids[1:] != row_ids[:-1]))


def _packed(cfg, batch=4, seq_len=SEQ_LEN, max_documents=None):
    train, make_eval, _ = text_lib.make_lm_datasets(cfg, seq_len=seq_len, global_batch_size=batch, seed=0,
                                                    process_index=0, process_count=1, max_documents=max_documents)
    return train, list(make_eval())


@pytest.mark.parametrize("bound", [2, 3])
def test_the_document_bound_starts_a_new_row_instead_of_stopping_the_run(corpus, bound):
    """With cuDNN's bound (model.max_documents_per_row) the packers used to raise at the first
    window over it, mid-run (issue 53, item 1): now a window that reaches the bound is closed,
    in training and in evaluation, and every token still lands in exactly its pieces."""
    path, docs = corpus
    cfg = _config(path)
    _, unbounded = _packed(cfg, seq_len=64)
    assert max(_runs(r) for b in unbounded for r in b["segment_ids"]) > bound  # the bound matters here
    train, evaluation = _packed(cfg, seq_len=64, max_documents=bound)
    train_rows = [r for _ in range(30) for r in next(train)["segment_ids"]]
    assert max(_runs(r) for r in train_rows + [r for b in evaluation for r in b["segment_ids"]]) <= bound
    assert _check_rows_and_collect(evaluation) == _expected_pieces(docs, 64)


def test_a_document_bound_below_2_is_refused_before_any_window(corpus):
    """The padding counts as one document in cuDNN's layout: a bound of 1 cannot hold a document
    and its padding, so it is refused when the pipeline is built, naming the field."""
    path, _ = corpus
    with pytest.raises(ValueError, match=r"model.max_documents_per_row=1: .* at least 2"):
        _packed(_config(path), max_documents=1)
