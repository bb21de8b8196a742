"""Tests for goat_jax.models.sampling: the KV-cache path equals full recomputation."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax.models import LMConfig, TransformerLM
from goat_jax.models.sampling import generate, sample_logits

CFG = LMConfig(vocab_size=259, num_layers=2, embed_dim=64, num_heads=4, kv_num_heads=2,
               mlp_dim=128, pos_rank=2, abs_rank=2, training_seq_len=32)


@pytest.fixture(scope="module")
def lm():
    model = TransformerLM(CFG)
    prompt = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, CFG.vocab_size, jnp.int32)
    # Random params (numpy-filled: no init compile); larger than the init scale so the greedy
    # and sampled continuations are not dominated by ties.
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), prompt))["params"]
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.normal(0.0, 0.1, x.shape), x.dtype), shapes)
    return model, params, prompt


@pytest.mark.parametrize("kwargs", [dict(), dict(temperature=1.0, top_k=20)])
def test_cache_equals_recompute(lm, kwargs):
    model, params, prompt = lm
    rng = jax.random.PRNGKey(7)
    cached = generate(model, params, prompt, 6, rng, use_cache=True, **kwargs)
    recomputed = generate(model, {"params": params}, prompt, 6, rng, use_cache=False, **kwargs)
    assert cached.shape == (2, 11) and cached.dtype == jnp.int32
    np.testing.assert_array_equal(cached[:, :5], prompt)
    np.testing.assert_array_equal(cached, recomputed)


def test_greedy_continues_argmax(lm):
    model, params, prompt = lm
    out = generate(model, params, prompt, 1)
    logits = jax.jit(model.apply)({"params": params}, prompt)
    np.testing.assert_array_equal(out[:, -1], jnp.argmax(logits[:, -1], -1))
    np.testing.assert_array_equal(generate(model, params, prompt, 0), prompt)


def test_sample_logits_top_k_and_greedy():
    logits = jnp.array([[0.0, 3.0, 1.0, 2.0]] * 64)
    rng = jax.random.PRNGKey(0)
    assert set(np.asarray(sample_logits(logits, rng, 1.0, False, 2))) == {1, 3}
    np.testing.assert_array_equal(sample_logits(logits, rng, 5.0, False, 1), 1)
    np.testing.assert_array_equal(sample_logits(logits, None, 1.0, True, None), 1)


@pytest.mark.parametrize("args, kwargs, match", [
    ((jnp.zeros((2,), jnp.int32), 3), {}, "batch, length"),
    ((jnp.zeros((2, 3), jnp.float32), 3), {}, "integer"),
    ((jnp.zeros((2, 0), jnp.int32), 3), {}, "at least one"),
    ((jnp.zeros((2, 3), jnp.int32), -1), {}, "max_new_tokens"),
    ((jnp.zeros((2, 3), jnp.int32), 3), dict(temperature=-1.0), "temperature"),
    ((jnp.zeros((2, 3), jnp.int32), 3), dict(temperature=1.0), "rng"),
    ((jnp.zeros((2, 3), jnp.int32), 3, jax.random.PRNGKey(0)), dict(temperature=1.0, top_k=0), "top_k"),
    ((jnp.zeros((2, 3), jnp.int32), 3, jax.random.PRNGKey(0)), dict(temperature=1.0, top_k=1000), "vocabulary"),
    ((jnp.zeros((2, 3), jnp.int32), 3), dict(prefill_multiple=0), "prefill_multiple must be"),
    ((jnp.zeros((2, 3), jnp.int32), 3), dict(prefill_multiple=4, use_cache=False), "KV-cache path"),
    ((jnp.zeros((2, 3), jnp.int32), 3), dict(cache_length=16), "give prefill_multiple too"),
    ((jnp.zeros((2, 3), jnp.int32), 3), dict(prefill_multiple=4, cache_length=5), "at least 6"),
])
def test_bad_arguments(lm, args, kwargs, match):
    model, params, _ = lm
    with pytest.raises(ValueError, match=match):
        generate(model, params, *args, **kwargs)


def _random_params(model, prompt, seed=0):
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), prompt))["params"]
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda x: jnp.asarray(rng.normal(0.0, 0.1, x.shape), x.dtype), shapes)


@pytest.mark.parametrize("encoding", ["goat", *(pytest.param(e, marks=pytest.mark.slow(reason="a second and third encoding through the bucketed decoder (~10-13 s each of an idle core); GOAT runs in the default suite")) for e in ("fox", "learned"))])
def test_prefill_multiple_gives_the_exact_paths_tokens_with_one_compile_per_bucket(encoding):
    """prefill_multiple=4 on prompts of 3 (no head chunk) and 9 tokens (head 8 + one tail
    token), greedy, and for GOAT 4 tokens (no tail) and sampled: the head chunk + one-token tail + a longer cache
    reproduce the exact path's tokens for GOAT's prior, FoX (whose cache keeps a running gate
    sum) and a learned absolute table (the LM's own position index). For GOAT: lengths 5, 6
    and 7 share one compile, and a cap on the cache is honoured down to prompt + new tokens."""
    from goat_jax.models import sampling

    model = TransformerLM(dataclasses.replace(CFG, position_encoding=encoding, max_len=32, num_layers=1))
    prompts = jax.random.randint(jax.random.PRNGKey(3), (2, 9), 0, CFG.vocab_size, jnp.int32)
    params = _random_params(model, prompts)
    rng = jax.random.PRNGKey(11)
    cases = [(3, {}), (9, {})] + ([(4, {}), (9, dict(temperature=1.0, top_k=20))] if encoding == "goat" else [])
    for p, kwargs in cases:
        exact = generate(model, params, prompts[:, :p], 4, rng, **kwargs)
        bucketed = generate(model, params, prompts[:, :p], 4, rng, prefill_multiple=4, **kwargs)
        np.testing.assert_array_equal(bucketed, exact, err_msg=f"{encoding} P={p} {kwargs}")
    if encoding != "goat":
        return
    capped = generate(model, params, prompts[:, :7], 4, prefill_multiple=4, cache_length=11)
    np.testing.assert_array_equal(capped, generate(model, params, prompts[:, :7], 4))
    before = sampling._generate_bucketed._cache_size()
    for p in (5, 6, 7):
        generate(model, params, prompts[:, :p], 3, prefill_multiple=4)
    assert sampling._generate_bucketed._cache_size() == before + 1


@pytest.mark.parametrize("kwargs", [dict(), dict(use_cache=False), dict(prefill_multiple=4)],
                         ids=["cached", "uncached", "bucketed"])
def test_on_token_sees_every_step_in_order_with_the_returned_tokens(lm, kwargs):
    """``on_token(step, tokens)`` runs on the host once per drawn token, steps 0 .. n - 1 in
    order, with the ids ``generate`` returns (what experiments.sample streams and times)."""
    model, params, prompt = lm
    seen = []
    out = generate(model, params, prompt, 4, jax.random.PRNGKey(5), temperature=1.0,
                   on_token=lambda step, tokens: seen.append((int(step), np.asarray(tokens).tolist())), **kwargs)
    assert [s for s, _ in seen] == [0, 1, 2, 3]
    np.testing.assert_array_equal(np.asarray([t for _, t in seen]).T, out[:, prompt.shape[1]:])
    with pytest.raises(ValueError, match="on_token must be None or a function"):
        generate(model, params, prompt, 2, on_token="print")
