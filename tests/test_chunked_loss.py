"""The LM's loss without the full float32 logits (``model.loss_chunk_size``,
goat_jax/losses.py), the vocabulary padded to a multiple (``model.vocab_pad_multiple``)
and the remat policies (``model.remat_policy``).

Checked: the chunked loss's value and its gradients for the hidden states and the output
weights against a float64 NumPy reference (chunk sizes that divide the length, that do not, and
longer than it; loss weights with zeros; padded vocabulary columns); the LM's loss chunked and
not chunked through tied and untied output embeddings (value and every parameter's gradient);
a padded vocabulary whose padded rows would dominate the softmax leaves the loss, the logits and
greedy sampling untouched; a padded model (tied or untied) starts with the unpadded model's
parameters where they overlap, as a larger 'learned' position table does; every remat policy
computes the same loss and gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import jitted
from tests.marks import SLOW_CASE

from goat_jax.models import LMConfig, TransformerLM
from goat_jax.models import sampling
from goat_jax.losses import chunked_cross_entropy

TINY = dict(vocab_size=37, num_layers=2, embed_dim=32, num_heads=2, mlp_dim=64, pos_rank=2, abs_rank=2,
            training_seq_len=16)


def reference_loss_and_grads(h, w, targets, weights, vocab):
    """Float64: ``sum_i w_i CE_i`` of ``h @ w[:, :vocab]`` and its gradients for h and w."""
    h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
    flat_h = h.reshape(-1, h.shape[-1])
    logits = flat_h @ w[:, :vocab]
    m = logits.max(-1, keepdims=True)
    p = np.exp(logits - m)
    lse = np.log(p.sum(-1)) + m[:, 0]
    t, wt = np.asarray(targets).reshape(-1), np.asarray(weights, np.float64).reshape(-1)
    loss = np.sum((lse - logits[np.arange(len(t)), t]) * wt)
    dlogits = p / p.sum(-1, keepdims=True)
    dlogits[np.arange(len(t)), t] -= 1.0
    dlogits *= wt[:, None]
    dh = (dlogits @ w[:, :vocab].T).reshape(h.shape)
    dw = np.zeros_like(w)
    dw[:, :vocab] = flat_h.T @ dlogits
    return loss, dh, dw


def assert_rel(actual, expected, rel=2e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(np.abs(expected).max(), 1e-30)
    assert np.abs(actual - expected).max() <= rel * scale, (np.abs(actual - expected).max(), scale)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("vocab, padded", [(11, 11), (11, 16)])
def test_chunked_loss_and_gradients_equal_the_float64_reference(rng, chunk, vocab, padded):
    b, t, e = 2, 7, 5
    h = rng.normal(size=(b, t, e)).astype(np.float32)
    w = rng.normal(size=(e, padded)).astype(np.float32)
    if padded > vocab:
        w[:, vocab:] = 50.0  # padded columns that would dominate any softmax they entered
    targets = rng.integers(0, vocab, (b, t)).astype(np.int32)
    weights = (rng.random((b, t)) > 0.3).astype(np.float32)  # padding positions have weight 0
    weights[0, 0] = 1.0

    def loss(h_, w_):
        return chunked_cross_entropy(h_, w_, jnp.asarray(targets), jnp.asarray(weights), chunk_size=chunk,
                                     vocab_size=vocab)

    (value, weight_sum), (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(jnp.asarray(h), jnp.asarray(w))
    want, want_dh, want_dw = reference_loss_and_grads(h, w, targets, weights, vocab)
    assert_rel(value, want)
    assert float(weight_sum) == weights.sum()
    assert_rel(dh, want_dh)
    assert_rel(dw, want_dw)
    assert np.all(np.asarray(dw)[:, vocab:] == 0.0)  # the padded columns take no gradient


def test_chunked_loss_refuses_a_bad_chunk_or_vocabulary():
    h, w = jnp.zeros((1, 4, 3)), jnp.zeros((3, 8))
    t, wt = jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4))
    with pytest.raises(ValueError, match="loss_chunk_size"):
        chunked_cross_entropy(h, w, t, wt, chunk_size=0)
    with pytest.raises(ValueError, match="vocab_size=9"):
        chunked_cross_entropy(h, w, t, wt, chunk_size=2, vocab_size=9)


def assert_trees_rel(actual, expected, rel):
    """Every leaf within ``rel`` of the largest gradient of the whole tree (a leaf whose own
    gradient is ~0, e.g. a prior parameter at init, is compared at the tree's scale)."""
    flat = lambda tree: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(tree)])
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    assert_rel(flat(actual), flat(expected), rel)


