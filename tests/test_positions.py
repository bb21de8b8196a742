"""Exact positions at any length (issue #49): every angle ``w * p`` (GOAT's Fourier channels, the
sink MLP's inputs, RoPE and its variants, the sinusoidal embedding) is as accurate at position
16M as at 1,000, against float64 NumPy, in float32 and bfloat16; layers whose output depends on
relative positions only give the same output shifted by 1M and 4M; the bf16 sink channels stay
exact to 1M; ``MAX_POSITION = 2**24`` is enforced with one line.

Before the exact phases (float32 ``w * p``) the feature error grew linearly, 0.4 at 16M
(benchmarks/positions.md), so every accuracy test here fails on that code. Windows of 64
positions; Positions are built directly where a test needs positions past the old bound.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax import prior as prior_lib
from goat_jax.layers.positional import PositionalAttention
from goat_jax.positional import apply_rope, apply_rope_2d, sinusoidal_embedding
from goat_jax.positional.rope_mixed import apply_rope_mixed
from goat_jax.positional.rope_scaling import ntk_frequencies, yarn_frequencies
from tests import goat_reference as ref
from tests import jitted

WINDOW = 64
STARTS = (1_000, 60_000, 120_000, 1_000_000, 4_000_000, 2 ** 24 - WINDOW)
F32_TOL = 5e-7  # float32 round-off of an angle below pi (~2 ulp), then of cos/sin
# Features and rotations of magnitude <= 1 (relative to the largest): float32 round-off of a few
# products, or the bf16 rounding of the result (2**-8 relative), at every position.
TOL = {"float32": 2 * F32_TOL, "bfloat16": 2.0 ** -8 + 2 * F32_TOL}


def _ladder(rank, base):
    """GOAT's geometric ladder in float64, written out (not goat_jax's, which is under test)."""
    return base ** (-np.arange(rank, dtype=np.float64) / max(rank - 1, 1))


def _pos(start, n=WINDOW):
    p = jnp.arange(n, dtype=jnp.float32) + jnp.float32(start)
    return prior_lib.Positions(index=p, coords=p), np.arange(n, dtype=np.float64) + start


def _f64(x, dtype="float32"):
    return np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32), np.float64)


def _assert_flat(errors, tol, dtype="float32"):
    """Every window's error is round-off; in float32 the last (16M) is also no worse than the first
    (1,000). In bf16 the bf16 rounding of the result (the bound, at every position) dominates, so
    the windows differ by rounding noise only."""
    first, last = errors[STARTS[0]], errors[STARTS[-1]]
    assert max(errors.values()) <= tol, errors
    if dtype == "float32":
        assert last <= 1.5 * first + 1e-7, errors


# ------------------------------------------------------------------------------------------
# GOAT: the packed Fourier channels and the sink MLP's inputs
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("learned", [False, True], ids=["ladder", "learned"])
def test_goat_channels_are_exact_at_any_position(dtype, learned, rng):
    """The query and key channels the kernels see (``q_rel``, ``k_rel``), fixed ladder (static
    float64) or learned per-head frequencies (traced, float32, some > 2 pi, tiny or negative)."""
    k, r = 2, 6
    spec = prior_lib.PriorSpec(num_heads=4, kv_num_heads=k, pos_rank=r, abs_rank=2, learn_frequencies=learned)
    params = {"lambda_sym": jnp.asarray(rng.normal(0, 1, (k, r)), jnp.float32),
              "lambda_asym": jnp.asarray(rng.normal(0, 1, (k, r)), jnp.float32)}
    if learned:
        w = np.concatenate([rng.uniform(0, 1, (k, 3)), [[7.5, 1e-6, -0.3]] * k], axis=1)
        params["pos_freqs"] = jnp.asarray(w, jnp.float32)
        w = np.asarray(params["pos_freqs"], np.float64)  # the float32 parameter is the truth
    else:
        w = np.broadcast_to(_ladder(r, 1e4), (k, r))
    a, b = (np.repeat(np.asarray(params[n], np.float64), 2, axis=0) for n in ("lambda_sym", "lambda_asym"))
    w_q = np.repeat(w, 2, axis=0)  # [N, R]
    run = jax.jit(lambda prm, pos: (prior_lib.query_features(spec, prm, pos)[0],
                                    prior_lib.fourier_features(pos, prior_lib.relative_frequencies(spec, prm))))
    errors = {}
    for start in STARTS:
        pos, p = _pos(start)
        q_rel, k_rel = run(params, pos)
        ph_q = p[:, None, None] * w_q  # [T, N, R]
        want_q = np.concatenate([a * np.cos(ph_q) + b * np.sin(ph_q), a * np.sin(ph_q) - b * np.cos(ph_q)], -1)
        ph_k = p[:, None, None] * w if learned else p[:, None] * w[0]
        want_k = np.concatenate([np.cos(ph_k), np.sin(ph_k)], -1)
        scale = np.abs(a).max() + np.abs(b).max()
        errors[start] = max(np.abs(_f64(q_rel, dtype) - want_q).max() / scale,
                            np.abs(_f64(k_rel, dtype) - want_k).max())
    _assert_flat(errors, TOL[dtype], dtype)


def test_goat_2d_channels_are_exact_at_large_grid_offsets():
    """2D (row, col) features, row and column frequencies from one ladder, offsets up to 2**24."""
    freqs = _ladder(5, 100.0)
    errors = {}
    for start in STARTS:
        rows, cols = np.meshgrid(np.arange(8) + start, np.arange(8) + start // 3, indexing="ij")
        c = np.stack([rows.ravel(), cols.ravel()], -1).astype(np.float64)
        pos = prior_lib.Positions(index=jnp.arange(64, dtype=jnp.float32), coords=jnp.asarray(c, jnp.float32))
        ph = np.concatenate([c[:, :1] * freqs[:3], c[:, 1:] * freqs[3:]], -1)
        want = np.concatenate([np.cos(ph), np.sin(ph)], -1)
        errors[start] = np.abs(_f64(prior_lib.fourier_features(pos, prior_lib.frequencies(5, 100.0))) - want).max()
    _assert_flat(errors, F32_TOL)


def test_sink_inputs_and_sink_are_float32_accurate_at_any_position(rng):
    """The sink MLP's inputs: Fourier features exact (absolute error), ``t / L_n`` and
    ``log1p(t) / log1p(L_n)`` to float32 relative round-off; the sink ``u(j)`` itself (MLP, bump,
    recency slope) to float32 relative round-off of its own size, which grows with ``t``."""
    spec = prior_lib.PriorSpec(num_heads=2, kv_num_heads=2, pos_rank=2, abs_rank=4, training_seq_len=2048)
    import flax
    from goat_jax.layers.goat import GoatPrior
    pos0 = prior_lib.positions_1d(4)
    params = flax.core.meta.unbox(GoatPrior(spec).init(jax.random.key(0), pos0, pos0, True))["params"]
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.normal(0, 0.5, x.shape), jnp.float32), params)
    p64 = ref.unboxed({"params": params})
    cfg = dict(num_heads=2, kv_num_heads=2, pos_rank=2, abs_rank=4, training_seq_len=2048)
    wa = _ladder(4, 1e4)
    feat_err, extra_err, sink_err = {}, {}, {}
    for start in STARTS:
        pos, p = _pos(start)
        got = np.asarray(prior_lib.sink_mlp_inputs(spec, pos), np.float64)
        ph = p[:, None] * wa
        feat_err[start] = np.abs(got[:, :8] - np.concatenate([np.cos(ph), np.sin(ph)], -1)).max()
        want = np.stack([p / 2048, np.log1p(p) / np.log1p(2048)], -1)
        extra_err[start] = (np.abs(got[:, 8:] - want) / want).max()
        u = np.asarray(prior_lib.sink(spec, params, pos, True), np.float64).T  # [K, S]
        with np.errstate(over="ignore"):  # SiLU's exp(-h) of a large negative h: 0, correctly
            u_ref = ref.sink_prior(p64, cfg, p, p, np.zeros(WINDOW, bool), None, True)
        sink_err[start] = np.abs(u - u_ref).max() / np.abs(u_ref).max()
    _assert_flat(feat_err, F32_TOL)
    assert max(extra_err.values()) <= 4 * 2.0 ** -24, extra_err
    assert max(sink_err.values()) <= 1e-5, sink_err


# ------------------------------------------------------------------------------------------
# Rotary encodings
# ------------------------------------------------------------------------------------------


def _rotate_half_f64(x, ang):
    """float64 rotate-half rotation of x [..., T, N, H] by angles [T, N or 1, H/2]."""
    h = x.shape[-1] // 2
    c, s = np.cos(ang), np.sin(ang)
    return np.concatenate([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)


H = 32
THETA = 1e4 ** (-np.arange(0, H, 2, dtype=np.float64) / H)
ROTARY = {
    # name: (apply(x, positions) in JAX, float64 angles [T, H/2] of the positions)
    "rope": (lambda x, p: apply_rope(x, p, 1e4), lambda p: p[:, None] * THETA),
    "rope_pi_x8": (lambda x, p: apply_rope(x, p, 1e4, scale=8.0), lambda p: (p / 8.0)[:, None] * THETA),
    "rope_pi_x3": (lambda x, p: apply_rope(x, p, 1e4, scale=3.0), lambda p: (p / 3.0)[:, None] * THETA),
    "ntk": (lambda x, p: apply_rope(x, p, frequencies=ntk_frequencies(H, 1e4, 5.0)),
            lambda p: p[:, None] * ntk_frequencies(H, 1e4, 5.0)),
    "yarn": (lambda x, p: apply_rope(x, p, frequencies=yarn_frequencies(H, 1e4, 5.0, 512)[0]),
             lambda p: p[:, None] * yarn_frequencies(H, 1e4, 5.0, 512)[0]),
    # A JAX array of frequencies is taken as its float32 value (traced under jit).
    "traced": (jax.jit(lambda x, p: apply_rope(x, p, frequencies=jnp.asarray(THETA, jnp.float32))),
               lambda p: p[:, None] * np.asarray(jnp.asarray(THETA, jnp.float32), np.float64)),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(ROTARY))
def test_rotary_is_exact_at_any_position(name, dtype, rng):
    apply, angles64 = ROTARY[name]
    x = jnp.asarray(rng.normal(size=(1, WINDOW, 2, H)), jnp.float32).astype(dtype)
    x64 = _f64(x)
    errors = {}
    for start in STARTS:
        _, p = _pos(start)
        got = _f64(apply(x, jnp.asarray(p, jnp.float32)))
        want = _rotate_half_f64(x64, angles64(p)[:, None, :])
        errors[start] = np.abs(got - want).max() / np.abs(want).max()
    _assert_flat(errors, TOL[dtype], dtype)


def test_rope_2d_mixed_and_sinusoidal_are_exact_at_any_position(rng):
    """Axial 2D RoPE and RoPE-Mixed (learned thetas, traced, the angle ``row F_r + col F_c`` one
    exact phase) on (row, col) coordinates up to 2**24, and the sinusoidal embedding."""
    x = jnp.asarray(rng.normal(size=(1, WINDOW, 2, H)), jnp.float32)
    x64 = _f64(x)
    f_mixed = jnp.asarray(rng.normal(0, 0.5, (2, H // 2, 2)), jnp.float32)
    fm = np.asarray(f_mixed, np.float64)
    mixed = jax.jit(apply_rope_mixed)
    theta2 = 100.0 ** (-np.arange(0, H // 2, 2, dtype=np.float64) / (H // 2))
    errors = {}
    for start in STARTS:
        c = np.stack([np.arange(WINDOW) + start, np.arange(WINDOW)[::-1] + start // 7], -1).astype(np.float64)
        cj = jnp.asarray(c, jnp.float32)
        halves = [_rotate_half_f64(x64[..., i * H // 2:(i + 1) * H // 2], (c[:, i:i + 1] * theta2)[:, None, :])
                  for i in (0, 1)]
        err_2d = np.abs(_f64(apply_rope_2d(x, cj, 100.0)) - np.concatenate(halves, -1)).max()
        ang = c[:, None, None, 0] * fm[None, ..., 0] + c[:, None, None, 1] * fm[None, ..., 1]  # [T, N, H/2]
        halves = [_rotate_half_f64(x64[..., i * H // 2:(i + 1) * H // 2], ang[..., i * H // 4:(i + 1) * H // 4])
                  for i in (0, 1)]
        err_mixed = np.abs(_f64(mixed(x, cj, f_mixed)) - np.concatenate(halves, -1)).max()
        p = c[:, 0]
        ph = p[:, None] * THETA
        want = np.stack([np.sin(ph), np.cos(ph)], -1).reshape(WINDOW, H)
        err_sin = np.abs(_f64(sinusoidal_embedding(jnp.asarray(p, jnp.float32), H)) - want).max()
        errors[start] = max(err_2d / np.abs(x64).max(), err_mixed / np.abs(x64).max(), err_sin)
    _assert_flat(errors, 2 * F32_TOL)


def test_pi_scales_the_frequency_not_the_position(rng):
    """RoPE-PI: ``(p / s) * theta`` is computed as ``p * (theta / s)`` with ``theta / s`` in
    float64, so it stays exact where ``p / s`` is not a float32 number. Where it is (s a power of
    two), dividing the positions gives the same rotation; with a per-token factor (packed
    documents) the positions are divided, exact to the float32 rounding of ``p / s``, bounded by
    the training length since a document's ``p / s`` stays below it."""
    x = jnp.asarray(rng.normal(size=(1, WINDOW, 2, H)), jnp.float32)
    x64 = _f64(x)
    for start in (1_000, 2 ** 24 - WINDOW):
        _, p = _pos(start)
        pj = jnp.asarray(p, jnp.float32)
        folded = apply_rope(x, pj, 1e4, scale=4.0)
        divided = apply_rope(x, pj / 4.0, 1e4)  # p / 4 is exact in float32
        per_token = apply_rope(x, pj, 1e4, scale=jnp.full(pj.shape, 4.0))
        tol = 2 * F32_TOL * np.abs(x64).max()  # an angle's round-off times the largest input
        np.testing.assert_allclose(np.asarray(folded), np.asarray(divided), rtol=0, atol=tol)
        np.testing.assert_allclose(np.asarray(per_token), np.asarray(divided), rtol=0, atol=tol)
        want = _rotate_half_f64(x64, ((p / 3.0)[:, None] * THETA)[:, None, :])
        assert np.abs(_f64(apply_rope(x, pj, 1e4, scale=3.0)) - want).max() <= 2 * F32_TOL * np.abs(want).max()
    # Per-token factors of a document of 6,000 tokens trained at 2,048: p / s < 2,048.
    p = np.arange(6000 - WINDOW, 6000, dtype=np.float64)
    s = 6000 / 2048
    got = apply_rope(x, jnp.asarray(p, jnp.float32), 1e4, scale=jnp.full((WINDOW,), s, jnp.float32))
    want = _rotate_half_f64(x64, ((p / np.float32(s))[:, None] * THETA)[:, None, :])
    assert np.abs(_f64(got) - want).max() <= 2048 * 2.0 ** -24 * np.abs(want).max() + 2 * F32_TOL


