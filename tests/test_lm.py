"""Tests for goat_jax.models (LMConfig, TransformerLM, the LM task's model, count_params, FLOPs).

Tiny models (2 layers, d 64, vocab 259) so the suite runs on two CPU cores.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from goat_jax.models import LMConfig, TransformerLM, count_params
from goat_jax.models.lm import POSITION_ENCODINGS, lm_flops_per_token, matmul_params
from goat_jax.kernels.plan import AttentionPlan

# pos_rank 2 leaves 16 - (2*2 + 1) = 11 content dims per head; training_seq_len fixes the sink
# normalization so KV-cache decoding is allowed.
TINY = dict(vocab_size=259, num_layers=2, embed_dim=64, num_heads=4, kv_num_heads=2, mlp_dim=128,
            pos_rank=2, abs_rank=2, training_seq_len=32, max_len=64)


def tiny(**overrides) -> LMConfig:
    return LMConfig(**{**TINY, **overrides})


def tokens(b=2, t=8, seed=1):
    return jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, TINY["vocab_size"], jnp.int32)


def init(model, toks, seed=0):
    """Random params with the model's tree and shapes, filled by numpy: no init compile, which
    dominates these tiny tests (one real init runs in test_shapes_dtypes_and_logical_axes)."""
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), toks))["params"]
    rng = np.random.default_rng(seed)

    def fill(path, x):
        noise = rng.normal(0.0, 0.1, x.shape)
        is_scale = jax.tree_util.keystr(path).endswith("['scale']")  # RMSNorm gains near 1
        return jnp.asarray(1.0 + noise if is_scale else noise, x.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


def assert_rel_close(actual, expected, rel=1e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    err = np.abs(actual - expected).max()
    assert err <= rel * np.abs(expected).max(), f"max abs err {err:.3g} vs scale {np.abs(expected).max():.3g}"


# ----------------------------------------------------------------------------------------------
# Config and registry
# ----------------------------------------------------------------------------------------------


def test_from_config_reads_config_dict_with_string_dtypes():
    cfg = LMConfig.from_config(ml_collections.ConfigDict(dict(TINY, dtype="bfloat16")))
    assert cfg.compute_dtype == jnp.bfloat16 and cfg.weight_dtype == jnp.float32
    assert cfg.kv_heads == 2 and cfg.head_size == 16


def test_from_config_rejects_unknown_fields_by_name():
    with pytest.raises(ValueError, match="num_layer.*typo_field"):
        LMConfig.from_config(ml_collections.ConfigDict(dict(TINY, typo_field=1, num_layer=3)))


@pytest.mark.parametrize("bad, match", [
    (dict(position_encoding="rotary"), "position_encoding"),
    (dict(num_heads=4, kv_num_heads=3), "multiple"),
    (dict(embed_dim=65), "divisible"),
    (dict(dtype="float33"), "dtype"),
])
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny(**bad)


def _task_config(**model):
    return ml_collections.ConfigDict(dict(task="lm", model=dict(TINY, **model)))


def test_the_task_builds_its_model_and_an_old_model_name_is_deprecated():
    from goat_jax.tasks import lm as lm_task  # pylint: disable=g-import-not-at-top

    model = lm_task.build_model(_task_config(), AttentionPlan.from_config(_task_config()))
    assert isinstance(model, TransformerLM) and model.config == tiny()
    with pytest.warns(FutureWarning, match="model.name='lm' is deprecated"):
        assert lm_task.build_model(_task_config(name="lm"), AttentionPlan()).config == tiny()
    with pytest.raises(ValueError, match=r"model.name='vit_xl': task 'lm' builds the model 'lm'"):
        lm_task.build_model(_task_config(name="vit_xl"), AttentionPlan())
    with pytest.raises(ValueError, match="bogus"):
        lm_task.build_model(_task_config(bogus=1), AttentionPlan())


# ----------------------------------------------------------------------------------------------
# Shapes, parameters, FLOPs, sharding names
# ----------------------------------------------------------------------------------------------


def hand_count(cfg: LMConfig) -> int:
    e, h, n, k, f, v, r, m = (cfg.embed_dim, cfg.head_size, cfg.num_heads, cfg.kv_heads, cfg.mlp_dim,
                              cfg.vocab_size, cfg.pos_rank, cfg.abs_rank)
    attn = e * n * h + 2 * e * k * h + n * h * e  # q, k, v, out (no biases)
    if cfg.position_encoding == "goat":
        mlp_in = 2 * m + 2
        hidden = min(2 * mlp_in, 4)
        # lambda_sym/asym [K, R]; gate scale/bias [N]; sink MLP; gain, bump, slope [K]
        attn += 2 * k * r + 2 * n + (mlp_in * hidden + hidden + hidden + 1) + 3 * k
    block = attn + 3 * e * f + 2 * e  # + SwiGLU + two RMSNorm scales
    head = 0 if cfg.tie_embeddings else e * v
    table = cfg.max_len * e if cfg.position_encoding == "learned" else 0
    return v * e + table + cfg.num_layers * block + e + head  # embed, blocks, final norm, head


@pytest.mark.parametrize("overrides", [dict(), dict(tie_embeddings=False),
                                       dict(position_encoding="rope"),
                                       dict(position_encoding="learned")])
def test_param_count_matches_hand_count(overrides):
    cfg = tiny(**overrides)
    assert count_params(TransformerLM(cfg), (1, 8)) == hand_count(cfg)


def test_flops_per_token_hand_count():
    cfg = tiny()
    per_layer = 64 * 4 * 16 + 2 * 64 * 2 * 16 + 4 * 16 * 64 + 3 * 64 * 128
    assert matmul_params(cfg) == 2 * per_layer + 64 * 259
    assert lm_flops_per_token(cfg, 32) == 6 * (2 * per_layer + 64 * 259) + 12 * 2 * 4 * 16 * 32


def test_shapes_dtypes_and_logical_axes():
    model = TransformerLM(tiny())
    boxed = jax.jit(model.init)(jax.random.PRNGKey(0), tokens())["params"]
    logits = jax.jit(model.apply)({"params": boxed}, tokens())
    assert logits.shape == (2, 8, 259) and logits.dtype == jnp.float32
    # Every parameter outside the GOAT prior carries logical axis names of the right rank.
    flat = jax.tree_util.tree_flatten_with_path(
        boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[0]
    for path, leaf in flat:
        name = jax.tree_util.keystr(path)
        if "prior" in name:
            continue
        assert isinstance(leaf, nn.LogicallyPartitioned), name
        assert len(leaf.names) == leaf.value.ndim, name
    assert boxed["embed"]["embedding"].names == ("vocab", "embed")
    assert boxed["layer_0"]["mlp"]["wi_0"]["kernel"].names == ("embed", "mlp")


def test_scan_params_carry_layers_axis():
    model = TransformerLM(tiny(scan_layers=True))
    boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens())["params"]
    kernel = boxed["layers"]["mlp"]["wo"]["kernel"]
    assert kernel.names == ("layers", "mlp", "embed") and kernel.value.shape == (2, 128, 64)


def test_bfloat16_compute_runs():
    model = TransformerLM(tiny(dtype="bfloat16"))
    params = init(model, tokens())
    assert params["layer_0"]["mlp"]["wi_0"]["kernel"].dtype == jnp.float32  # param_dtype
    logits = jax.jit(model.apply)({"params": params}, tokens())
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()


def test_long_sequences_rejected_for_position_tables():
    model = TransformerLM(tiny(position_encoding="learned", max_len=8))
    with pytest.raises(ValueError, match="max_len"):
        model.init(jax.random.PRNGKey(0), tokens(t=9))


# ----------------------------------------------------------------------------------------------
# Causality and the KV cache, for every position encoding
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", [
    pytest.param(e, marks=pytest.mark.slow(reason="fire, fox and yarn keep a layer-level decode == full forward test in the default suite; kerple_log and ntk run the same cache paths")) if e in ("fire", "kerple_log", "fox", "ntk", "yarn")
    else e for e in POSITION_ENCODINGS])
def test_causal_and_kv_cache_matches_full_forward(encoding):
    """Changing token t leaves logits < t unchanged; prefill + one-token decoding through the
    cache reproduces the full forward's logits."""
    model = TransformerLM(tiny(position_encoding=encoding))
    toks = tokens(t=8)
    params = init(model, toks)
    forward = jax.jit(model.apply)
    full = forward({"params": params}, toks)

    changed = forward({"params": params}, toks.at[:, 5].set((toks[:, 5] + 1) % 259))
    np.testing.assert_array_equal(np.asarray(changed[:, :5]), np.asarray(full[:, :5]))
    assert not np.allclose(changed[:, 5:], full[:, 5:])

    decoder = model.clone(decode=True)
    cache = jax.jit(decoder.init)(jax.random.PRNGKey(0), toks)["cache"]
    step = jax.jit(lambda c, x: decoder.apply({"params": params, "cache": c}, x, mutable=["cache"]))
    out, state = step(cache, toks[:, :5])  # prefill in one chunk
    pieces = [out]
    for i in range(5, 8):
        out, state = step(state["cache"], toks[:, i:i + 1])
        pieces.append(out)
    assert_rel_close(jnp.concatenate(pieces, axis=1), full)


