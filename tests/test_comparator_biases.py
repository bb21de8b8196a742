"""The learned-bias comparators of GOAT (goat_jax.positional: 'fire', 'kerple_log', 'fox')
against an independent float64 implementation of each paper's formula (values and gradients),
and their KV cache, GQA, positions, logical axes, kernel rules and FoX's bf16 accuracy."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax.layers.positional import PositionalAttention
from goat_jax.layers import positional as layer_lib
from tests.marks import SLOW_CASE

E, N, H = 32, 4, 8  # model dim, query heads, head dim
ENCODINGS = ("fire", "kerple_log", "fox")


# ----------------------------------------------------------------------------------------------
# float64 references, written from the papers' formulas (jnp under x64, so they differentiate)
# ----------------------------------------------------------------------------------------------


def ref_bias(enc, p, x, q_pos, k_pos):
    """[B|1, N, T, S] float64 bias of ``enc`` from the unboxed float64 params ``p``."""
    qp, kp = q_pos[:, None], k_pos[None, :]  # [T, 1], [1, S]
    if enc == "kerple_log":  # -r1 log(1 + r2 |i - j|), r = softplus(raw)
        r1, r2 = (jnp.log1p(jnp.exp(p[name]))[:, None, None] for name in ("kerple_r1_raw", "kerple_r2_raw"))
        return (-r1 * jnp.log(1.0 + r2 * jnp.abs(qp - kp)))[None]
    if enc == "fire":  # f( psi(i - j) / psi(max(L, i)) ), psi(x) = log(|c x| + 1), L = |m| 512
        psi = lambda d: jnp.log(jnp.abs(p["fire_c"] * d) + 1.0)
        big_l = jnp.abs(p["fire_L_multiplier"]) * 512.0
        z = psi(qp - kp) / (psi(jnp.maximum(qp, big_l)) + 1e-6)  # [T, S]
        hidden = jnp.maximum(z[..., None] * p["fire_fc1_kernel"] + p["fire_fc1_bias"], 0.0)  # [T, S, 32]
        heads = jnp.einsum("tsw,wn->nts", hidden, p["fire_fc2_kernel"]) + p["fire_fc2_bias"][:, None, None]
        return heads[None]
    # fox: sum_{l = j+1 .. i} log sigmoid(w . x_l + b), as that sum (no cumulative-sum trick)
    log_f = jnp.log(jax.nn.sigmoid(jnp.einsum("ble,en->bln", x, p["fox_gate"]) + p["fox_gate_bias"]))  # [B, L, N]
    t, s, idx = x.shape[1], x.shape[1], jnp.arange(x.shape[1])
    between = (idx[None, None, :] > jnp.arange(s)[None, :, None]) & (idx[None, None, :] <= jnp.arange(t)[:, None, None])
    return jnp.einsum("tsl,bln->bnts", between.astype(x.dtype), log_f)  # [B, N, T, S]


def ref_layer(p, x, enc, kv_heads, causal, positions):
    """The whole layer in float64: projections, GQA, scaled logits plus the bias, softmax."""
    proj = lambda name: jnp.einsum("bte,enh->btnh", x, p[name]["kernel"]) + p[name]["bias"]
    g = N // kv_heads
    q, k, v = proj("q_proj"), jnp.repeat(proj("k_proj"), g, 2), jnp.repeat(proj("v_proj"), g, 2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H) + ref_bias(enc, p, x, positions, positions)
    t = x.shape[1]
    if causal:
        logits = jnp.where(jnp.arange(t)[None, :] <= jnp.arange(t)[:, None], logits, -jnp.inf)
    out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)
    return jnp.einsum("btnh,nhe->bte", out, p["out_proj"]["kernel"]) + p["out_proj"]["bias"]


def make(enc, kv_heads=2, **kw):
    return PositionalAttention(num_heads=N, kv_num_heads=kv_heads, head_dim=H, position_encoding=enc, **kw)


def init(module, rng, x, causal=True):
    """Params with every parameter random, so no term hides behind its init (e.g. zero biases)."""
    key = jax.random.PRNGKey(int(rng.integers(2**31)))
    params = nn.meta.unbox(jax.jit(lambda k: module.init(k, x, is_causal=causal))(key)["params"])
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        params[proj]["bias"] = jnp.asarray(rng.normal(size=params[proj]["bias"].shape) * 0.1, jnp.float32)
    if "fox_gate" in params:  # gates spread over (0, 1), some near 1
        params["fox_gate"] = jnp.asarray(rng.normal(size=params["fox_gate"].shape) * 0.3, jnp.float32)
        params["fox_gate_bias"] = jnp.asarray(rng.uniform(-1.0, 4.0, size=(N,)), jnp.float32)
    if "kerple_r1_raw" in params:
        for name in ("kerple_r1_raw", "kerple_r2_raw"):
            params[name] = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
    if "fire_c" in params:  # c, L away from their inits; L below the positions so max(L, i) switches
        params["fire_c"] = jnp.asarray(rng.uniform(0.05, 2.0), jnp.float32)
        params["fire_L_multiplier"] = jnp.asarray(rng.uniform(0.005, 0.02), jnp.float32)  # L ~ 2.5-10
    return params


def reference(params, x, enc, kv_heads, causal, positions, cotangent):
    """``(values, gradient of sum(values * cotangent) w.r.t. params)`` in float64."""
    with jax.enable_x64(True):
        p64 = jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a), jnp.float64), params)
        x64, pos64 = jnp.asarray(np.asarray(x), jnp.float64), jnp.asarray(positions, jnp.float64)
        f = lambda p: ref_layer(p, x64, enc, kv_heads, causal, pos64)
        cot = jnp.asarray(cotangent, jnp.float64)
        value, grad = jax.jit(lambda p: (f(p), jax.grad(lambda p_: jnp.sum(f(p_) * cot))(p)))(p64)
        return np.asarray(value), jax.tree_util.tree_map(np.asarray, grad)


def value_and_grad(module, params, cotangent, *args, **kwargs):
    """The layer's float32 output and the gradient of ``sum(out * cotangent)``, jitted."""
    f = lambda p: module.apply({"params": p}, *args, **kwargs)
    return jax.jit(lambda p: (f(p), jax.grad(lambda p_: jnp.sum(f(p_) * cotangent))(p)))(params)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def assert_grads_close(grads, ref_grads, tol):
    """Each leaf within ``tol`` of the largest reference gradient entry (a leaf can be exactly
    zero, e.g. FIRE's per-head output bias, a softmax-invariant constant)."""
    flat, ref_flat = jax.tree_util.tree_leaves_with_path(grads), dict(jax.tree_util.tree_leaves_with_path(ref_grads))
    assert len(flat) == len(ref_flat)
    scale = max(float(np.max(np.abs(g))) for g in ref_flat.values())
    for path, g in flat:
        err = float(np.max(np.abs(np.asarray(g, np.float64) - ref_flat[path]))) / scale
        assert err <= tol, (jax.tree_util.keystr(path), err)


