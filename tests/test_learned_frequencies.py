"""``PriorSettings.learn_frequencies``: GOAT's relative frequencies as a per-KV-head parameter
``pos_freqs`` [K, R], initialised to the ladder. Values and gradients against the float64
reference (tests/goat_reference.py, given the learned frequencies), KV-cache decoding, GQA,
offsets, 2D, bf16, the interop refusal, weight decay and sharding names. Off (the default) the
parameters and outputs are unchanged: tests/test_param_fingerprints.py and
tests/test_attention_fingerprints.py, with the official interop in tests/test_interop.py."""

import types

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax import PriorSettings
from goat_jax.models.lm import LMConfig
from goat_jax.models.vit import ViTConfig
from goat_jax.prior import frequencies
from goat_jax.tasks import NO_DECAY_NAMES
from goat_jax.tasks.lm import official_c4_decay_mask
from goat_jax.train import optim, sharding
from tests import goat_reference as ref
from tests import jitted
from tests.test_attention import CASES, E, _rel_err, _run_case, make_module_and_params, ref_cfg
from tests.marks import SLOW_CASE


def _on(fields):
    return dict(fields, learn_frequencies=True)


@pytest.mark.parametrize("name,implementation", [
    # Default suite: 1D GQA with offsets on the packed path, 2D with CLS on the dense log-prior
    # (the packed 2D path is test_frequency_gradients_match_float64_reference's).
    ("linear_sink_gqa_offsets", "xla"), ("grid_2d_cls_offsets", "dense"),
    pytest.param("grid_2d_cls_offsets", "xla", marks=SLOW_CASE),
    pytest.param("bidir_gqa_padding", "dense", marks=SLOW_CASE),
    pytest.param("mqa_causal_offsets", "flash", marks=SLOW_CASE),
    pytest.param("cross_offsets", "xla", marks=SLOW_CASE),
    pytest.param("grid_2d", "flash", marks=SLOW_CASE)])
def test_matches_float64_reference_with_learned_frequencies(name, implementation, rng, monkeypatch):
    fields, call, t, s = CASES[name]
    monkeypatch.setitem(CASES, name, (_on(fields), call, t, s))
    out, want = _run_case(name, implementation, rng)  # the prior, pos_freqs included, randomized
    assert _rel_err(out, want) <= 1e-5


def test_starts_at_the_ladder_and_equals_the_fixed_prior(rng):
    x = jnp.asarray(rng.normal(size=(2, 12, E)), jnp.float32)
    on = ref.goat_module(num_heads=4, kv_num_heads=2, pos_rank=4, abs_rank=2, learn_frequencies=True)
    off = ref.goat_module(num_heads=4, kv_num_heads=2, pos_rank=4, abs_rank=2)
    v_on = flax.core.meta.unbox(jax.jit(on.init)(jax.random.key(0), x))
    v_off = flax.core.meta.unbox(jax.jit(off.init)(jax.random.key(0), x))
    assert "pos_freqs" not in v_off["params"]["prior"]  # off: no parameter at all
    freqs = np.asarray(v_on["params"]["prior"].pop("pos_freqs"))
    # The ladder is float64 (the fixed prior's exact phases use it so); the parameter is float32.
    np.testing.assert_array_equal(freqs, np.broadcast_to(np.asarray(frequencies(4, 1e4), np.float32), (2, 4)))
    assert jax.tree_util.tree_all(jax.tree.map(lambda a, b: bool((a == b).all()), v_on, v_off))
    v_on["params"]["prior"]["pos_freqs"] = jnp.asarray(freqs)
    run = lambda m, v: np.asarray(jax.jit(lambda v, x: m.apply(v, x, is_causal=True))(v, x))
    np.testing.assert_allclose(run(on, v_on), run(off, v_off), rtol=0, atol=1e-6)


@pytest.mark.parametrize("grid", [pytest.param(None, marks=SLOW_CASE), (3, 4)])
def test_frequency_gradients_match_float64_reference(grid, rng):
    """d <cot, out> / d pos_freqs: JAX on the packed 'xla' path against central differences of
    the NumPy float64 reference."""
    t = 16 if grid is None else 13
    kw = dict(is_causal=True) if grid is None else dict(spatial_shape=grid, has_cls_token=True)
    init_kwargs = None if grid is None else kw
    module, params = make_module_and_params(
        rng, t, kv_num_heads=2, training_seq_len=16, init_kwargs=init_kwargs, implementation="xla",
        learn_frequencies=True, **({} if grid is None else dict(pos_encoding="2d", has_cls_token_default=True)))
    x = rng.normal(size=(1, t, E)).astype(np.float32)
    cfg = ref_cfg(module)
    rkw = dict(is_causal=True) if grid is None else dict(grid=grid, has_cls=True, offset_q=(0, 0), offset_k=(0, 0))
    cot = rng.normal(size=(1, t, E))

    def ref_loss(p):
        return float(np.sum(ref.goat_attention(p, cfg, x, x, x, **rkw) * cot))

    g = jax.jit(jax.grad(lambda p: jnp.sum(module.apply(p, jnp.asarray(x), **kw) * cot)))(params)
    g = np.asarray(g["params"]["prior"]["pos_freqs"], np.float64)
    p64 = ref.unboxed(params)
    fd, eps = np.zeros_like(g), 1e-6
    for idx in np.ndindex(*g.shape):
        for sign in (1, -1):
            q = jax.tree.map(np.copy, p64)
            q["prior"]["pos_freqs"][idx] += sign * eps
            fd[idx] += sign * ref_loss({"params": q}) / (2 * eps)
    assert np.abs(fd).max() > 1e-2  # the learned frequencies do move the output
    np.testing.assert_allclose(g, fd, rtol=0, atol=1e-3 * np.abs(fd).max())