# ------------------------------------------------------------------------------------------
# Layers: shifted by 1M and 4M, the same output
# ------------------------------------------------------------------------------------------


def _goat(**kw):
    return ref.goat_module(num_heads=4, kv_num_heads=2, pos_rank=6, abs_rank=2, enable_key_bias=False,
                           implementation="xla", **kw)


LAYERS = {
    "goat": lambda: _goat(),
    "goat_learned_frequencies": lambda: _goat(learn_frequencies=True),
    "rope": lambda: PositionalAttention(num_heads=4, position_encoding="rope", implementation="xla"),
}


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_relative_layers_give_the_same_output_shifted_by_millions(layer, is_causal, rng):
    """Done-when of issue #49: a layer whose output depends only on relative positions (GOAT's
    relative prior, O(1) coefficients; RoPE) gives the same output, to float32 round-off, at
    positions shifted by 1,000,000 and 4,000,000 (and to the last valid position) as unshifted;
    once through position offsets, once through explicit positions."""
    module = LAYERS[layer]()
    x = jnp.asarray(rng.normal(size=(2, 48, 64)), jnp.float32)
    params = jitted.init(module, jax.random.key(0), x)
    if layer.startswith("goat"):  # a prior that matters: O(1) amplitudes, not the 1e-2 init
        prior = params["params"]["prior"]
        for name in ("lambda_sym", "lambda_asym"):
            prior[name] = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(0, 1, a.shape), jnp.float32),
                                                 prior[name])
    run = jax.jit(lambda off: module.apply(params, x, is_causal=is_causal, position_offset_q=off,
                                           position_offset_k=off))
    base = np.asarray(run(0), np.float64)
    scale = np.abs(base).max()
    for shift in (1_000_000, 4_000_000, prior_lib.MAX_POSITION - 48):
        err = np.abs(np.asarray(run(shift), np.float64) - base).max() / scale
        assert err <= 1e-5, (shift, err)
    idx = jnp.arange(48, dtype=jnp.int32) + 4_000_000
    out = jitted.apply(module, params, x, is_causal=is_causal, q_positions=idx, k_positions=idx)
    assert np.abs(np.asarray(out, np.float64) - base).max() / scale <= 1e-5