# ----------------------------------------------------------------------------------------------
# Values and gradients, GQA, offsets
# ----------------------------------------------------------------------------------------------


# (encoding, causal, kv heads): each encoding with GQA, the bias encodings both causal and
# bidirectional (FoX is causal only: test_kernel_rules; FoX without GQA:
# test_fox_runs_exactly_on_every_cpu_kernel). The second pair is slow only for the suite's budget.
CASES = [("fire", False, 2), ("kerple_log", True, 2), ("fox", True, 2),
         pytest.param("fire", True, N, marks=SLOW_CASE),
         pytest.param("kerple_log", False, N, marks=SLOW_CASE)]


@pytest.mark.parametrize("enc,causal,kv_heads", CASES)
def test_values_and_gradients_match_float64_reference(enc, causal, kv_heads, rng):
    b, t = 2, 10
    x = jnp.asarray(rng.normal(size=(b, t, E)), jnp.float32)
    offset = int(rng.integers(0, 40))
    module = make(enc, kv_heads)
    params = init(module, rng, x, causal)
    cot = rng.normal(size=(b, t, E))
    y, grads = value_and_grad(module, params, cot, x, is_causal=causal, position_offset_q=offset,
                              position_offset_k=offset)
    # FoX ignores positions: its reference has none to shift.
    positions = np.arange(t, dtype=np.float64) + (0 if enc == "fox" else offset)
    ref_y, ref_grads = reference(params, x, enc, kv_heads, causal, positions, cot)
    assert rel_err(y, ref_y) <= 1e-5
    assert_grads_close(grads, ref_grads, 2e-4)


