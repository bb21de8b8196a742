"""The q/k width rule of the fused kernels and the one warning when GOAT's packed layout falls
off the fast path (goat_jax/kernels/widths.py; docs/layer.md, Packed width).

Checked on CPU: the rule's widths on a Hopper GPU (compute capability from the chip table) and
on a TPU; the warning's conditions (by the packed width in any dtype, float16's official
layout included; the platform's fused kernel only; nothing for 'lane_aligned' widths); that it is raised once per process for the devices of the mesh in
context (compile-only abstract devices of an H200 and of a TPU v5e); that the GOAT layer traced
for a TPU mesh raises it for 128-wide heads in the official layout and not in 'lane_aligned'; and
that the compile tool's recorder collects it."""

import warnings

import flax
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from goat_jax import GoatAttention, PriorSettings
from goat_jax.kernels import widths
from goat_jax.targets import chips

H200_CC = chips.CHIPS["h200"].compute_capability


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(widths, "_warned", set())


def _mesh(kind: str, platform: str) -> AbstractMesh:
    return AbstractMesh((1,), ("data",), axis_types=(AxisType.Auto,),
                        abstract_device=AbstractDevice(device_kind=kind, num_cores=1, platform=platform))


def test_kernel_width_rule():
    assert H200_CC == (9, 0) and chips.CHIPS["h100"].compute_capability == (9, 0)
    gpu = [widths.kernel_width("gpu", H200_CC, w) for w in (64, 65, 66, 72, 80, 96, 128, 130, 256, 300)]
    assert gpu == [64, 128, 128, 128, 128, 128, 128, 256, 256, 304]
    assert [widths.kernel_width("tpu", None, w) for w in (64, 66, 128, 130)] == [128, 128, 128, 256]
    assert widths.kernel_width("gpu", (8, 0), 66) is None  # an A100: no rule stated
    assert widths.kernel_width("cpu", None, 66) is None


@pytest.mark.parametrize("platform, cc, dtype, impl, head, qk, warns", [
    ("gpu", H200_CC, jnp.bfloat16, "cudnn", 64, 66, True),  # the official layout in bf16
    ("gpu", H200_CC, jnp.bfloat16, "cudnn", 64, 64, False),  # 'lane_aligned'
    ("gpu", H200_CC, jnp.float16, "cudnn", 64, 65, True),  # fp16's official layout: 65 runs in the 128 bucket (issue #67)
    ("gpu", H200_CC, jnp.float16, "cudnn", 64, 64, False),  # fp16 'lane_aligned'
    ("gpu", H200_CC, jnp.float32, "cudnn", 64, 64, False),  # float32's official layout is head_dim wide
    ("tpu", None, jnp.float16, "splash", 128, 129, True),  # by the width, whatever the dtype
    ("gpu", H200_CC, jnp.bfloat16, "flash", 64, 66, False),  # not the fused kernel the rule is about
    ("gpu", (8, 0), jnp.bfloat16, "cudnn", 64, 66, False),  # not Hopper
    ("gpu", H200_CC, jnp.bfloat16, "cudnn", 128, 130, True),
    ("tpu", None, jnp.bfloat16, "splash", 64, 66, False),  # one 128-lane tile either way
    ("tpu", None, jnp.bfloat16, "splash", 128, 130, True),
    ("tpu", None, jnp.float32, "splash", 128, 128, False),
])
def test_layout_warning_conditions(platform, cc, dtype, impl, head, qk, warns):
    message = widths.layout_warning(platform, cc, dtype, impl, head, qk)
    assert (message is not None) == warns
    if warns:
        assert f"{qk} wide for {head}-wide heads in {jnp.dtype(dtype).name}" in message
        assert "qk_layout='lane_aligned'" in message


def test_warned_once_for_the_mesh_in_context_from_the_chip_table():
    with jax.sharding.use_abstract_mesh(_mesh("NVIDIA H200", "gpu")):
        with pytest.warns(widths.LayoutWarning, match="66 wide for 64-wide heads.*128 wide against 64"):
            assert widths.check_layout("cudnn", jnp.bfloat16, 64, 66) is not None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second warning would raise here
            assert widths.check_layout("cudnn", jnp.bfloat16, 64, 66) is not None  # still reported, not warned
            assert widths.check_layout("cudnn", jnp.bfloat16, 64, 64) is None
    with warnings.catch_warnings():  # the CPU host: no rule, no warning
        warnings.simplefilter("error")
        assert widths.check_layout("cudnn", jnp.bfloat16, 64, 66) is None


@pytest.mark.parametrize("layout, dtype, warns, wide", [("official", jnp.bfloat16, True, 130),
                                                       ("lane_aligned", jnp.bfloat16, False, 128),
                                                       ("official", jnp.float16, True, 129),
                                                       ("lane_aligned", jnp.float16, False, 128),
                                                       ("official", jnp.float32, False, 128)])
def test_goat_layer_traced_for_a_tpu_mesh_warns_for_the_official_layout_only(layout, dtype, warns, wide):
    """The layer's own call, in each compute dtype: the official layout widens q/k in bf16 and
    float16 (the float16 case used to pass unwarned), not in float32."""
    attn = GoatAttention(num_heads=2, head_dim=128, dtype=dtype,
                         prior=PriorSettings(pos_rank=4, abs_rank=4, training_seq_len=256, qk_layout=layout))
    x = jax.ShapeDtypeStruct((1, 256, 256), jnp.float32)
    with jax.sharding.use_abstract_mesh(_mesh("TPU v5 lite", "tpu")), widths.record_layout_warnings() as found:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.eval_shape(lambda x: flax.core.meta.unbox(attn.init(jax.random.key(0), x, is_causal=True)), x)
    layout_warnings = [w for w in caught if issubclass(w.category, widths.LayoutWarning)]
    assert len(layout_warnings) == int(warns)  # once, though the layer is traced more than once
    assert len(found) == int(warns)
    if warns:
        assert f"{wide} wide for 128-wide heads" in found[0] and "256 wide against 128" in found[0]
