"""Positional baselines against independent float64 numpy references (goat_jax.positional)."""

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax import positional as pos_lib
from goat_jax.layers.positional import PositionalAttention
from goat_jax.positional import LearnedPositionEmbedding
from tests import jitted

E, N, H = 32, 4, 8  # model dim, query heads, head dim
MAX_LEN = 64
TRAIN_LEN = 5  # rope_pi: sequences of 10 tokens are interpolated by 2


@pytest.fixture
def rng():
    seed = time.time_ns() % 2**32
    print(f"test_positional seed={seed}")  # shown by pytest on failure
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------------------------
# float64 numpy reference, written from the papers (not from goat_jax.positional)
# ----------------------------------------------------------------------------------------------


def np_slopes(n):
    assert n & (n - 1) == 0, "the test uses power-of-two head counts"
    return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)  # ALiBi paper


def np_rotate(x, p, base=10_000.0):
    """RoPE as complex multiplication: pair (i, i + H/2) is the complex number x_i + i x_{i+H/2}."""
    h = x.shape[-1]
    theta = base ** (-np.arange(h // 2) * 2.0 / h)
    z = (x[..., : h // 2] + 1j * x[..., h // 2:]) * np.exp(1j * p[..., :, None, None] * theta)
    return np.concatenate([z.real, z.imag], axis=-1)


def np_dense(w, name, x, heads):
    return np.einsum("bte,enh->btnh", x, np.asarray(w[name]["kernel"], np.float64)) + np.asarray(
        w[name]["bias"], np.float64)


def np_reference(params, xq, xkv, enc, kv_heads, causal, q_pos, k_pos, pad=None, scale=None):
    """Dense softmax attention layer in float64. q_pos [T], k_pos [S] positions; ``scale`` on
    q . k (default 1 / sqrt(H))."""
    w = nn.meta.unbox(params)
    xq, xkv = np.asarray(xq, np.float64), np.asarray(xkv, np.float64)
    q = np_dense(w, "q_proj", xq, N)
    k = np_dense(w, "k_proj", xkv, kv_heads)
    v = np_dense(w, "v_proj", xkv, kv_heads)
    t, s = q.shape[1], k.shape[1]
    if enc == "rope":
        q, k = np_rotate(q, q_pos), np_rotate(k, k_pos)
    if enc == "rope_pi":
        f = max(1.0, s / TRAIN_LEN)
        q, k = np_rotate(q, q_pos / f), np_rotate(k, k_pos / f)
    k = np.repeat(k, N // kv_heads, axis=2)
    v = np.repeat(v, N // kv_heads, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) * (1 / np.sqrt(H) if scale is None else scale)
    if enc in ("alibi", "alibi_packed"):
        logits -= np_slopes(N)[:, None, None] * np.abs(q_pos[:, None] - k_pos[None, :])
    if enc == "naive_prior":
        table = np.asarray(w["naive_prior"], np.float64)
        logits += table[:, q_pos.astype(int)][:, :, k_pos.astype(int)]
    allowed = np.ones((1, 1, t, s), bool)
    if causal:
        allowed = allowed & (np.arange(s)[None, :] <= np.arange(t)[:, None])
    if pad is not None:
        allowed = allowed & ~pad[:, None, None, :]
    logits = np.where(allowed, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", probs, v)
    return np.einsum("btnh,nhe->bte", out, np.asarray(w["out_proj"]["kernel"], np.float64)) + np.asarray(
        w["out_proj"]["bias"], np.float64)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def make(enc, kv_heads=N, **kw):
    return PositionalAttention(num_heads=N, kv_num_heads=kv_heads, position_encoding=enc,
                               training_seq_len=TRAIN_LEN, max_len=MAX_LEN, **kw)


def init(module, rng, *args, **kw):
    """Params with every parameter random (the naive prior table is zero at init)."""
    params = nn.meta.unbox(jitted.init(module, jax.random.PRNGKey(int(rng.integers(2**31))), *args, **kw)["params"])
    if "naive_prior" in params:
        params["naive_prior"] = jnp.asarray(rng.normal(size=params["naive_prior"].shape), jnp.float32)
    params["q_proj"]["bias"] = jnp.asarray(rng.normal(size=params["q_proj"]["bias"].shape) * 0.1, jnp.float32)
    return params


# ----------------------------------------------------------------------------------------------
# Each variant vs the reference
# ----------------------------------------------------------------------------------------------

ALL = ("nope", "rope", "rope_pi", "alibi", "alibi_packed", "naive_prior")


@pytest.mark.parametrize("enc", ALL)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [N, 2])
def test_matches_reference(enc, causal, kv_heads, rng):
    if enc == "alibi_packed" and not causal:
        pytest.skip("alibi_packed is causal only (tested in test_errors)")
    b, t = 2, 10
    x = jnp.asarray(rng.normal(size=(b, t, E)), jnp.float32)
    offset = int(rng.integers(0, MAX_LEN - t))
    pad = None
    if not causal:  # right padding, keeping >= 1 key per row
        pad = np.arange(t)[None, :] >= rng.integers(1, t + 1, size=(b, 1))
    module = make(enc, kv_heads)
    params = init(module, rng, x, is_causal=causal)
    y = jitted.apply(module, {"params": params}, x, is_causal=causal,
                     key_padding_mask=None if pad is None else jnp.asarray(pad), position_offset_q=offset, position_offset_k=offset)
    p = offset + np.arange(t, dtype=np.float64)
    ref = np_reference(params, x, x, enc, kv_heads, causal, p, p, pad)
    assert rel_err(y, ref) <= 1e-5


@pytest.mark.parametrize("enc", ALL)
def test_attention_scale_matches_reference(enc, rng):
    """``attention_scale=1`` (the official synthetic baselines: q . k unscaled) and a random
    scale, against the float64 reference; biases stay unscaled."""
    b, t = 2, 10
    x = jnp.asarray(rng.normal(size=(b, t, E)), jnp.float32)
    p = np.arange(t, dtype=np.float64)
    for scale in (1.0, float(rng.uniform(0.05, 2.0))):
        module = make(enc, 2, attention_scale=scale)
        params = init(module, rng, x, is_causal=True)
        y = jitted.apply(module, {"params": params}, x, is_causal=True)
        ref = np_reference(params, x, x, enc, 2, True, p, p, scale=scale)
        assert rel_err(y, ref) <= 1e-5, scale
        if scale == 1.0:  # sqrt(8) x the default: the option changes the output
            assert rel_err(np_reference(params, x, x, enc, 2, True, p, p), ref) > 1e-3


@pytest.mark.parametrize("enc", ("nope", "rope", "rope_pi", "alibi", "naive_prior"))
def test_cross_attention_explicit_positions(enc, rng):
    """Different query/key lengths and explicit [T] / [S] positions (bidirectional)."""
    xq = jnp.asarray(rng.normal(size=(2, 6, E)), jnp.float32)
    xkv = jnp.asarray(rng.normal(size=(2, 11, E)), jnp.float32)
    q_pos = np.sort(rng.choice(MAX_LEN, 6, replace=False)).astype(np.float64)
    k_pos = np.sort(rng.choice(MAX_LEN, 11, replace=False)).astype(np.float64)
    module = make(enc, 2)
    params = init(module, rng, xq, xkv)
    y = jitted.apply(module, {"params": params}, xq, xkv, q_positions=jnp.asarray(q_pos, jnp.int32),
                     k_positions=jnp.asarray(k_pos, jnp.int32))
    assert rel_err(y, np_reference(params, xq, xkv, enc, 2, False, q_pos, k_pos)) <= 1e-5


# ----------------------------------------------------------------------------------------------
# Properties
# ----------------------------------------------------------------------------------------------


def test_rope_is_relative(rng):
    """Shifting all positions leaves q.k unchanged ([T] and [B, T] positions)."""
    q = jnp.asarray(rng.normal(size=(2, 9, 3, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 9, 3, 16)), jnp.float32)
    p = jnp.asarray(rng.integers(0, 50, size=(2, 9)))
    shift = int(rng.integers(1, 200))
    logits = lambda a, c: jnp.einsum("btnh,bsnh->bnts", a, c)
    base = logits(pos_lib.apply_rope(q, p), pos_lib.apply_rope(k, p))
    shifted = logits(pos_lib.apply_rope(q, p + shift), pos_lib.apply_rope(k, p + shift))
    assert rel_err(shifted, base) <= 1e-4  # float32 angles up to ~250 rad
    p1 = jnp.arange(9)
    base1 = logits(pos_lib.apply_rope(q, p1), pos_lib.apply_rope(k, p1))
    assert rel_err(logits(pos_lib.apply_rope(q, p1 + shift), pos_lib.apply_rope(k, p1 + shift)), base1) <= 1e-4
    # ... and the rotation is not the identity
    assert rel_err(pos_lib.apply_rope(q, p1 + shift), q) > 1e-2


def test_rope_module_offset_invariance(rng):
    x = jnp.asarray(rng.normal(size=(1, 8, E)), jnp.float32)
    module = make("rope")
    params = init(module, rng, x, is_causal=True)
    a = module.apply({"params": params}, x, is_causal=True)
    shift = int(rng.integers(1, 100))
    c = module.apply({"params": params}, x, is_causal=True, position_offset_q=shift, position_offset_k=shift)
    assert rel_err(c, a) <= 1e-5


def test_rope_pi_is_rope_with_interpolated_positions(rng):
    """At 2x the training length, rope_pi == rope at halved positions; within it, == rope."""
    x = jnp.asarray(rng.normal(size=(2, 2 * TRAIN_LEN, E)), jnp.float32)
    pi, rope = make("rope_pi"), make("rope")
    params = init(pi, rng, x, is_causal=True)
    # Layers take integer positions only, so the halved positions go to the float64 reference.
    half = np.arange(2 * TRAIN_LEN, dtype=np.float64) / 2
    a = pi.apply({"params": params}, x, is_causal=True)
    b = np_reference(params, x, x, "rope", N, True, half, half)
    assert rel_err(a, b) <= 1e-5
    short = x[:, :TRAIN_LEN]
    assert rel_err(pi.apply({"params": params}, short, is_causal=True),
                   rope.apply({"params": params}, short, is_causal=True)) <= 1e-6


@pytest.mark.slow(reason="ALiBi and packed ALiBi in bf16 at long lengths (~12 s of an idle core); float32 equality of the two stays in the default suite")
def test_alibi_packed_matches_alibi_far_in_bf16(rng):
    """Positions ~16000 in bfloat16: ALiBi packed into q/k (exactly split slope * p_j) gives the
    materialized-bias output. A single bf16 channel would be off by up to 16 logits there."""
    heads, t = 8, 48
    x = jnp.asarray(rng.normal(size=(2, t, 64)), jnp.float32)
    offset = 16_000 + int(rng.integers(0, 300))
    kw = dict(num_heads=heads, kv_num_heads=2, dtype=jnp.bfloat16)
    packed = PositionalAttention(position_encoding="alibi_packed", **kw)
    dense = PositionalAttention(position_encoding="alibi", **kw)
    params = init(packed, rng, x, is_causal=True)
    run = lambda m: m.apply({"params": params}, x, is_causal=True, position_offset_q=offset,
                            position_offset_k=offset).astype(jnp.float32)
    a, b = run(packed), run(dense)
    err = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert err <= 1e-2, err
    # Both are also close to the float32 module at the same positions.
    f32 = PositionalAttention(position_encoding="alibi", num_heads=heads, kv_num_heads=2)
    c = f32.apply({"params": params}, x, is_causal=True, position_offset_q=offset, position_offset_k=offset)
    assert float(jnp.linalg.norm(a - c) / jnp.linalg.norm(c)) <= 2e-2


@pytest.mark.parametrize("enc", ALL)
def test_decode_equals_full_forward(enc, rng):
    """Prefill 3 tokens, then decode one at a time; equals the full causal forward."""
    b, t = 2, 8
    x = jnp.asarray(rng.normal(size=(b, t, E)), jnp.float32)
    full = make(enc, 2)
    params = init(full, rng, x, is_causal=True)
    ref = full.apply({"params": params}, x, is_causal=True)
    dec = make(enc, 2, decode=True)
    cache = dec.init(jax.random.PRNGKey(0), x, is_causal=True)["cache"]

    @jax.jit
    def step(cache, xt):
        y, new = dec.apply({"params": params, "cache": cache}, xt, is_causal=True, mutable=["cache"])
        return y, new["cache"]

    outs = []
    for lo, hi in [(0, 3)] + [(i, i + 1) for i in range(3, t)]:
        y, cache = step(cache, x[:, lo:hi])
        outs.append(y)
    assert int(cache["cache_index"]) == t
    assert rel_err(jnp.concatenate(outs, axis=1), ref) <= 1e-5


# ----------------------------------------------------------------------------------------------
# Pure functions and absolute embeddings
# ----------------------------------------------------------------------------------------------


def test_alibi_bias_and_sinusoidal(rng):
    qp, kp = rng.integers(0, 100, size=5), rng.integers(0, 100, size=7)
    got = pos_lib.alibi_bias(8, jnp.asarray(qp), jnp.asarray(kp))
    assert got.shape == (1, 8, 5, 7) and got.dtype == jnp.float32
    want = -np_slopes(8)[:, None, None] * np.abs(qp[:, None] - kp[None, :])
    assert rel_err(got[0], want) <= 1e-6
    p = rng.integers(0, 1000, size=(3, 4))
    pe = np.asarray(pos_lib.sinusoidal_embedding(jnp.asarray(p), 16), np.float64)
    i = np.arange(8)
    angle = p[..., None] / 10_000.0 ** (2 * i / 16)
    # Vaswani: PE(pos, 2i) = sin, PE(pos, 2i+1) = cos.
    np.testing.assert_allclose(pe[..., 0::2], np.sin(angle), atol=1e-3)  # float32 angles ~1e3 rad
    np.testing.assert_allclose(pe[..., 1::2], np.cos(angle), atol=1e-3)


def test_learned_position_embedding(rng):
    emb = LearnedPositionEmbedding(max_len=16, features=4)
    params = emb.init(jax.random.PRNGKey(0), jnp.arange(16))
    table = np.asarray(nn.meta.unbox(params)["params"]["embedding"])
    p = rng.integers(0, 16, size=(2, 5))
    np.testing.assert_array_equal(emb.apply(params, jnp.asarray(p)), table[p])
    with pytest.raises(ValueError, match="max_len=16"):
        emb.apply(params, jnp.arange(17))
    with pytest.raises(ValueError, match="max_len=16"):
        emb.apply(params, jnp.arange(-1, 3))
    # Traced positions cannot be checked: out of range gives NaN, never a clamped row.
    traced = jax.jit(lambda p: emb.apply(params, p))(jnp.array([-1, 14, 15, 16]))
    traced = np.asarray(traced)
    assert np.isnan(traced[[0, 3]]).all() and not np.isnan(traced[1:3]).any()


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def test_errors():
    with pytest.raises(ValueError, match=r"attention_scale=0.0 is out of range: allowed is a number finite in float32 > 0"):
        x = jnp.zeros((1, 4, E))
        make("rope", attention_scale=0.0).init(jax.random.PRNGKey(0), x)
    x = jnp.zeros((1, 8, E))
    key = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match=r"max_len=4"):
        PositionalAttention(num_heads=N, position_encoding="naive_prior", max_len=4).init(key, x)
    params = make("naive_prior").init(key, x)
    with pytest.raises(ValueError, match=f"max_len={MAX_LEN}"):
        make("naive_prior").apply(params, x, position_offset_q=MAX_LEN - 4, position_offset_k=0)
    with pytest.raises(ValueError, match=f"max_len={MAX_LEN}"):
        make("naive_prior").apply(params, x, k_positions=jnp.arange(8) + MAX_LEN)
    with pytest.raises(ValueError, match=r"q_positions spans \[-1, 6\], outside \[0, MAX_POSITION"):
        make("naive_prior").apply(params, x, q_positions=jnp.arange(8) - 1)  # every layer
    with pytest.raises(ValueError, match="is_causal=True"):
        make("alibi_packed").init(key, x, is_causal=False)
    with pytest.raises(ValueError, match="'nope', 'rope', 'rope_pi', 'alibi', 'alibi_packed', 'naive_prior'"):
        make("sinusoidal").init(key, x)
    with pytest.raises(ValueError, match="training_seq_len"):
        PositionalAttention(num_heads=N, position_encoding="rope_pi").init(key, x)
    for impl in ("cudnn", "splash", "flash"):
        with pytest.raises(ValueError, match="alibi_packed"):
            make("alibi", implementation=impl).init(key, x, is_causal=True)
        with pytest.raises(ValueError, match="bias"):
            make("naive_prior", implementation=impl).init(key, x, is_causal=True)
    with pytest.raises(ValueError, match="1D"):
        make("rope").init(key, x, spatial_shape=(2, 4))
    make("nope").init(key, x, spatial_shape=(2, 4))  # ViT with absolute embeddings
