"""'ntk' and 'yarn' (goat_jax/positional/rope_scaling.py) and log-n scaling (goat_jax/layers/linen.py)
against Hugging Face transformers' ``modeling_rope_utils`` and independent float64 references."""

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax.models import lm
from goat_jax.layers.positional import PositionalAttention
from goat_jax.positional import rope_scaling as rs
from tests import goat_reference as goat_ref
from tests import jitted
from tests.marks import SLOW_CASE
from goat_jax.kernels.plan import AttentionPlan

E, N, H = 32, 4, 16  # model dim, query heads, head dim
BASE = 100.0  # a small base puts YaRN's ramp inside the 8 pairs at these training lengths
TRAIN = 32


@pytest.fixture
def rng():
    seed = time.time_ns() % 2**32
    print(f"test_rope_scaling seed={seed}")
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------------------------
# float64 references: frequencies as Hugging Face defines them, attention written out
# ----------------------------------------------------------------------------------------------


def np_ntk(dim, base, f):
    """Dynamic NTK (alpha = 1): base * f^(dim / (dim - 2))."""
    return (base * f ** (dim / (dim - 2))) ** (-np.arange(0, dim, 2) / dim)


def np_yarn(dim, base, f, length, fast=32.0, slow=1.0):
    """YaRN as transformers computes it: a linear ramp over the pair index between the indices
    where a pair turns ``fast`` / ``slow`` times over ``length`` tokens (floor / ceil)."""
    theta = base ** (-np.arange(0, dim, 2) / dim)
    at = lambda r: dim * np.log(length / (2 * np.pi * r)) / (2 * np.log(base))
    lo, hi = max(np.floor(at(fast)), 0), min(np.ceil(at(slow)), dim - 1)
    hi = hi + 1e-3 if lo == hi else hi
    w = np.clip((np.arange(dim // 2) - lo) / (hi - lo), 0, 1)  # 1: interpolate
    return theta * (1 - w) + theta / f * w, (0.1 * np.log(f) + 1 if f > 1 else 1.0)


def np_rotate(x, p, theta):
    h = x.shape[-1]
    z = (x[..., : h // 2] + 1j * x[..., h // 2:]) * np.exp(1j * p[:, None, None] * theta)
    return np.concatenate([z.real, z.imag], axis=-1)


def _softmax_out(logits, v, w):
    """float64 softmax over keys, the weighted values and the layer's output projection."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", p, v)
    return np.einsum("btnh,nhe->bte", out, np.asarray(w["out_proj"]["kernel"], np.float64)) + np.asarray(
        w["out_proj"]["bias"], np.float64)


def np_layer(params, x, enc, kv, causal, pos, f, logn=None, length=TRAIN):
    """Float64 PositionalAttention forward for 'rope'/'ntk'/'yarn' at factor f (trained at
    ``length``); ``logn``: per-query factors multiplying the logits."""
    w = nn.meta.unbox(params)
    x = np.asarray(x, np.float64)
    proj = lambda name: np.einsum("bte,enh->btnh", x, np.asarray(w[name]["kernel"], np.float64)) + np.asarray(
        w[name]["bias"], np.float64)
    q, k, v = proj("q_proj"), proj("k_proj"), proj("v_proj")
    theta, temp = BASE ** (-np.arange(0, H, 2) / H), 1.0
    if enc == "ntk":
        theta = np_ntk(H, BASE, f)
    elif enc == "yarn":
        theta, temp = np_yarn(H, BASE, f, length)
    q, k = np_rotate(q, pos, theta) * temp, np_rotate(k, pos, theta) * temp
    k, v = np.repeat(k, N // kv, axis=2), np.repeat(v, N // kv, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    if logn is not None:
        logits = logits * logn[:, None]
    t = x.shape[1]
    if causal:
        logits = np.where(np.arange(t)[None, :] <= np.arange(t)[:, None], logits, -np.inf)
    return _softmax_out(logits, v, w)


def np_logn(pos, causal, s, length):
    n = pos + 1 if causal else np.full_like(pos, s)
    return np.maximum(1.0, np.log(n) / np.log(length))


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def make(enc, kv=N, **kw):
    kw.setdefault("training_seq_len", TRAIN)
    return PositionalAttention(num_heads=N, kv_num_heads=kv, head_dim=H, position_encoding=enc, rope_base=BASE, **kw)


def init(module, rng, x, **kw):
    params = nn.meta.unbox(jitted.init(module, jax.random.PRNGKey(int(rng.integers(2**31))), x, **kw)["params"])
    params["q_proj"]["bias"] = jnp.asarray(rng.normal(size=params["q_proj"]["bias"].shape) * 0.1, jnp.float32)
    return params


# ----------------------------------------------------------------------------------------------
# Frequencies and attention factor vs transformers
# ----------------------------------------------------------------------------------------------

CONFIGS = [(16, 100.0, 2.0, 32), (64, 10_000.0, 4.0, 2048), (128, 500_000.0, 8.0, 8192), (32, 10_000.0, 1.5, 64),
           (128, 1_000_000.0, 32.0, 4096)]  # (head_dim, base, factor, original max position)


def _hf_config(dim, base, params, max_pos):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=dim * 2, num_attention_heads=2, head_dim=dim, max_position_embeddings=max_pos,
                       rope_parameters={"rope_theta": base, **params})


@pytest.mark.parametrize("dim,base,factor,length", CONFIGS)
def test_frequencies_match_transformers(dim, base, factor, length):
    """Inverse frequencies and attention factor of 'yarn' (static, at the factor) and of 'ntk'
    (HF's 'dynamic' with factor alpha = 1 at seq_len = factor x the training length)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _hf_config(dim, base, {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": length},
                    length)
    hf_freq, hf_att = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ours, mscale = rs.yarn_frequencies(dim, base, factor, length)
    np.testing.assert_allclose(ours, hf_freq.double().numpy(), rtol=2e-6)
    np.testing.assert_allclose(ours, np_yarn(dim, base, factor, length)[0], rtol=1e-12)
    assert mscale == pytest.approx(hf_att, rel=1e-12)
    # The ramp is not degenerate in every config: some pairs kept, some interpolated.
    theta = base ** (-np.arange(0, dim, 2) / dim)
    assert np.isclose(ours, theta).any() and np.isclose(ours, theta / factor).any()

    seq = int(round(factor * length))
    hf = _hf_config(dim, base, {"rope_type": "dynamic", "factor": 1.0}, length)
    hf_freq, hf_att = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=seq)
    ours = rs.ntk_frequencies(dim, base, seq / length)
    np.testing.assert_allclose(ours, hf_freq.double().numpy(), rtol=2e-6)
    np.testing.assert_allclose(ours, np_ntk(dim, base, seq / length), rtol=1e-12)
    assert hf_att == 1.0
    # Dynamic below the training length: HF keeps the base, as our factor max(1, .) = 1 does.
    hf_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=length // 2)
    np.testing.assert_allclose(rs.ntk_frequencies(dim, base, 1.0), hf_freq.double().numpy(), rtol=2e-6)


def test_yarn_beta_fields_move_the_ramp():
    a, _ = rs.yarn_frequencies(64, 10_000.0, 4.0, 2048)
    b, _ = rs.yarn_frequencies(64, 10_000.0, 4.0, 2048, beta_fast=8.0, beta_slow=2.0)
    np.testing.assert_allclose(b, np_yarn(64, 10_000.0, 4.0, 2048, 8.0, 2.0)[0], rtol=1e-12)
    assert not np.allclose(a, b)


# ----------------------------------------------------------------------------------------------
# The layer vs the float64 reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("enc,causal,kv,factor", [("ntk", True, N, None), ("yarn", False, 2, None),
                                                  ("yarn", True, 2, 3.0),
                                                  pytest.param("ntk", False, 2, 3.0, marks=SLOW_CASE)])
def test_layer_matches_reference(enc, causal, kv, factor, rng):
    """Dynamic (the key length 2.5x the training length) and fixed factors, GQA, an offset."""
    t = 80 if factor is None else 12
    x = jnp.asarray(rng.normal(size=(2, t, E)), jnp.float32)
    module = make(enc, kv, rope_scaling_factor=factor)
    params = init(module, rng, x, is_causal=causal)
    offset = int(rng.integers(0, 50))
    y = jitted.apply(module, {"params": params}, x, is_causal=causal, position_offset_q=offset, position_offset_k=offset)
    f = t / TRAIN if factor is None else factor
    pos = offset + np.arange(t, dtype=np.float64)
    assert rel_err(y, np_layer(params, x, enc, kv, causal, pos, f)) <= 2e-5
    assert rel_err(y, np_layer(params, x, "rope", kv, causal, pos, 1.0)) > 1e-3  # the scaling acts


@pytest.mark.parametrize("enc", ["ntk", "yarn"])
def test_factor_one_is_rope_exactly(enc, rng):
    x = jnp.asarray(rng.normal(size=(2, TRAIN, E)), jnp.float32)
    params = init(make("rope"), rng, x, is_causal=True)
    rope = make("rope").apply({"params": params}, x, is_causal=True)
    for kw in ({}, {"rope_scaling_factor": 1.0}):
        np.testing.assert_array_equal(make(enc, **kw).apply({"params": params}, x, is_causal=True), rope)


def test_parameters_and_sharding_names_are_rope_s(rng):
    x = jnp.zeros((1, 8, E))
    names = lambda enc: jax.tree_util.tree_map(
        lambda b: b.names, make(enc, 2).init(jax.random.PRNGKey(0), x)["params"],
        is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))
    assert names("yarn") == names("ntk") == names("rope")
    assert names("yarn")["k_proj"]["kernel"] == ("embed", "kv_heads", "kv")


def _decode(module_full, module_dec, params, x):
    ref = module_full.apply({"params": params}, x, is_causal=True)
    cache = module_dec.init(jax.random.PRNGKey(0), x, is_causal=True)["cache"]
    step = jax.jit(lambda c, xt: module_dec.apply({"params": params, "cache": c}, xt, is_causal=True,
                                                  mutable=["cache"]))
    outs = []
    for lo, hi in [(0, 5)] + [(i, i + 1) for i in range(5, x.shape[1])]:
        y, new = step(cache, x[:, lo:hi])
        cache = new["cache"]
        outs.append(y)
    return jnp.concatenate(outs, axis=1), ref


@pytest.mark.parametrize("enc,kw", [("yarn", {}), ("rope", {"logn_scaling": "all"}),
                                    pytest.param("ntk", {"logn_scaling": "content"}, marks=SLOW_CASE)])
def test_decode_equals_full_forward(enc, kw, rng):
    """The dynamic factor follows the cache length (the full forward's), log-n the position."""
    x = jnp.asarray(rng.normal(size=(2, 2 * TRAIN, E)), jnp.float32)
    full = make(enc, 2, **kw)
    params = init(full, rng, x, is_causal=True)
    out, ref = _decode(full, make(enc, 2, decode=True, **kw), params, x)
    assert rel_err(out, ref) <= 1e-5


def test_gradients_match_float64_finite_differences(rng):
    """d(loss)/dx along a random direction, yarn with log-n, vs float64 central differences."""
    t = 48
    x = jnp.asarray(rng.normal(size=(1, t, E)), jnp.float32)
    module = make("yarn", 2, logn_scaling="content", training_seq_len=16)
    params = init(module, rng, x, is_causal=True)
    w = rng.normal(size=(1, t, E))
    direction = rng.normal(size=x.shape)
    grad = jax.jit(jax.grad(lambda xx: jnp.sum(module.apply({"params": params}, xx, is_causal=True) * w)))(x)
    pos = np.arange(t, dtype=np.float64)
    logn = np_logn(pos, True, t, 16)
    f64 = lambda xx: np.sum(np_layer(params, xx, "yarn", 2, True, pos, t / 16, logn, length=16) * w)
    eps = 1e-5
    fd = (f64(np.asarray(x, np.float64) + eps * direction) - f64(np.asarray(x, np.float64) - eps * direction)) / (2 * eps)
    assert float(np.sum(np.asarray(grad, np.float64) * direction)) == pytest.approx(fd, rel=1e-4)


# ----------------------------------------------------------------------------------------------
# log-n scaling
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("enc,causal", [("rope", True), pytest.param("yarn", False, marks=SLOW_CASE),
                                        pytest.param("alibi", True, marks=SLOW_CASE)])
def test_logn_matches_reference(enc, causal, rng):
    """Per-query factors ln(p + 1) / ln L causally (positions with an offset), ln S / ln L
    otherwise. For 'alibi' (a materialized bias) 'content' leaves the bias alone, 'all' scales it."""
    t = 40
    x = jnp.asarray(rng.normal(size=(2, t, E)), jnp.float32)
    offset = int(rng.integers(0, 30)) if causal else 0
    pos = offset + np.arange(t, dtype=np.float64)
    factors = np_logn(pos, causal, t, 8)
    for mode in ("content", "all"):
        module = make(enc, 2, training_seq_len=8, logn_scaling=mode)
        params = init(module, rng, x, is_causal=causal)
        y = jitted.apply(module, {"params": params}, x, is_causal=causal, position_offset_q=offset,
                         position_offset_k=offset)
        if enc == "alibi":
            ref = _np_alibi(params, x, pos, factors, mode)
        else:
            ref = np_layer(params, x, enc, 2, causal, pos, 1.0 if enc == "rope" else t / 8, factors, length=8)
        assert rel_err(y, ref) <= 2e-5, mode
    assert factors.max() > 1.2  # the test reaches past the training length


def _np_alibi(params, x, pos, factors, mode):
    w = nn.meta.unbox(params)
    x = np.asarray(x, np.float64)
    proj = lambda name: np.einsum("bte,enh->btnh", x, np.asarray(w[name]["kernel"], np.float64)) + np.asarray(
        w[name]["bias"], np.float64)
    q, k, v = proj("q_proj"), np.repeat(proj("k_proj"), 2, axis=2), np.repeat(proj("v_proj"), 2, axis=2)
    slopes = 2.0 ** (-8.0 * np.arange(1, N + 1) / N)
    bias = -slopes[:, None, None] * np.abs(pos[:, None] - pos[None, :])
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H) * factors[:, None]
    logits = logits + (bias * factors[:, None] if mode == "all" else bias)
    t = x.shape[1]
    logits = np.where(np.arange(t)[None, :] <= np.arange(t)[:, None], logits, -np.inf)
    return _softmax_out(logits, v, w)