def test_kv_cache_decoding_equals_full_forward(rng):
    length = 12
    module, params = make_module_and_params(rng, length, kv_num_heads=2, training_seq_len=16,
                                            learn_frequencies=True)
    x = jnp.asarray(rng.normal(size=(2, length, E)), jnp.float32)
    full = jitted.apply(module, params, x, is_causal=True)
    dec = module.clone(decode=True)
    cache = jitted.init(dec, jax.random.key(0), x, is_causal=True)["cache"]
    step = jax.jit(lambda v, x: dec.apply(v, x, is_causal=True, mutable=["cache"]))  # 2 compiles, not eager ops
    outs = []
    for start, stop in [(0, 5)] + [(i, i + 1) for i in range(5, length)]:
        out, mutated = step({**params, "cache": cache}, x[:, start:stop])
        cache = mutated["cache"]
        outs.append(out)
    assert _rel_err(jnp.concatenate(outs, axis=1), full) <= 1e-5


def test_interop_refuses_learned_frequencies():
    from goat_jax import interop

    module = ref.goat_module(num_heads=4, pos_rank=4, abs_rank=2, learn_frequencies=True)
    # Refused from the settings alone, before torch is imported or any weight is read.
    with pytest.raises(ValueError, match="learn_frequencies=True.*pos_freqs.*learn_frequencies=False"):
        interop.to_official(module, {})


def test_float32_in_bf16_no_weight_decay_and_sharding_names():
    module = ref.goat_module(num_heads=4, kv_num_heads=2, pos_rank=4, abs_rank=2, learn_frequencies=True,
                             dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    boxed = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 8, E), jnp.bfloat16))
    box = boxed["params"]["prior"]["pos_freqs"]
    # w * p reaches R-digit angles: the features are computed from float32 frequencies in bf16 runs too.
    assert box.value.dtype == jnp.float32
    assert tuple(box.names) == ("kv_heads", None)
    mesh = types.SimpleNamespace(shape={"data": 1, "fsdp": 2, "tensor": 2})
    assert sharding._resolve(box.names, box.value.shape, mesh, sharding.DEFAULT_RULES) == (  # pylint: disable=protected-access
        jax.sharding.PartitionSpec("tensor", None))
    params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), flax.core.meta.unbox(boxed)["params"])
    assert not optim.decay_mask(params, NO_DECAY_NAMES)["prior"]["pos_freqs"]
    assert not official_c4_decay_mask({"layer": params})["layer"]["prior"]["pos_freqs"]
    assert official_c4_decay_mask({"layer": params})["layer"]["q_proj"]["kernel"]  # the mask does decay


def test_model_configs_borrow_the_setting():
    assert PriorSettings().learn_frequencies is False
    assert LMConfig(learn_frequencies=True).prior.learn_frequencies
    assert ViTConfig(learn_frequencies=True).prior.learn_frequencies
    with pytest.raises((TypeError, ValueError), match="learn_frequencies"):
        PriorSettings(learn_frequencies="yes")


def test_frequency_gradients_keep_float32_precision_far_out(rng):
    """Issue #53, item 7: d <cot, out> / d pos_freqs of a 64-token window at offsets 0, 1M and
    2**24 - 64, float32 against the same layer in float64. The relative prior is computed from
    positions relative to the window's first key (goat_jax.prior.features.relative_to): before,
    ``p_i dw`` and ``p_j dw`` cancelled in float32, 0.21 relative error near 2**24."""
    t = 64
    module = ref.goat_module(num_heads=4, kv_num_heads=2, pos_rank=6, abs_rank=2, enable_key_bias=False,
                             learn_frequencies=True, implementation="xla")
    x = rng.normal(size=(1, t, E))
    params = flax.core.meta.unbox(jax.jit(module.init)(jax.random.key(0), jnp.asarray(x, jnp.float32)))
    for name in ("lambda_sym", "lambda_asym"):  # O(1) amplitudes, so the frequencies matter
        params["params"]["prior"][name] = jnp.asarray(rng.normal(size=params["params"]["prior"][name].shape), jnp.float32)
    cot = rng.normal(size=(1, t, E))

    def grad(m, p, x, off):
        loss = lambda p: jnp.sum(m.apply(p, x, is_causal=True, position_offset_q=off, position_offset_k=off)
                                 * jnp.asarray(cot, x.dtype))
        return jax.grad(loss)(p)["params"]["prior"]["pos_freqs"]

    for off in (0, 1_000_000, 2 ** 24 - t):
        got = np.asarray(jax.jit(lambda p, x: grad(module, p, x, off))(params, jnp.asarray(x, jnp.float32)), np.float64)
        with jax.enable_x64(True):
            m64 = module.clone(dtype=jnp.float64, param_dtype=jnp.float64)
            p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
            want = np.asarray(jax.jit(lambda p, x: grad(m64, p, x, off))(p64, jnp.asarray(x, jnp.float64)))
        assert np.abs(want).max() > 1e-2, off  # the frequencies do move the output
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= 1e-4, (off, err)
