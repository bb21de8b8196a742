"""The kernel layer's house (goat_jax/kernels/): the capability table decides every automatic
choice and every refusal, the one mask value equals the keyword form on every CPU kernel, the
sliding-window hook against a float64 reference, and the front door's argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax import kernels
from goat_jax.kernels import capabilities as caps
from goat_jax.kernels.plan import AttentionPlan
from tests import goat_reference as ref

CPU_KERNELS = ("xla", "flash", "dense", "splash_interpret")


def test_every_row_has_a_kernel_and_every_missing_feature_a_reason():
    assert set(caps.CAPABILITIES) == set(caps.IMPLEMENTATIONS) == set(kernels.IMPLEMENTATIONS)
    for row in caps.CAPABILITIES.values():
        assert callable(row.attention), row.name
        for feature in caps.FEATURES:
            assert row.takes(feature) or row.why_not.get(feature), (row.name, feature)
        assert set(row.features) <= set(caps.FEATURES)


class _Device:
    def __init__(self, kind):
        self.device_kind = kind


def _on(platform, kind="NVIDIA A100-SXM4-80GB"):
    return lambda *a, **kw: (platform, "this test", _Device(kind))


def test_the_table_decides_the_automatic_choice(monkeypatch):
    """Changing one row changes the automatic choice and the refusal, with no other code: the
    rule is stated once. An A100 in bf16 with segment ids: cuDNN's row takes segment ids from
    compute capability 9.0 only, so the choice falls back; drop that need from the row and the
    same call picks cuDNN."""
    shape = (1, 4, 64, 64)
    with monkeypatch.context() as m:
        m.setattr(kernels.choice, "target", _on("gpu"))
        assert kernels.resolve_implementation(None, jnp.bfloat16, 64, shape, segments=True) == "xla"
        assert kernels.resolve_implementation(None, jnp.bfloat16, 64, shape) == "cudnn"
        with pytest.raises(ValueError, match="'cudnn' cannot take segment ids"):
            kernels.resolve_implementation("cudnn", jnp.bfloat16, 64, shape, segments=True)
        row = caps.CAPABILITIES["cudnn"]
        m.setitem(caps.CAPABILITIES, "cudnn", caps.Capability(**{**row.__dict__, "needs_capability": {}}))
        assert kernels.resolve_implementation(None, jnp.bfloat16, 64, shape, segments=True) == "cudnn"
        assert kernels.resolve_implementation("cudnn", jnp.bfloat16, 64, shape, segments=True) == "cudnn"


@pytest.mark.parametrize("platform,dtype,qk,uses,want", [
    ("gpu", jnp.bfloat16, 66, {}, "cudnn"),
    ("gpu", jnp.bfloat16, 260, {}, "xla"),  # 264 after padding > 256
    ("gpu", jnp.float32, 66, {}, "xla"),
    ("gpu", jnp.bfloat16, 66, {"bias": True}, "xla"),
    ("tpu", jnp.bfloat16, 66, {}, "splash"),
    ("tpu", jnp.bfloat16, 66, {"bias": True}, "xla"),
    ("tpu", jnp.bfloat16, 66, {"decoding": True}, "xla"),  # splash needs a static offset
    ("cpu", jnp.float32, 64, {}, "xla"),
])
def test_automatic_choice_per_platform(monkeypatch, platform, dtype, qk, uses, want):
    monkeypatch.setattr(kernels.choice, "target", _on(platform))
    assert kernels.resolve_implementation(None, dtype, qk, (1, 4, 256, 256), **uses) == want


def test_large_logits_pick_flash_unless_the_call_has_a_bias():
    big = (1, 8, 4096, 4096)
    assert kernels.resolve_implementation(None, jnp.float32, 64, big) == "flash"
    assert kernels.resolve_implementation(None, jnp.float32, 64, big, bias=True) == "xla"


def test_refusals_name_the_decisive_reason_first():
    on_cpu = caps.Request.of(("cpu", "here"), jnp.float32, 300, segment_ids=True)
    assert "needs a GPU" in caps.refusal("cudnn", on_cpu)  # not the dtype, the head dim or segments
    on_gpu = caps.Request.of(("gpu", "here"), jnp.float32, 300, segment_ids=True)
    assert "needs bfloat16 or float16" in caps.refusal("cudnn", on_gpu)
    on_gpu = caps.Request.of(("gpu", "here"), jnp.bfloat16, 300, segment_ids=True)
    assert "head dims <= 256" in caps.refusal("cudnn", on_gpu)
    assert caps.refusal("flash", caps.Request.of(("tpu", "here"), jnp.float32, 64, segment_ids=True)) is None
    with pytest.raises(TypeError, match="unknown features"):
        caps.Request.of(("cpu", "here"), jnp.float32, 64, segments=True)


def _case(seed=0, b=2, t=24, s=24, n=4, kh=2, h=8):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=shape).astype(np.float32) for shape in ((b, t, n, h), (b, s, kh, h), (b, s, kh, h)))
    seg = np.repeat(np.array([[0] * 10 + [1] * 14, [3] * 5 + [4] * 19]), 1, axis=0)[:, :t].astype(np.int32)
    pad = np.zeros((b, s), bool)
    pad[1, -4:] = True
    return q, k, v, seg, pad


@pytest.mark.parametrize("implementation", CPU_KERNELS)
def test_mask_value_equals_the_keyword_form(implementation):
    """``attend(mask=AttentionMask(...))`` and the keyword form give the same output on every CPU
    kernel: causal with an offset, padding and segment ids, built once."""
    q, k, v, seg, pad = _case(t=128 if "splash" in implementation else 24, s=128 if "splash" in implementation else 24)
    if "splash" in implementation:
        seg = np.broadcast_to((np.arange(128) >= 50).astype(np.int32), (2, 128)).copy()
        pad = np.zeros((2, 128), bool)
        pad[1, -7:] = True
    kw = dict(is_causal=True, causal_offset=2, key_padding_mask=jnp.asarray(pad), segment_ids=jnp.asarray(seg))
    mask = kernels.AttentionMask.build(q.shape[0], q.shape[1], k.shape[1], **kw)
    a = kernels.attend(q, k, v, implementation=implementation, scale=0.3, **kw)
    b = kernels.attend(q, k, v, implementation=implementation, scale=0.3, mask=mask)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = ref.attention_and_grads(*(x.astype(np.float64) for x in (q, k, v)), np.zeros(a.shape),
                                   scale=0.3, is_causal=True, causal_offset=2, key_padding_mask=pad,
                                   q_segment_ids=seg, kv_segment_ids=seg)[0]
    np.testing.assert_allclose(np.asarray(a), want, rtol=2e-4, atol=2e-5)


def test_mask_and_keywords_together_are_refused_and_shapes_are_checked():
    q, k, v, seg, pad = _case()
    mask = kernels.AttentionMask(causal=True)
    with pytest.raises(ValueError, match="Pass either mask= or the keyword form"):
        kernels.attend(q, k, v, implementation="xla", mask=mask, key_padding_mask=jnp.asarray(pad))
    with pytest.raises(ValueError, match=r"AttentionMask.key_padding has shape \(2, 5\)"):
        kernels.attend(q, k, v, implementation="xla", mask=kernels.AttentionMask(key_padding=jnp.zeros((2, 5), bool)))
    with pytest.raises(ValueError, match="needs both q_segment_ids and kv_segment_ids"):
        kernels.attend(q, k, v, implementation="xla", mask=kernels.AttentionMask(q_segment_ids=jnp.asarray(seg)))


@pytest.mark.parametrize("implementation", ["xla", "dense"])
def test_local_window_against_a_float64_band_reference(implementation):
    """``AttentionPlan(window=w)``: query i sees keys i - w < j <= i (causal), values and
    gradients against a float64 softmax over that band; kernels without a window refuse it."""
    q, k, v, _, _ = _case(t=20, s=20)
    w = 5
    band = (np.arange(20)[:, None] - np.arange(20)[None, :] < w) & (np.arange(20)[None, :] <= np.arange(20)[:, None])

    def reference(q, k, v):
        g = q.shape[2] // k.shape[2]
        logits = 0.4 * jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, g, 2))
        p = jax.nn.softmax(jnp.where(band, logits, -jnp.inf), -1)
        return jnp.einsum("bnts,bsnh->btnh", p, jnp.repeat(v, g, 2))

    def windowed(q, k, v):
        return kernels.attend(q, k, v, implementation=implementation, scale=0.4, is_causal=True,
                              plan=AttentionPlan(window=w))

    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    got = jax.jit(jax.value_and_grad(loss(windowed), argnums=(0, 1, 2)))(q, k, v)
    with jax.enable_x64(True):
        want = jax.value_and_grad(loss(reference), argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_local_window_is_refused_by_kernels_without_one_and_checked():
    q, k, v, _, _ = _case()
    with pytest.raises(ValueError, match="'flash' cannot take a sliding window"):
        kernels.attend(q, k, v, implementation="flash", is_causal=True, plan=AttentionPlan(window=4))
    with pytest.raises(ValueError, match="window must be a positive integer"):
        AttentionPlan(window=0)


def test_padded_mask_keeps_every_padded_query_row_visible():
    """``AttentionMask.padded``: extra keys hidden, extra query rows copy the last real row's id."""
    seg = jnp.asarray([[1, 1, 2]], jnp.int32)
    mask = kernels.AttentionMask(causal=True, q_segment_ids=seg, kv_segment_ids=seg).padded(1, 3, 3, 4, 4)
    np.testing.assert_array_equal(np.asarray(mask.q_segment_ids), [[1, 1, 2, 2]])
    np.testing.assert_array_equal(np.asarray(mask.kv_lengths), [3])
    assert bool(mask.rows_with_keys(4, 4).all())