@pytest.mark.parametrize("mode,impl", [("content", "xla"), ("all", "xla"),
                                       pytest.param("content", "dense", marks=SLOW_CASE),
                                       pytest.param("all", "dense", marks=SLOW_CASE)])
def test_logn_goat_matches_reference(mode, impl, rng):
    """GOAT: 'content' scales q_c . k_c / sqrt(d_c), 'all' the prior (Fourier + sink) too; on
    the packed path ('xla') and the materialized-prior path ('dense')."""
    t, length = 40, 8
    cfg = dict(num_heads=4, kv_num_heads=2, head_dim=16, pos_rank=2, abs_rank=2, training_seq_len=length)
    module = goat_ref.goat_module(**cfg, logn_scaling=mode, implementation=impl)
    x = jnp.asarray(rng.normal(size=(2, t, E)), jnp.float32)
    params = jitted.init(module, jax.random.PRNGKey(int(rng.integers(2**31))), x, is_causal=True)
    offset = int(rng.integers(0, 30))
    y = jitted.apply(module, params, x, is_causal=True, position_offset_q=offset, position_offset_k=offset)
    factors = np_logn(offset + np.arange(t, dtype=np.float64), True, t, length)
    kw = dict(is_causal=True, offset_q=offset, offset_k=offset)
    ref = goat_ref.goat_attention(params, cfg, x, x, x, logn=factors, logn_mode=mode, **kw)
    assert rel_err(y, ref) <= 2e-5
    other = goat_ref.goat_attention(params, cfg, x, x, x, logn=factors, logn_mode={"all": "content"}.get(mode, "all"), **kw)
    assert rel_err(other, ref) > 1e-4  # the two modes differ here