def test_bf16_sink_channels_stay_exact_to_a_million(rng):
    """tests/test_bf16.py's criterion at 1M: a seeded causal GOAT layer in bf16 (the sink split
    over three bf16 channels) stays within 1% of float32, mean relative error over every 100
    consecutive query positions, for a window ending at position 1,000,000; one sink channel (the
    official packing) does not."""
    length, e = 1024, 128
    module = ref.goat_module(num_heads=2, pos_rank=4, abs_rank=4, training_seq_len=1024, prior_init="seeded",
                             implementation="xla")
    x = jnp.asarray(rng.normal(size=(1, length, e)), jnp.float32)
    params = jitted.init(module, jax.random.key(int(rng.integers(1 << 30))), x[:, :16], is_causal=True)
    off = 1_000_000 - length

    def out(m, dtype):
        y = jitted.apply(m, params, x.astype(dtype), is_causal=True, position_offset_q=off, position_offset_k=off)
        return np.asarray(y.astype(jnp.float32), np.float64)[0]

    def windows(y, want):
        err = np.linalg.norm(y - want, axis=-1) / np.linalg.norm(want, axis=-1)
        return np.convolve(err, np.ones(100) / 100, mode="valid")

    want = out(module, jnp.float32)
    ours = windows(out(module.clone(dtype=jnp.bfloat16), jnp.bfloat16), want)
    assert ours.max() <= 0.01, ours.max()
    single = windows(out(module.clone(dtype=jnp.bfloat16, sink_channels=1), jnp.bfloat16), want)
    assert single.mean() > 0.05, single.mean()