def test_fox_ignores_positions(rng):
    """Offsets and explicit positions mean nothing to FoX (its bias is data-dependent)."""
    x = jnp.asarray(rng.normal(size=(2, 9, E)), jnp.float32)
    module = make("fox")
    params = init(module, rng, x)
    f = jax.jit(lambda p, **kw: module.apply({"params": p}, x, is_causal=True, **kw))
    base = f(params)
    shifted = f(params, position_offset_q=17, position_offset_k=17)
    perm = jnp.asarray(rng.permutation(50)[:9])
    explicit = f(params, q_positions=perm, k_positions=perm)
    np.testing.assert_array_equal(np.asarray(shifted), np.asarray(base))
    np.testing.assert_array_equal(np.asarray(explicit), np.asarray(base))


# ----------------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("enc", ["fire", pytest.param("kerple_log", marks=SLOW_CASE), "fox"])  # kerple: fire's path
def test_decode_equals_full_forward(enc, rng):
    """Prefill 4 tokens, one token, then a chunk of 4; equals the full causal forward."""
    b, t = 2, 9
    x = jnp.asarray(rng.normal(size=(b, t, E)), jnp.float32)
    full = make(enc)
    params = init(full, rng, x)
    ref = jax.jit(lambda p: full.apply({"params": p}, x, is_causal=True))(params)
    dec = make(enc, decode=True)
    cache = jax.jit(lambda: dec.init(jax.random.PRNGKey(0), x, is_causal=True))()["cache"]
    if enc == "fox":
        assert cache["fox_log_forget_sum"].shape == (b, N)
    step = jax.jit(lambda c, xc: dec.apply({"params": params, "cache": c}, xc, is_causal=True, mutable=["cache"]))
    outs = []
    for lo, hi in ((0, 4), (4, 5), (5, 9)):
        y, state = step(cache, x[:, lo:hi])
        cache = state["cache"]
        outs.append(y)
    assert int(cache["cache_index"]) == t
    assert rel_err(jnp.concatenate(outs, axis=1), ref) <= 1e-5
    if enc == "fox":  # the running sum is c of the last token: the sum of every log gate so far
        log_f = jax.nn.log_sigmoid(x @ params["fox_gate"] + params["fox_gate_bias"])  # [B, T, N]
        np.testing.assert_allclose(cache["fox_log_forget_sum"], log_f.sum(1), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Kernels, errors, logical axes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["flash", "dense", "splash_interpret"])
def test_fox_runs_exactly_on_every_cpu_kernel(implementation, rng):
    """The packed forget gate is ``logits + (c_i - c_j)`` on every kernel ('xla', the automatic
    choice on CPU, in test_values_and_gradients_match_float64_reference; 128 tokens: one whole
    splash block). Without GQA here, with it there."""
    b, t = 1, 128
    x = jnp.asarray(rng.normal(size=(b, t, E)), jnp.float32)
    module = make("fox", kv_heads=N, implementation=implementation)
    params = init(module, rng, x)
    cot = rng.normal(size=(b, t, E))
    ref_y, ref_grads = reference(params, x, "fox", N, True, np.arange(t, dtype=np.float64), cot)
    if implementation != "dense":  # gradients once (kernels' own backward passes: tests/test_flash.py)
        assert rel_err(jax.jit(lambda p: module.apply({"params": p}, x, is_causal=True))(params), ref_y) <= 1e-5
        return
    y, grads = value_and_grad(module, params, cot, x, is_causal=True)
    assert rel_err(y, ref_y) <= 1e-5
    assert_grads_close(grads, ref_grads, 2e-4)