@SLOW_CASE  # the CPU flash kernel compiles slowly; the packed xla path is tested above
def test_flash_kernel_runs_yarn_with_logn(rng):
    x = jnp.asarray(rng.normal(size=(1, 64, E)), jnp.float32)
    module = make("yarn", 2, logn_scaling="all", training_seq_len=16)
    params = init(module, rng, x, is_causal=True)
    a = module.apply({"params": params}, x, is_causal=True)
    b = make("yarn", 2, logn_scaling="all", training_seq_len=16, implementation="flash").apply(
        {"params": params}, x, is_causal=True)
    assert rel_err(b, a) <= 1e-5


def test_errors():
    x = jnp.zeros((1, 8, E))
    key = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match="'yarn' needs training_seq_len"):
        make("yarn", training_seq_len=None, rope_scaling_factor=2.0).init(key, x)
    with pytest.raises(ValueError, match="'ntk' needs training_seq_len"):
        make("ntk", training_seq_len=None).init(key, x)
    make("ntk", training_seq_len=None, rope_scaling_factor=2.0).init(key, x)  # a fixed factor needs no length
    with pytest.raises(ValueError, match="rope_scaling_factor=0.5 is out of range: allowed is a number finite in float32 >= 1"):
        make("yarn", rope_scaling_factor=0.5).init(key, x)
    with pytest.raises(ValueError, match="yarn_beta_fast must exceed"):
        make("yarn", rope_scaling_factor=2.0, yarn_beta_fast=1.0, yarn_beta_slow=2.0).init(key, x)
    with pytest.raises(ValueError, match="logn_scaling must be None or one of"):
        make("rope", logn_scaling="yes").init(key, x)
    with pytest.raises(ValueError, match="needs training_seq_len >= 2"):
        make("rope", logn_scaling="content", training_seq_len=None).init(key, x)
    with pytest.raises(ValueError, match="1D"):
        goat_ref.goat_module(num_heads=4, pos_rank=2, pos_encoding="2d", training_seq_len=8,
                             logn_scaling="all").init(key, jnp.zeros((1, 16, E)), spatial_shape=(4, 4))
    with pytest.raises(ValueError, match="even head dim >= 4"):
        rs.ntk_frequencies(2, 10_000.0, 2.0)


