"""goat_jax.interop against the official PyTorch package goat-attention 0.1.1 (float32, CPU)."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
goat = pytest.importorskip("goat")

from goat_jax.interop import from_official, to_official  # noqa: E402
from tests import jitted

E = 64

CASES = {
    # name: (official constructor kwargs, call kwargs, length)
    "causal_1d": (dict(num_heads=4, pos_rank=4, abs_rank=4), dict(is_causal=True), 24),
    "bidirectional_1d": (dict(num_heads=4, pos_rank=3, abs_rank=5, training_seq_len=32), dict(is_causal=False), 24),
    "gqa_fused": (dict(num_heads=8, kv_num_heads=2, pos_rank=1, abs_rank=2, fuse_qkv=True), dict(is_causal=True), 20),
    "query_norm_gate": (dict(num_heads=4, pos_rank=4, abs_rank=4, prior_gate="query_norm"), dict(is_causal=False), 24),
    "grid_2d_cls": (dict(num_heads=4, pos_rank=5, abs_rank=3, pos_encoding="2d", has_cls_token_default=True),
                    dict(spatial_shape=(4, 5), has_cls_token=True), 21),
    # Causal with equal offsets (a chunk of a long sequence). With *unequal* causal offsets the
    # official module is inconsistent: without another mask it ignores the offsets in its causal
    # mask (SDPA is_causal), with one it shifts the diagonal; goat_jax always shifts it.
    "offsets_1d_causal": (dict(num_heads=4, kv_num_heads=1, pos_rank=4, abs_rank=4, training_seq_len=64),
                          dict(is_causal=True, position_offset_q=37, position_offset_k=37), 16),
    "offsets_1d_cross": (dict(num_heads=4, kv_num_heads=2, pos_rank=4, abs_rank=4),
                         dict(is_causal=False, position_offset_q=37, position_offset_k=5), 16),
    "offsets_2d": (dict(num_heads=4, pos_rank=4, abs_rank=4, pos_encoding="2d"),
                   dict(spatial_shape=(3, 4), position_offset_q=(2, 1), position_offset_k=(0, 3)), 12),
}


def _official(kwargs, gen):
    m = goat.GoatAttention(embed_dim=E, batch_first=True, **kwargs).eval()
    with torch.no_grad():  # move every prior parameter away from its near-neutral init
        for name, p in m.named_parameters():
            if not any(name.startswith(s) for s in ("q_proj", "k_proj", "v_proj", "in_proj", "out_proj")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return m


@pytest.mark.parametrize("name", list(CASES))
def test_from_official_matches_official_outputs(name, rng):
    kwargs, call, length = CASES[name]
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    m = _official(kwargs, gen)
    x = torch.randn(2, length, E, generator=gen)
    kpm = None
    if name == "bidirectional_1d":
        kpm = torch.zeros(2, length, dtype=torch.bool)
        kpm[1, -5:] = True
    with torch.no_grad():
        want = m(x, x, x, key_padding_mask=kpm, need_weights=False, **call)[0].numpy()
    module, params = from_official(m)
    xj = jnp.asarray(x.numpy())
    got = jitted.apply(module, params, xj, xj, xj, key_padding_mask=None if kpm is None else jnp.asarray(kpm.numpy()), **call)
    err = np.abs(np.asarray(got) - want).max() / np.abs(want).max()
    assert err <= 1e-5, err

    # And back: to_official reproduces the original module's outputs exactly.
    m2 = to_official(module, params)
    with torch.no_grad():
        back = m2(x, x, x, key_padding_mask=kpm, need_weights=False, **call)[0].numpy()
    np.testing.assert_allclose(back, want, rtol=0, atol=1e-6)


@pytest.mark.slow(reason="the official PyTorch layer in bfloat16")
def test_bf16_clone_runs_and_stays_close(rng):
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    m = _official(dict(num_heads=4, pos_rank=4, abs_rank=4), gen)
    module, params = from_official(m)
    x = jnp.asarray(torch.randn(1, 32, E, generator=gen).numpy())
    full = module.apply(params, x, is_causal=True)
    half = module.clone(dtype=jnp.bfloat16).apply(params, x, is_causal=True)
    assert half.dtype == jnp.bfloat16
    err = float(jnp.linalg.norm(half.astype(jnp.float32) - full) / jnp.linalg.norm(full))
    assert err < 2e-2, err


def test_unsupported_official_features_raise():
    m = goat.GoatAttention(embed_dim=E, num_heads=4, pos_rank=2, batch_first=True, add_bias_kv=True)
    with pytest.raises(ValueError, match="add_bias_kv"):
        from_official(m)
    m = goat.GoatAttention(embed_dim=E, num_heads=4, pos_rank=2, batch_first=True)
    m.set_goat_prior_scale(0.5)
    with pytest.raises(ValueError, match="goat_prior_scale"):
        from_official(m)


def test_sequence_first_module_warns_and_matches_after_transposing(rng):
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    m = goat.GoatAttention(embed_dim=E, num_heads=4, pos_rank=2, abs_rank=2, batch_first=False).eval()
    with pytest.warns(UserWarning, match=r"batch_first=False.*transpose the inputs"):
        module, params = from_official(m)
    x = torch.randn(12, 2, E, generator=gen)  # [L, B, E], the official default layout
    with torch.no_grad():
        want = m(x, x, x, need_weights=False, is_causal=True)[0].numpy().transpose(1, 0, 2)
    got = jitted.apply(module, params, jnp.asarray(x.numpy().transpose(1, 0, 2)), is_causal=True)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_attention_dropout_warns_and_matches_eval_mode(rng):
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    m = goat.GoatAttention(embed_dim=E, num_heads=4, pos_rank=2, abs_rank=2, batch_first=True,
                           dropout=0.1)
    with pytest.warns(UserWarning, match=r"dropout=0\.1.*eval mode"):
        module, params = from_official(m)
    x = torch.randn(2, 12, E, generator=gen)
    with torch.no_grad():
        want = m.eval()(x, x, x, need_weights=False)[0].numpy()
    np.testing.assert_allclose(np.asarray(jitted.apply(module, params, jnp.asarray(x.numpy()))), want, atol=1e-5)
    # Without either setting there is no warning.
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_official(goat.GoatAttention(embed_dim=E, num_heads=4, pos_rank=2, batch_first=True))


def test_weights_with_learned_frequencies_are_refused_by_a_fixed_ladder_module(rng):
    """Params that hold ``prior.pos_freqs`` (trained with learned frequencies) exported through a
    module that says ``learn_frequencies=False``: refused, not silently dropped (the official
    module's fixed ladder would give other outputs)."""
    import jax

    from goat_jax import GoatAttention
    from goat_jax.prior import PriorSettings

    x = jnp.asarray(rng.standard_normal((1, 8, E)), jnp.float32)
    learned = GoatAttention(num_heads=4, prior=PriorSettings(pos_rank=4, abs_rank=2, learn_frequencies=True))
    params = jitted.init(learned, jax.random.PRNGKey(0), x, is_causal=True)
    fixed = GoatAttention(num_heads=4, prior=PriorSettings(pos_rank=4, abs_rank=2))
    with pytest.raises(ValueError, match=r"params hold prior.pos_freqs .*fixed ladder"):
        to_official(fixed, params)
    with pytest.raises(ValueError, match="learn_frequencies=True"):
        to_official(learned, params)
    to_official(fixed, jitted.init(fixed, jax.random.PRNGKey(0), x, is_causal=True))  # the fixed ladder exports


@pytest.mark.parametrize("name", ["gqa_fused", "grid_2d_cls"])
def test_official_weights_in_the_native_nnx_layer(name, rng):
    """The official package's weights reach the native NNX layer (``from_official`` then
    ``goat_jax.nnx.from_linen``) and give the official outputs; ``to_linen`` then ``to_official``
    takes them back into a PyTorch module with the same outputs."""
    from goat_jax import nnx as gnnx

    kwargs, call, length = CASES[name]
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    m = _official(kwargs, gen)
    x = torch.randn(2, length, E, generator=gen)
    with torch.no_grad():
        want = m(x, x, x, need_weights=False, **call)[0].numpy()
    module, params = from_official(m)
    layer = gnnx.from_linen(module, params)
    xj = jnp.asarray(x.numpy())
    got = np.asarray(layer(xj, xj, xj, **call))
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-5
    module2, params2 = gnnx.to_linen(layer)
    with torch.no_grad():
        back = to_official(module2, params2)(x, x, x, need_weights=False, **call)[0].numpy()
    np.testing.assert_allclose(back, want, rtol=0, atol=1e-6)


# Each setting EXPORT_SETTINGS calls 'refused': a layer with it (and the error's words).
_REFUSED = {
    "head_dim": (dict(head_dim=8), "head_dim = embed_dim / num_heads"),
    "out_features": (dict(out_features=32), "out_features must equal embed_dim"),
    "logn_scaling": (dict(logn_scaling="all"), "logn_scaling='all' has no counterpart"),
    "sink_extrapolation": (dict(prior=dict(sink_extrapolation="linear")), "sink_extrapolation='linear' has no counterpart"),
    "learn_frequencies": (dict(prior=dict(learn_frequencies=True)), "learn_frequencies=True"),
}


def _layer(prior=None, **fields):
    from goat_jax import GoatAttention
    from goat_jax.prior import PriorSettings

    return GoatAttention(num_heads=4, prior=PriorSettings(pos_rank=2, abs_rank=2, training_seq_len=16, **(prior or {})),
                         **fields)


def _run_both(module, params, x, kv=None):
    kv = x if kv is None else kv
    got = np.asarray(jitted.apply(module, params, x, kv, is_causal=kv is x), np.float32)
    official = to_official(module, params)
    t = lambda a: torch.tensor(np.asarray(a, np.float32))
    with torch.no_grad():
        want = official(t(x), t(kv), t(kv), need_weights=False, is_causal=kv is x)[0].numpy()
    return got, want


@pytest.mark.parametrize("name", sorted(_REFUSED))
def test_a_setting_the_official_package_cannot_represent_is_refused_naming_it(rng, name):
    """logn_scaling used to be exported (~4% at 12 tokens, more past training_seq_len).
    qk_layout='lane_aligned' is converted exactly instead (tests/test_export_official.py)."""
    import jax

    kwargs, words = _REFUSED[name]
    x = jnp.asarray(rng.standard_normal((2, 12, E)), jnp.float32)
    module = _layer(**kwargs)
    params = jitted.init(module, jax.random.PRNGKey(0), x, is_causal=True)
    with pytest.raises(ValueError, match=words):
        to_official(module, params)


def test_every_setting_is_placed_in_the_export_table_and_lane_aligned_without_the_sink_exports(rng):
    """Every field of the layer and of its PriorSettings is placed in interop.EXPORT_SETTINGS
    (a new one cannot be exported unexamined), and the refused ones are those tested above."""
    import dataclasses

    import jax

    from goat_jax import GoatAttention
    from goat_jax.interop import EXPORT_SETTINGS
    from goat_jax.prior import PriorSettings

    fields = {f.name for f in dataclasses.fields(GoatAttention)} - {"parent", "name", "prior"}
    assert set(EXPORT_SETTINGS) == fields | set(PriorSettings.names())
    assert {n for n, how in EXPORT_SETTINGS.items() if how == "refused"} == set(_REFUSED)
    # Without the sink both layouts are one function, in any dtype: exported, and equal.
    x = jnp.asarray(rng.standard_normal((2, 12, E)), jnp.float32)
    module = _layer(prior=dict(qk_layout="lane_aligned", enable_key_bias=False))
    got, want = _run_both(module, jitted.init(module, jax.random.PRNGKey(0), x, is_causal=True), x)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_bf16_layer_in_the_official_layout_exports_within_bf16_noise(rng):
    import jax

    x = jnp.asarray(rng.standard_normal((2, 12, E)), jnp.float32)
    module = _layer(dtype=jnp.bfloat16)
    got, want = _run_both(module, jitted.init(module, jax.random.PRNGKey(0), x, is_causal=True), x)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


def test_cross_attention_from_another_width_exports_with_kdim(rng):
    """Keys and values of width 48 into a 64-wide layer: the official module's kdim / vdim (the
    export failed in torch's load_state_dict with a size mismatch)."""
    import jax

    x = jnp.asarray(rng.standard_normal((2, 12, E)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, 10, 48)), jnp.float32)
    module = _layer()
    got, want = _run_both(module, jitted.init(module, jax.random.PRNGKey(0), x, kv), x, kv)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_an_nnx_layer_is_refused_naming_the_conversion():
    from flax import nnx

    from goat_jax import nnx as goat_nnx
    from goat_jax.prior import PriorSettings

    layer = goat_nnx.GoatAttention(4, in_features=E, prior=PriorSettings(pos_rank=2, abs_rank=2), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"to_official takes a goat_jax.GoatAttention \(Linen\), got GoatAttention; .*to_linen"):
        to_official(layer, {})