def test_kernel_rules(rng):
    x = jnp.asarray(rng.normal(size=(1, 8, E)), jnp.float32)
    for enc in ("fire", "kerple_log"):
        for impl in ("flash", "splash_interpret"):
            with pytest.raises(ValueError, match=rf"position_encoding='{enc}' adds a materialized \[N, T, S\] "
                                                 rf"bias, which implementation='{impl}' .*use 'xla' or 'dense'"):
                make(enc, implementation=impl).init(jax.random.PRNGKey(0), x, is_causal=True)
    with pytest.raises(ValueError, match=r"position_encoding='fox' needs is_causal=True: its packed bias drops"):
        make("fox").init(jax.random.PRNGKey(0), x, is_causal=False)


EXPECTED_AXES = {
    "fire": {"fire_c": (), "fire_L_multiplier": (), "fire_fc1_kernel": (None,), "fire_fc1_bias": (None,),
             "fire_fc2_kernel": (None, "heads"), "fire_fc2_bias": ("heads",)},
    "kerple_log": {"kerple_r1_raw": ("heads",), "kerple_r2_raw": ("heads",)},
    "fox": {"fox_gate": ("embed", "heads"), "fox_gate_bias": ("heads",)},
}


@pytest.mark.parametrize("enc", ENCODINGS)
def test_new_params_have_logical_axes_and_paper_inits(enc, rng):
    x = jnp.asarray(rng.normal(size=(1, 8, E)), jnp.float32)
    module = make(enc, fox_gate_bias_init=3.0)
    boxed = jax.jit(lambda k: module.init(k, x, is_causal=True))(jax.random.PRNGKey(int(rng.integers(2**31))))["params"]
    new = {k: v for k, v in boxed.items() if not k.endswith("_proj")}
    assert set(new) == set(EXPECTED_AXES[enc])
    for name, box in new.items():
        assert isinstance(box, nn.LogicallyPartitioned), name
        assert box.names == EXPECTED_AXES[enc][name] and len(box.names) == box.value.ndim, name
    p = nn.meta.unbox(new)
    if enc == "fire":  # c = 0.1, L = 512, PyTorch Linear init bounds 1 and 1/sqrt(32)
        assert float(p["fire_c"]) == pytest.approx(0.1) and float(p["fire_L_multiplier"]) == 1.0
        assert np.abs(p["fire_fc1_kernel"]).max() <= 1.0 and np.abs(p["fire_fc2_kernel"]).max() <= 32 ** -0.5
    elif enc == "kerple_log":  # r1 in [0.01, 2), r2 in [0.01, 1)
        r1, r2 = (np.log1p(np.exp(np.asarray(p[k], np.float64))) for k in ("kerple_r1_raw", "kerple_r2_raw"))
        assert (r1 >= 0.01 - 1e-6).all() and (r1 < 2).all() and (r2 >= 0.01 - 1e-6).all() and (r2 < 1).all()
    else:  # N(0, 0.02) weights, the configured bias
        assert np.abs(p["fox_gate"]).max() < 0.02 * 6 and np.all(np.asarray(p["fox_gate_bias"]) == 3.0)


def test_lm_offers_the_encodings_and_passes_the_gate_bias():
    from goat_jax.models import lm

    for enc in ENCODINGS:
        assert enc in lm.POSITION_ENCODINGS
    cfg = lm.LMConfig(position_encoding="fox", fox_gate_bias_init=2.5)
    attn = lm.make_attention(cfg, decode=False)
    assert attn.position_encoding == "fox" and attn.settings.fox_gate_bias_init == 2.5
    attn = lm.make_attention(lm.LMConfig(position_encoding="fire", fire_threshold_init=64.0), decode=False)
    assert attn.settings.fire_threshold_init == 64.0
    with pytest.raises(ValueError, match="fire_threshold_init"):
        lm.LMConfig(position_encoding="fire", fire_threshold_init=0.0).validate()