def test_decode_rejects_positions():
    model = TransformerLM(tiny())
    decoder = model.clone(decode=True)
    with pytest.raises(ValueError, match="positions"):
        decoder.init(jax.random.PRNGKey(0), tokens(), positions=jnp.arange(8))


def test_explicit_positions_equal_default():
    model = TransformerLM(tiny())
    params = init(model, tokens())
    forward = jax.jit(model.apply)
    a = forward({"params": params}, tokens())
    b = forward({"params": params}, tokens(), positions=jnp.arange(8))
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# scan_layers / remat are reorganizations of the same computation
# ----------------------------------------------------------------------------------------------


def stack_layers(params, num_layers):
    """Plain-stack params (layer_0, layer_1, ...) -> scan params ('layers' with a leading axis)."""
    params = dict(params)
    layers = [params.pop(f"layer_{i}") for i in range(num_layers)]
    params["layers"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
    return params


@pytest.mark.slow(reason="compiles the model three ways")
def test_scan_and_remat_match_plain_stack():
    cfg = tiny()
    toks = tokens()
    params = init(TransformerLM(cfg), toks)
    stacked = stack_layers(params, cfg.num_layers)

    def loss(model, p):
        logits = model.apply({"params": p}, toks[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], -1))

    ref_loss, ref_grad = jax.jit(jax.value_and_grad(lambda p: loss(TransformerLM(cfg), p)))(params)
    for overrides, p in [(dict(remat=True), params), (dict(scan_layers=True), stacked),
                         (dict(scan_layers=True, remat=True), stacked)]:
        model = TransformerLM(dataclasses.replace(cfg, **overrides))
        shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), toks))["params"]
        assert jax.tree_util.tree_structure(shapes) == jax.tree_util.tree_structure(p)
        value, grad = jax.jit(jax.value_and_grad(lambda q: loss(model, q)))(p)
        np.testing.assert_allclose(value, ref_loss, rtol=1e-6)
        if "layers" in grad:
            grad = dict(grad)
            layers = grad.pop("layers")
            for i in range(cfg.num_layers):
                grad[f"layer_{i}"] = jax.tree_util.tree_map(lambda x: x[i], layers)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
                               grad, ref_grad)