# ------------------------------------------------------------------------------------------
# The bound
# ------------------------------------------------------------------------------------------


def test_max_position_is_two_to_the_24_and_past_it_one_line_names_the_argument():
    assert prior_lib.MAX_POSITION == 2 ** 24 <= prior_lib.angles.MAX_ABS_POSITION  # the limbs hold it
    module = LAYERS["rope"]()
    x = jnp.ones((1, 8, 64))
    params = module.init(jax.random.key(0), x)
    for kwargs, match in [
        (dict(position_offset_q=2 ** 24 - 4), r"^position_offset_q=16777212 \+ 8 tokens reaches past "
                                              r"MAX_POSITION=16777216 = 2\*\*24.*lower the offset or the length"),
        (dict(q_positions=jnp.arange(8) + 2 ** 24 - 7, k_positions=jnp.arange(8)),
         r"^q_positions spans \[16777209, 16777216\], outside \[0, MAX_POSITION=16777216\).*shift or shorten"),
    ]:
        with pytest.raises(ValueError, match=match) as info:
            module.apply(params, x, **kwargs)
        assert "\n" not in str(info.value)
    # The last valid position runs.
    top = jnp.arange(8, dtype=jnp.int32) + 2 ** 24 - 8
    assert np.isfinite(np.asarray(module.apply(params, x, q_positions=top, k_positions=top))).all()