def test_fire_threshold_init_sets_the_initial_L(rng):
    """fire_threshold_init: the initial L (multiplier L / 512), so at init the normalizer is
    psi(max(64, i)): queries at positions 60-69 cross it, and the layer equals the float64
    reference there, values and gradients."""
    b, t = 1, 10
    x = jnp.asarray(rng.normal(size=(b, t, E)), jnp.float32)
    module = make("fire", fire_threshold_init=64.0)
    params = nn.meta.unbox(jax.jit(lambda k: module.init(k, x, is_causal=True))(
        jax.random.PRNGKey(int(rng.integers(2**31))))["params"])
    assert float(params["fire_L_multiplier"]) == 64.0 / 512.0
    cot = rng.normal(size=(b, t, E))
    y, grads = value_and_grad(module, params, cot, x, is_causal=True, position_offset_q=60, position_offset_k=60)
    ref_y, ref_grads = reference(params, x, "fire", 2, True, np.arange(t, dtype=np.float64) + 60, cot)
    assert rel_err(y, ref_y) <= 1e-5
    assert_grads_close(grads, ref_grads, 2e-4)


# ----------------------------------------------------------------------------------------------
# FoX in bf16 at long context (as tests/test_bf16.py for GOAT)
# ----------------------------------------------------------------------------------------------


def _fox_chunked_outputs(module, params, x, chunk):
    """Decodes ``x`` in chunks (every chunk attends over the whole cache so far); float64 [T, E]."""
    dec = module.clone(decode=True)
    shapes = jax.eval_shape(lambda: dec.init(jax.random.PRNGKey(0), x, is_causal=True))["cache"]
    cache = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    step = jax.jit(lambda c, xc: dec.apply({"params": params, "cache": c}, xc, is_causal=True, mutable=["cache"]))
    outs = []
    for lo in range(0, x.shape[1], chunk):
        y, state = step(cache, x[:, lo:lo + chunk])
        cache = state["cache"]
        outs.append(y)
    return np.asarray(jnp.concatenate(outs, axis=1).astype(jnp.float32), np.float64)[0]


def _window_errors(out, ref):
    err = np.linalg.norm(out - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    return np.convolve(err, np.ones(100) / 100, mode="valid")


def fox_bf16_errors(rng, monkeypatch, length, chunk):
    """Mean relative output error (windows of 100 positions) of a bf16 FoX layer vs the same
    layer in float32, with the exact 3-channel split and with a single bf16 channel."""
    e = 128
    module = PositionalAttention(num_heads=2, position_encoding="fox", fox_gate_bias_init=4.0,
                                 implementation="xla")  # f ~ 0.98: a long memory, c_j ~ -0.02 j
    x = jnp.asarray(rng.normal(size=(1, length, e)), jnp.float32)
    params = jax.jit(lambda k: module.init(k, x[:, :16], is_causal=True))(jax.random.PRNGKey(int(rng.integers(1 << 30))))["params"]
    ref = _fox_chunked_outputs(module, params, x, chunk)
    bf16 = module.clone(dtype=jnp.bfloat16)
    ours = _window_errors(_fox_chunked_outputs(bf16, params, x.astype(jnp.bfloat16), chunk), ref)
    monkeypatch.setattr(layer_lib, "default_sink_channels", lambda dtype: 1)  # one rounded channel
    single = _window_errors(_fox_chunked_outputs(bf16, params, x.astype(jnp.bfloat16), chunk), ref)
    return ours, single


def test_fox_bf16_error_at_2k(rng, monkeypatch):
    ours, single = fox_bf16_errors(rng, monkeypatch, 2048, 1024)
    print(f"fox bf16 @2k: split max {ours.max():.4f}, single channel last-1000 mean {single[-1000:].mean():.4f}")
    assert ours.max() <= 0.01, (ours.max(), int(ours.argmax()))
    assert single[-1000:].mean() > 2 * ours[-1000:].mean()  # the split is what keeps it accurate


@pytest.mark.slow(reason="decodes 16,384 positions in chunks; the 2048-position variant runs in the default suite")
def test_fox_bf16_error_at_16k(rng, monkeypatch):
    ours, single = fox_bf16_errors(rng, monkeypatch, 16384, 2048)
    print(f"fox bf16 @16k: split max {ours.max():.4f}, single channel last-1000 mean {single[-1000:].mean():.4f}")
    assert ours.max() <= 0.01, (ours.max(), int(ours.argmax()))
    assert single[-1000:].mean() > 0.05