@pytest.mark.slow(reason="decodes a scanned stack step by step")
def test_scan_layers_kv_cache():
    model = TransformerLM(tiny(scan_layers=True))
    toks = tokens(t=6)
    params = init(model, toks)
    full = jax.jit(model.apply)({"params": params}, toks)
    decoder = model.clone(decode=True)
    cache = jax.jit(decoder.init)(jax.random.PRNGKey(0), toks)["cache"]
    step = jax.jit(lambda c, x: decoder.apply({"params": params, "cache": c}, x, mutable=["cache"]))
    out1, state = step(cache, toks[:, :4])
    out2, _ = step(state["cache"], toks[:, 4:])
    assert_rel_close(jnp.concatenate([out1, out2], axis=1), full)


def test_init_scale_prior_scales_the_sink_mlp_init():
    """``LMConfig.init_scale_prior`` is the std of the sink MLP's initial kernels: with the same
    key, 3e-3 draws exactly 3x the 1e-3 kernels, and nothing else changes."""
    def init(scale):
        cfg = LMConfig(num_layers=1, pos_rank=2, abs_rank=2, init_scale_prior=scale)
        return jax.jit(TransformerLM(cfg).init)(jax.random.PRNGKey(3), jnp.zeros((1, 8), jnp.int32))["params"]

    small, large = nn.unbox(init(1e-3)), nn.unbox(init(3e-3))
    for path, a in jax.tree_util.tree_leaves_with_path(small):
        b = large
        for k in path:
            b = b[k.key]
        key = jax.tree_util.keystr(path)
        if "key_bias" in key and key.endswith("['kernel']"):
            np.testing.assert_allclose(b, 3.0 * a, rtol=1e-6)
            assert float(jnp.std(a)) > 0
        else:
            np.testing.assert_array_equal(a, b)