# ------------------------------------------------------------------------------------------
# goat_jax.prior.angles itself
# ------------------------------------------------------------------------------------------


def test_limbs_hold_w_over_2pi_to_60_bits(rng):
    """Static limbs from float64, traced limbs from float32 (jit), against ``w / (2 pi)`` with an
    independent 60-digit pi (Python's decimal), modulo one turn."""
    from decimal import Decimal, getcontext
    from goat_jax.prior import angles

    getcontext().prec = 60
    pi = Decimal("3.14159265358979323846264338327950288419716939937510582097494459")
    w32 = np.asarray(np.concatenate([rng.uniform(0, 1, 6), [1.0, 1e-4, 2 * math.pi, 100.25, -0.7, 3e-9]]),
                     np.float32)
    static, traced = angles.static_limbs(w32.astype(np.float64)), np.asarray(jax.jit(angles.traced_limbs)(w32))
    for i, v in enumerate(w32.astype(np.float64)):
        exact = Decimal(float(v)) / (2 * pi)
        for limbs in (static[i], traced[i]):
            held = sum(Decimal(int(d)) / Decimal(2) ** (12 * (j + 1)) for j, d in enumerate(limbs))
            diff = float(held - exact)
            assert abs(diff - round(diff)) < 2.0 ** -58, (v, limbs, diff)