def test_lm_config_fields_and_model(rng):
    with pytest.raises(ValueError, match="'yarn' needs training_seq_len"):  # the layer's check (YarnSettings)
        lm.LMConfig(position_encoding="yarn")
    with pytest.raises(ValueError, match="logn_scaling='all' needs model.training_seq_len"):
        lm.LMConfig(position_encoding="goat", logn_scaling="all")
    with pytest.raises(ValueError, match="rope_scaling_factor=0.5 is out of range"):
        lm.LMConfig(position_encoding="ntk", rope_scaling_factor=0.5)
    with pytest.raises(ValueError, match=r"logn_scaling='x' is not allowed: allowed is one of \['content', 'all'\]"):
        lm.LMConfig(logn_scaling="x", training_seq_len=8)
    assert {"yarn", "ntk"} <= set(lm.POSITION_ENCODINGS)
    cfg = lm.LMConfig(position_encoding="yarn", training_seq_len=8, logn_scaling="content", rope_scaling_factor=2.0,
                      yarn_beta_fast=16.0, num_layers=1)
    attn = lm.make_attention(cfg, decode=False)
    assert (attn.logn_scaling, attn.settings.rope_scaling_factor, attn.settings.yarn_beta_fast,
            attn.training_seq_len) == ("content", 2.0, 16.0, 8)
    assert lm.make_attention(lm.LMConfig(logn_scaling="all", training_seq_len=8), False).logn_scaling == "all"


