"""Tests for goat_jax.data.synthetic: exact lengths, needles where they are said to be, scored
spans, determinism and resumable iterators. Pure numpy, sub-second."""

import json

import numpy as np
import pytest

from goat_jax.data import synthetic
from goat_jax.data.tokenizers import BOS_ID, ByteTokenizer

TOK = ByteTokenizer()
LETTERS = {ord(c) + 3 for c in "abcdefghijklmnopqrstuvwxyz"}


def window(batch, b):
    """The full window (seq_len + 1 tokens) of example b."""
    return np.concatenate([batch["inputs"][b], batch["targets"][b, -1:]])


def assert_batch_format(batch, b, seq_len):
    assert batch["inputs"].shape == batch["targets"].shape == batch["weights"].shape == (b, seq_len)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    assert batch["weights"].dtype == np.float32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])


# ----------------------------------------------------------------------------------------------
# Passkey (synthetic)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len, depth", [(64, 0.0), (64, 1.0), (100, 0.37), (257, None)])
def test_passkey_needle_position_length_and_scored_span(rng, seq_len, depth):
    key_len = 8
    batch, meta = synthetic.passkey_batch(rng, 4, seq_len, depth=depth)
    assert_batch_format(batch, 4, seq_len)
    needle_len = len(synthetic.PASSKEY_NEEDLE.format(key="0" * key_len))
    n_filler = seq_len - needle_len - len(synthetic.PASSKEY_QUERY) - key_len
    for b in range(4):
        w = window(batch, b)
        key = "".join(map(str, meta["key"][b]))
        assert w[0] == BOS_ID and len(w) == seq_len + 1
        start = meta["needle_start"][b]
        assert start - 1 == round(meta["depth"][b] * n_filler)
        assert TOK.decode(w[start:start + needle_len]) == synthetic.PASSKEY_NEEDLE.format(key=key)
        assert TOK.decode(w[meta["key_start"][b]:meta["key_start"][b] + key_len]) == key
        filler = np.concatenate([w[1:start], w[start + needle_len:-len(synthetic.PASSKEY_QUERY) - key_len]])
        assert len(filler) == n_filler and set(filler.tolist()) <= LETTERS
        assert TOK.decode(w[-len(synthetic.PASSKEY_QUERY) - key_len:]) == synthetic.PASSKEY_QUERY + key
        # Scored: exactly the key digits after the query.
        scored = np.flatnonzero(batch["weights"][b])
        np.testing.assert_array_equal(scored, np.arange(seq_len - key_len, seq_len))
        assert scored[0] == meta["answer_start"][b]
        assert TOK.decode(batch["targets"][b, scored]) == key
        if depth is not None:
            assert meta["depth"][b] == depth


def test_passkey_too_short_and_bad_depth_raise(rng):
    with pytest.raises(ValueError, match="too short"):
        synthetic.passkey_batch(rng, 1, 20)
    with pytest.raises(ValueError, match="depth"):
        synthetic.passkey_batch(rng, 1, 64, depth=1.5)


# ----------------------------------------------------------------------------------------------
# NIAH
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len, depth", [(48, 0.0), (128, 0.5), (200, 1.0), (96, None)])
def test_niah_needle_position_length_and_scored_span(rng, seq_len, depth):
    batch, meta = synthetic.niah_batch(rng, 3, seq_len, depth=depth, key_len=5, value_len=6)
    assert_batch_format(batch, 3, seq_len)
    for b in range(3):
        w = window(batch, b)
        key, value = TOK.decode(meta["key"][b]), "".join(map(str, meta["value"][b]))
        needle = synthetic.NIAH_NEEDLE.format(key=key, value=value)
        question = synthetic.NIAH_QUESTION.format(key=key)
        n_hay = seq_len - len(needle) - len(question) - len(value)
        start = meta["needle_start"][b]
        assert w[0] == BOS_ID and start - 1 == round(meta["depth"][b] * n_hay)
        assert TOK.decode(w[start:start + len(needle)]) == needle
        assert TOK.decode(w[-len(question) - len(value):]) == question + value
        hay = TOK.decode(np.concatenate([w[1:start], w[start + len(needle):-len(question) - len(value)]]))
        assert len(hay) == n_hay and set(hay) <= set("abcdefghijklmnopqrstuvwxyz ")
        np.testing.assert_array_equal(np.flatnonzero(batch["weights"][b]),
                                      np.arange(seq_len - 6, seq_len))
        assert TOK.decode(batch["targets"][b, -6:]) == value