def test_angles_negative_and_non_integer_positions_nan_and_gradients(rng):
    from goat_jax.prior import angles

    w = np.asarray(rng.uniform(0, 1, 5))
    p = np.asarray([-(2 ** 24) + 1, -12345, -1, 0, 7, 2 ** 24 - 1], np.float64)
    got = np.asarray(angles.angles(jnp.asarray(p, jnp.float32), w), np.float64)
    d = np.angle(np.exp(1j * (got - p[:, None] * w)))  # wrapped difference
    assert np.abs(d).max() <= 4e-7
    frac = jnp.asarray([2.5, 1e6 + 0.25, np.nan], jnp.float32)
    got = np.asarray(angles.angles(frac, w), np.float64)
    d = np.angle(np.exp(1j * (got[:2] - np.asarray(frac[:2], np.float64)[:, None] * w)))
    assert np.abs(d).max() <= 4e-7 and np.isnan(got[2]).all()
    # d/dw sum cos(w p) = -sum p sin(w p) through the custom JVP, at p ~ 1M.
    pos = jnp.arange(8, dtype=jnp.float32) + 1_000_000
    wj = jnp.asarray(w, jnp.float32)
    grad = np.asarray(jax.grad(lambda v: jnp.sum(jnp.cos(angles.angles(pos, v))))(wj), np.float64)
    pw = np.asarray(pos, np.float64)[:, None] * np.asarray(wj, np.float64)
    want = -(np.asarray(pos, np.float64)[:, None] * np.sin(pw)).sum(0)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ------------------------------------------------------------------------------------------