# ----------------------------------------------------------------------------------------------
# experiments.evaluate: a RoPE run evaluated with yarn / ntk / log-n on its own parameters
# ----------------------------------------------------------------------------------------------


def _rope_workdir(workdir):
    """A 'rope' smoke run as experiments.train leaves it (config.json + a checkpoint), holding
    N(0, 0.3) parameters: the evaluation path without training."""
    import json
    import os

    from configs import lm_tiny
    from goat_jax.train import checkpoint as checkpoint_lib
    from goat_jax.train import run as run_lib
    from goat_jax.train import tasks
    from tests.config_helpers import random_params

    task = tasks.get_task("lm")
    config = tasks.with_field_defaults(lm_tiny.get_config("rope,smoke"), task)  # as a run has it
    config.progress_bar = False
    model = task.build_model(config, AttentionPlan.from_config(config))
    tx, _ = run_lib.make_optimizer(task, config)
    params = random_params(model, 8, np.random.default_rng(0))
    state = run_lib.TrainState(step=jnp.ones((), jnp.int32), params=params, opt_state=tx.init(params))
    os.makedirs(workdir)
    with open(run_lib.config_path(workdir), "w") as f:
        json.dump(config.to_dict(), f, default=str)
    ckpt = checkpoint_lib.Checkpointer(run_lib.checkpoint_dir(workdir), config.to_dict(), keep=1, async_save=False,
                                       resume_safe_fields=task.resume_safe_fields, field_defaults=tasks.field_defaults(task))
    ckpt.save(1, state, {}, wait=True)
    ckpt.close()
    return workdir