@pytest.mark.parametrize("implementation", ["xla", "flash", "dense"])
def test_causal_offsets_near_and_past_int32_are_exact(implementation):
    """A causal offset within T of 2**31 (static, and traced under jit) sees every key, as the
    float64 reference says, and 2**31 or more is no OverflowError; one below -2**31 + T sees none
    (zeros). Before, ``i + offset`` wrapped in int32, differently per kernel (issue #53, item 9)."""
    q, k, v, _, _ = _case(t=8, s=8)
    want = ref.attention_and_grads(*(x.astype(np.float64) for x in (q, k, v)), np.zeros((2, 8, 4, 8)),
                                   scale=0.3, is_causal=False)[0]
    traced = jax.jit(lambda o: kernels.attend(q, k, v, implementation=implementation, scale=0.3, is_causal=True,
                                              causal_offset=o))
    for o in (2 ** 31 - 4, 2 ** 31 - 1, 2 ** 31, 2 ** 40):
        got = kernels.attend(q, k, v, implementation=implementation, scale=0.3, is_causal=True, causal_offset=o)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5, err_msg=str(o))
        np.testing.assert_allclose(np.asarray(traced(jnp.int32(min(o, 2 ** 31 - 1)))), want, rtol=2e-4, atol=2e-5)
    for o in (-(2 ** 31) + 3, -(2 ** 40)):
        got = kernels.attend(q, k, v, implementation=implementation, scale=0.3, is_causal=True, causal_offset=o)
        assert not np.asarray(got).any(), o
    assert not np.asarray(traced(jnp.int32(-(2 ** 31) + 3))).any()