def _params(model, toks, seed=0):
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), toks)["params"]
    rng = np.random.default_rng(seed)
    import flax.linen as nn  # pylint: disable=g-import-not-at-top
    shapes = nn.unbox(shapes)

    def fill(path, x):
        is_scale = jax.tree_util.keystr(path).endswith("['scale']")
        noise = rng.normal(0.0, 0.2, x.shape)
        return jnp.asarray(1.0 + noise if is_scale else noise, x.dtype)
    return jax.tree_util.tree_map_with_path(fill, shapes)


def _loss_and_grads(cfg, params, toks, targets, weights):
    model = TransformerLM(cfg)

    def loss(p):
        return model.apply({"params": p}, toks, targets, weights, method="token_loss")
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


@pytest.mark.parametrize("tie", [True, pytest.param(False, marks=SLOW_CASE)])
def test_lm_loss_chunked_equals_full_logits_tied_and_untied(tie):
    cfg = LMConfig(**TINY, tie_embeddings=tie)
    toks = jax.random.randint(jax.random.PRNGKey(1), (2, 10), 0, cfg.vocab_size, jnp.int32)
    targets = jnp.roll(toks, -1, axis=1)
    weights = jnp.ones((2, 10)).at[1, -3:].set(0.0)
    params = _params(TransformerLM(cfg), toks)
    (full, wsum), g_full = _loss_and_grads(cfg, params, toks, targets, weights)
    (chunked, wsum2), g_chunked = _loss_and_grads(dataclasses.replace(cfg, loss_chunk_size=3), params, toks,
                                                  targets, weights)
    assert float(wsum) == float(wsum2) == 17.0
    assert_rel(chunked, full, 1e-5)
    assert_trees_rel(g_chunked, g_full, 1e-5)
    # ... and both are the float64 reference of the model's own hidden states and output weights.
    hidden, w = jitted.apply(TransformerLM(cfg), {"params": params}, toks, return_hidden=True)
    want, _, _ = reference_loss_and_grads(hidden, w, targets, weights, cfg.vocab_size)
    assert_rel(full, want, 1e-5)


def test_padded_vocabulary_never_reaches_the_loss_logits_or_sampling():
    cfg = LMConfig(**TINY, vocab_pad_multiple=8)  # 37 -> 40 rows
    assert cfg.padded_vocab_size == 40
    model = TransformerLM(cfg)
    toks = jax.random.randint(jax.random.PRNGKey(2), (2, 6), 0, cfg.vocab_size, jnp.int32)
    params = _params(model, toks)
    assert params["embed"]["embedding"].shape == (40, cfg.embed_dim)
    # Padded rows aligned with the hidden states: their logits would win every softmax and argmax.
    hidden, _ = jitted.apply(model, {"params": params}, toks, return_hidden=True)
    direction = jnp.mean(hidden.reshape(-1, cfg.embed_dim), axis=0)
    params["embed"]["embedding"] = params["embed"]["embedding"].at[37:].set(1e3 * direction)
    logits = jitted.apply(model, {"params": params}, toks)
    assert logits.shape == (2, 6, cfg.vocab_size)
    targets, weights = jnp.roll(toks, -1, axis=1), jnp.ones((2, 6))
    hidden, w = jitted.apply(model, {"params": params}, toks, return_hidden=True)
    assert w.shape == (cfg.embed_dim, 40)
    want, _, _ = reference_loss_and_grads(hidden, w, targets, weights, cfg.vocab_size)
    for chunk in (None, 4):
        got, _ = jitted.apply(TransformerLM(dataclasses.replace(cfg, loss_chunk_size=chunk)),
                              {"params": params}, toks, targets, weights, method="token_loss")
        assert_rel(got, want, 1e-5)
    out = sampling.generate(model, params, toks[:, :2], 4, use_cache=False)
    assert int(out.max()) < cfg.vocab_size


@pytest.mark.slow(reason="18 s on 2 cores (compiles the LM's loss and gradients once per remat policy); "
                         "the policies change what is recomputed, not the function")