def test_evaluate_swaps_a_rope_run_to_yarn_with_logn(tmp_path):
    """At 1x the training length yarn + log-n is the RoPE run exactly; at 2x it differs; the
    parameters are the run's own."""
    from experiments import evaluate
    from goat_jax.eval import lm_run, runs

    workdir = _rope_workdir(str(tmp_path / "rope"))
    got = evaluate.main(["--workdir", workdir, "--evals", "extrapolation", "--multipliers", "1,2",
                         "--position_encoding", "yarn", "--logn_scaling", "content", "--out", str(tmp_path / "o")])
    assert list(got) == ["rope as yarn+logn_content"]
    swapped = got["rope as yarn+logn_content"]["extrapolation"]
    run = lm_run.load_lm_run(workdir)
    plain = runs.eval_extrapolation(run, (1, 2))
    n = run.train_len
    assert swapped[n]["ppl"] == pytest.approx(plain[n]["ppl"], rel=1e-6)
    assert abs(swapped[2 * n]["ppl"] - plain[2 * n]["ppl"]) > 1e-3 * plain[2 * n]["ppl"]
    as_ntk = lm_run.swap_encoding(run, "ntk")
    assert as_ntk.params is run.params and as_ntk.model.config.position_encoding == "ntk"
    assert run.model.config.position_encoding == "rope"  # the loaded run is left as it was


def test_evaluate_refuses_swaps_that_do_not_share_parameters(tmp_path):
    import json

    from experiments import evaluate

    def bare(name, encoding, **model):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"task": "lm", "seq_len": 64, "model": {
            "position_encoding": encoding, **model}}))
        return str(path)

    cases = [(bare("goat", "goat"), ["--position_encoding", "yarn"], "only 'rope' runs can be evaluated as"),
             (bare("rope", "rope"), ["--position_encoding", "alibi"], r"a 'rope' run takes 'yarn', 'ntk', 'rope_pi'"),
             (bare("goat_nolen", "goat", training_seq_len=None), ["--logn_scaling", "all"],
              "left unset; setting it now would also change its sink")]
    for workdir, flags, match in cases:
        with pytest.raises(ValueError, match=match):
            evaluate.main(["--workdir", workdir, "--evals", "extrapolation", "--out", str(tmp_path / "o"), *flags])
    assert not (tmp_path / "o").exists()


@pytest.mark.slow(reason="compiles log-n attention in bf16 at long lengths (~20 s of an idle core)")
def test_logn_all_refuses_packed_channels_in_bf16(rng):
    """'all' in bfloat16 would round GOAT's packed sink channels times the factor: refused before
    any work, naming the two fixes; 'content' in bf16 and 'all' in float32 run."""
    cfg = dict(num_heads=2, kv_num_heads=2, head_dim=16, pos_rank=2, abs_rank=2, training_seq_len=8)
    x = jnp.asarray(rng.normal(size=(1, 16, E)), jnp.float32)
    params = goat_ref.goat_module(**cfg, logn_scaling="all").init(jax.random.PRNGKey(0), x, is_causal=True)
    with pytest.raises(ValueError, match=r"logn_scaling='all' with bfloat16.*logn_scaling='content', or dtype float32"):
        goat_ref.goat_module(**cfg, logn_scaling="all", dtype=jnp.bfloat16).apply(params, x, is_causal=True)
    y = goat_ref.goat_module(**cfg, logn_scaling="content", dtype=jnp.bfloat16).apply(params, x, is_causal=True)
    assert bool(jnp.all(jnp.isfinite(y)))
    # A RoPE layer has no packed channels: 'all' runs in bf16.
    module = make("rope", 2, logn_scaling="all", training_seq_len=8, dtype=jnp.bfloat16)
    assert bool(jnp.all(jnp.isfinite(module.apply({"params": init(module, rng, x, is_causal=True)}, x, is_causal=True))))