# Narrow integer positions (issue #53, item 4)
# ------------------------------------------------------------------------------------------

NARROW = (jnp.int8, jnp.uint8, jnp.int16, jnp.uint16)


def _narrow_cases(rng):
    """name -> (apply(positions or offset, via), x); every place positions enter a model."""
    from flax import nnx
    from goat_jax import nnx as gnnx
    from goat_jax.models import LMConfig, TransformerLM

    x = jnp.asarray(rng.normal(size=(2, 8, 64)), jnp.float32)
    cases = {}
    for name, module in (("goat", _goat()), ("rope", LAYERS["rope"]()),
                         ("alibi_packed", PositionalAttention(num_heads=4, position_encoding="alibi_packed",
                                                              implementation="xla"))):
        params = jitted.init(module, jax.random.key(0), x, is_causal=True)
        cases[name] = (lambda p, via, m=module, v=params: m.apply(
            v, x, is_causal=True, **({"q_positions": p, "k_positions": p} if via == "positions"
                                     else {"position_offset_q": p, "position_offset_k": p})))
    layer = gnnx.GoatAttention(4, in_features=64, kv_num_heads=2, prior=_goat().prior, implementation="xla",
                               rngs=nnx.Rngs(0))
    cases["nnx_goat"] = lambda p, via: layer(x, is_causal=True, **(
        {"q_positions": p, "k_positions": p} if via == "positions" else {"position_offset_q": p, "position_offset_k": p}))
    tokens = jnp.asarray(rng.integers(0, 61, (2, 8)), jnp.int32)
    lm = TransformerLM(LMConfig(vocab_size=61, num_layers=1, embed_dim=32, num_heads=2, mlp_dim=64, pos_rank=2,
                                abs_rank=2, training_seq_len=None))
    lm_params = jax.jit(lm.init)(jax.random.key(1), tokens)
    cases["lm"] = lambda p, via: lm.apply(lm_params, tokens, positions=p) if via == "positions" else None
    return cases


def test_narrow_integer_positions_and_offsets_give_the_int32_result_under_jit(rng):
    """int8 positions and offsets (every narrow type in the next test), traced under jit, give
    what int32 gives in every layer and the LM: they are widened where they enter. Before, ``p < MAX_POSITION`` compared against 2**24 as a weak
    Python int in the narrow dtype (where it wraps to 0 or -x), so every output was NaN."""
    base = 100  # fits every narrow dtype
    for name, apply in _narrow_cases(rng).items():
        for via in ("positions", "offset"):
            want_in = jnp.arange(8, dtype=jnp.int32) + base if via == "positions" else jnp.int32(base)
            if name == "lm" and via == "offset":
                continue
            run = jax.jit(lambda p: apply(p, via))
            want, got = run(want_in), run(want_in.astype(jnp.int8))
            assert np.isfinite(np.asarray(got)).all(), (name, via)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6, err_msg=f"{name} {via}")


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: jnp.dtype(d).name)
def test_narrow_positions_in_the_prior_functions_and_the_bound(dtype):
    """The prior's own entry points: ``validate_positions`` / ``positions_1d`` / ``positions_2d``
    give exact float positions for narrow traced and NumPy inputs."""
    p = jnp.arange(4, dtype=dtype) + 7
    want = np.arange(4) + 7.0
    np.testing.assert_array_equal(jax.jit(lambda q: prior_lib.validate_positions(q, "p"))(p), want)
    np.testing.assert_array_equal(jax.jit(lambda o: prior_lib.positions_1d(4, o).index)(p[0]), want)
    np.testing.assert_array_equal(prior_lib.positions_1d(4, np.asarray(7, dtype)).index, want)
    grid = prior_lib.positions_2d((2, 2), False, (np.asarray(120, dtype)[()], np.asarray(3, dtype)[()]))
    np.testing.assert_array_equal(np.asarray(grid.coords)[:, 0], [120, 120, 121, 121])