def test_remat_policies_compute_the_same_loss_and_gradients():
    cfg = LMConfig(**TINY, scan_layers=True)
    toks = jax.random.randint(jax.random.PRNGKey(3), (2, 8), 0, cfg.vocab_size, jnp.int32)
    targets, weights = jnp.roll(toks, -1, axis=1), jnp.ones((2, 8))
    params = _params(TransformerLM(cfg), toks)
    (base, _), g_base = _loss_and_grads(cfg, params, toks, targets, weights)
    for policy in ("full", "dots", "dots_no_batch"):
        (value, _), grads = _loss_and_grads(dataclasses.replace(cfg, remat=True, remat_policy=policy), params,
                                            toks, targets, weights)
        assert_rel(value, base, 1e-6)
        assert_trees_rel(grads, g_base, 1e-5)
    with pytest.raises(ValueError, match="remat_policy"):
        LMConfig(**TINY, remat_policy="everything")


def test_dna_task_refuses_the_chunked_loss_it_would_ignore():
    from configs import dna_tiny  # pylint: disable=g-import-not-at-top  # ml_collections
    from goat_jax.train import tasks  # pylint: disable=g-import-not-at-top

    config = dna_tiny.get_config()
    tasks.get_task("dna").validate(config)
    config.model.loss_chunk_size = 4
    with pytest.raises(ValueError, match="model.loss_chunk_size=4: the DNA task"):
        tasks.get_task("dna").validate(config)


@pytest.mark.parametrize("tied", [True, False])
def test_padded_vocabulary_starts_as_the_unpadded_model(tied):
    """``vocab_pad_multiple`` is a speed setting: the padded model's initial parameters equal the
    unpadded model's where they overlap (the real rows of a tied table, the real columns of an
    untied ``lm_head``), and every other parameter is identical. The untied ``lm_head [E, Vp]``
    was drawn anew at its padded shape, which changed every value (issue #67); its padding
    columns now start at 0, so the first step's logits and loss are the unpadded model's."""
    import flax  # pylint: disable=g-import-not-at-top

    fields = dict(TINY, tie_embeddings=tied)
    plain, padded = LMConfig(**fields), LMConfig(**fields, vocab_pad_multiple=16)  # 37 -> 48
    toks = jax.random.randint(jax.random.PRNGKey(4), (2, 6), 0, plain.vocab_size, jnp.int32)
    a = flax.core.meta.unbox(jitted.init(TransformerLM(plain), jax.random.PRNGKey(7), toks))["params"]
    b = flax.core.meta.unbox(jitted.init(TransformerLM(padded), jax.random.PRNGKey(7), toks))["params"]
    flat_a, flat_b = (dict(jax.tree_util.tree_flatten_with_path(p)[0]) for p in (a, b))
    assert flat_a.keys() == flat_b.keys()
    v = plain.vocab_size
    for path, x in flat_a.items():
        y = flat_b[path]
        name = jax.tree_util.keystr(path)
        if "lm_head" in name:
            assert y.shape == (plain.embed_dim, 48)
            np.testing.assert_array_equal(y[:, :v], x, err_msg=name)
            np.testing.assert_array_equal(y[:, v:], 0)
        elif "embedding" in name and "embed" in name:
            assert y.shape == (48, plain.embed_dim)
            np.testing.assert_array_equal(y[:v], x, err_msg=name)
        else:
            np.testing.assert_array_equal(y, x, err_msg=name)
    np.testing.assert_array_equal(jitted.apply(TransformerLM(padded), {"params": b}, toks),
                                  jitted.apply(TransformerLM(plain), {"params": a}, toks))


def test_a_larger_position_table_starts_as_the_smaller_one():
    """The other resized parameter of the LM (``model.max_len``, the 'learned' table [max_len, E],
    padded along its rows): its first rows are the smaller table's draws (issue #67's sweep)."""
    from goat_jax.positional import LearnedPositionEmbedding  # pylint: disable=g-import-not-at-top

    pos = jnp.arange(8)[None]
    import flax  # pylint: disable=g-import-not-at-top

    small, large = (flax.core.meta.unbox(LearnedPositionEmbedding(max_len=n, features=16).init(jax.random.PRNGKey(3), pos))
                    for n in (32, 80))
    np.testing.assert_array_equal(large["params"]["embedding"][:32], small["params"]["embedding"])