# ----------------------------------------------------------------------------------------------
# Passkey (standard prompt)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [300, 301, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_prompt_exact_length_and_needle(length, depth):
    p = synthetic.passkey_prompt(length, depth, 31337)
    assert p.tokens.shape == (length,) and p.tokens.dtype == np.int32 and p.tokens[0] == BOS_ID
    info = synthetic.PASSKEY_INFO.format(key=31337)
    assert TOK.decode(p.tokens[p.needle_start:p.needle_start + p.needle_len]) == info
    text = TOK.decode(p.tokens)
    assert text.startswith(synthetic.PASSKEY_TASK + "\n")
    assert text.endswith("\n" + synthetic.PASSKEY_QUESTION)
    head = 1 + len(synthetic.PASSKEY_TASK) + 1
    n_filler = length - head - 2 - len(info) - 1 - len(synthetic.PASSKEY_QUESTION)
    assert p.needle_start - head - 1 == round(depth * n_filler)
    assert text.count(info) == 1 and p.answer == 31337


def test_passkey_prompts_deterministic_keys_in_range():
    a = synthetic.passkey_prompts(np.random.default_rng(3), 5, 400)
    b = synthetic.passkey_prompts(np.random.default_rng(3), 5, 400)
    assert [p.answer for p in a] == [p.answer for p in b]
    assert all(1 <= p.answer <= 50000 and len(p.tokens) == 400 for p in a)
    with pytest.raises(ValueError, match="too short"):
        synthetic.passkey_prompt(100, 0.5, 1)


# ----------------------------------------------------------------------------------------------
# Copy mixture
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_copy_mixture_rules(rng, lag):
    batch, meta = synthetic.copy_mixture_batch(rng, 64, 40, vocab_size=8, p_first=0.3,
                                               p_prev=0.4, lag=lag)
    assert_batch_format(batch, 64, 40)
    x, y, src = batch["inputs"], batch["targets"], meta["source"]
    assert x.min() >= 0 and x.max() < 8 and np.all(batch["weights"] == 1)
    first = src == 1
    np.testing.assert_array_equal(y[first], np.broadcast_to(x[:, :1], y.shape)[first])
    lagged = (src == 2)
    assert not lagged[:, :lag].any()  # no source before position lag
    rows, cols = np.nonzero(lagged)
    np.testing.assert_array_equal(y[rows, cols], x[rows, cols - lag])
    freq = np.bincount(src[:, lag:].ravel(), minlength=3) / src[:, lag:].size
    np.testing.assert_allclose(freq, [0.3, 0.3, 0.4], atol=0.04)


def test_copy_mixture_entropy_limits():
    # All noise: log V; pure first-token copy: 0.
    entropy = lambda p_first, p_prev: synthetic.copy_mixture_entropy(
        16, vocab_size=8, p_first=p_first, p_prev=p_prev)
    assert entropy(0.0, 0.0) == pytest.approx(np.log(8))
    assert entropy(1.0, 0.0) == pytest.approx(0.0, abs=1e-12)
    h = synthetic.copy_mixture_entropy(64)
    assert 0 < h < np.log(16)


# ----------------------------------------------------------------------------------------------
# Iterators
# ----------------------------------------------------------------------------------------------


def batches_equal(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", synthetic.KINDS)
def test_iterator_determinism_resume_and_streams(kind):
    cfg = synthetic.default_synthetic_config(kind)
    make = lambda **kw: synthetic.make_synthetic_datasets(cfg, seq_len=64, global_batch_size=4,
                                                          seed=7, **kw)
    train, make_eval, tok = make()
    first = [next(train) for _ in range(3)]
    state = train.get_state()
    assert json.loads(json.dumps(state)) == state == {"step": 3}
    rest = [next(train) for _ in range(2)]
    resumed, _, _ = make()
    resumed.set_state(json.loads(json.dumps(state)))
    assert all(batches_equal(a, b) for a, b in zip(rest, [next(resumed) for _ in range(2)]))
    again, _, _ = make()
    assert batches_equal(first[0], next(again))  # same seed, same data
    assert set(first[0]) == {"inputs", "targets", "weights"}
    other_host, _, _ = synthetic.make_synthetic_datasets(cfg, seq_len=64, global_batch_size=4,
                                                         seed=7, process_index=1, process_count=2)
    assert next(other_host)["inputs"].shape == (2, 64)
    evals = list(make_eval())
    assert len(evals) == cfg.num_eval_batches and batches_equal(evals[0], next(make_eval()))
    assert not np.array_equal(evals[0]["inputs"], first[0]["inputs"])  # disjoint streams
    assert tok.vocab_size == (16 if kind == "copy_mixture" else 259)


def test_process_streams_differ():
    make = lambda r: synthetic.passkey_batch(r, 2, 64)
    a = next(synthetic.SyntheticIterator(make, 0, process_index=0))
    b = next(synthetic.SyntheticIterator(make, 0, process_index=1))
    assert not np.array_equal(a["inputs"], b["inputs"])
    with_meta = next(synthetic.SyntheticIterator(make, 0, with_meta=True))
    assert {"needle_start", "key", "depth"} <= set(with_meta)
    with pytest.raises(ValueError, match="kind"):
        synthetic.make_batch_fn(synthetic.default_synthetic_config("bogus"), 1, 8)
