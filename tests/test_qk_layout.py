"""``PriorSettings.qk_layout``: the packed q/k width of GOAT (docs/layer.md, Packed width).

'official' takes ``2R + 1`` head dims for the prior and widens q/k by the sink's extra exact-split
channels (130 for a 128 head in bf16); 'lane_aligned' carves bf16's three sink channels from the
content dims in every dtype, so the kernel sees exactly ``head_dim``. Checked: the widths, the
lane-aligned layer against the float64 reference with the narrower content, that it is one
function in float32, float16 and bfloat16 (issue #67: its carve used to follow the dtype), the LM
and ViT config fields (the ViT's 2D layer with its CLS token against the reference too), and
(with libtpu) the TPU compiler's operands of splash: 130 lanes tiled to 128-lane tiles (padded)
for 'official', 128 for 'lane_aligned'."""

import json

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax import kernels
from goat_jax.kernels.plan import AttentionPlan
from goat_jax.prior import PriorSettings
from tests import goat_reference as ref
from tests import jitted
from tests.config_helpers import lm_smoke_config, run_on_fake_devices
from tests.test_attention import make_module_and_params, ref_cfg

E = 64


def _packed_width(module, x):
    with kernels.record_choices() as found:
        jax.eval_shape(lambda: module.init(jax.random.key(0), x, is_causal=True))
    return found[0]["qk_dim"]


@pytest.mark.parametrize("dtype, official, aligned", [
    (jnp.bfloat16, 18, 16),  # head 16, R 2: d_c 11 + 4 + 3 sink channels vs d_c 9 + 4 + 3
    (jnp.float16, 17, 16),
    (jnp.float32, 16, 16),  # one sink channel widens nothing; lane_aligned packs its three, two of them 0
])
def test_packed_width_is_the_head_dim_when_lane_aligned(dtype, official, aligned):
    x = jnp.zeros((1, 8, E), dtype)
    widths = [_packed_width(ref.goat_module(num_heads=4, pos_rank=2, abs_rank=2, dtype=dtype, qk_layout=layout), x)
              for layout in ("official", "lane_aligned")]
    assert widths == [official, aligned]


@pytest.mark.parametrize("implementation", ["xla", "flash", "dense"])
def test_lane_aligned_layer_equals_the_float64_reference_with_narrower_content(rng, implementation):
    # float32 with three sink channels: the bf16 layout's arithmetic, checkable to float32 round-off.
    module, params = make_module_and_params(rng, 16, pos_rank=2, abs_rank=2, sink_channels=3,
                                            qk_layout="lane_aligned", implementation=implementation)
    x = jnp.asarray(rng.normal(size=(2, 16, E)), jnp.float32)
    out = module.apply(params, x, is_causal=True)
    cfg = dict(ref_cfg(module), content_dims=16 - 2 * 2 - 3)
    want = ref.goat_attention(params, cfg, x, x, x, is_causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    # ... and it is not the official function: the content has two dims fewer.
    official = ref.goat_attention(params, ref_cfg(module), x, x, x, is_causal=True)
    assert np.abs(official - want).max() > 1e-3 * np.abs(want).max()


def test_lane_aligned_is_one_function_in_every_dtype(rng):
    """The same parameters through 'lane_aligned' in float32, float16 and bfloat16: each is the
    float64 reference with ``head_dim - 2R - 3`` content dims (bf16's carve in every dtype), to
    its dtype's rounding. The carve used to follow the dtype (3 / 2 / 1 sink channels), so float32
    and float16 computed other functions than the bf16 training did (12-46% apart)."""
    module, params = make_module_and_params(rng, 16, pos_rank=2, abs_rank=2, qk_layout="lane_aligned",
                                            training_seq_len=16)
    x = jnp.asarray(rng.normal(size=(2, 16, E)), jnp.float32)
    want = ref.goat_attention(params, dict(ref_cfg(module), content_dims=16 - 2 * 2 - 3), x, x, x, is_causal=True)
    scale = np.abs(want).max()
    for dtype, tol in ((jnp.float32, 2e-5), (jnp.float16, 5e-3), (jnp.bfloat16, 3e-2)):
        out = np.asarray(module.clone(dtype=dtype).apply(params, x, is_causal=True), np.float64)
        np.testing.assert_allclose(out, want, rtol=0, atol=tol * scale, err_msg=jnp.dtype(dtype).name)
    # Still not the official function (two content dims fewer), in float32 as in bf16.
    official = ref.goat_attention(params, ref_cfg(module), x, x, x, is_causal=True)
    assert np.abs(official - want).max() > 1e-3 * scale


def test_layout_is_a_model_field_and_bad_values_name_the_choices():
    from goat_jax.train import tasks, trainer  # pylint: disable=g-import-not-at-top
    config = lm_smoke_config(**{"model.qk_layout": "lane_aligned", "model.dtype": "bfloat16"})
    trainer.validate_config(config, 1)
    model = tasks.get_task("lm").build_model(config, AttentionPlan.from_config(config))
    with kernels.record_choices() as found:
        jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    assert {c["qk_dim"] for c in found} == {16}  # the smoke model's head dim
    with pytest.raises(ValueError, match=r"qk_layout.*'official', 'lane_aligned'"):
        trainer.validate_config(lm_smoke_config(**{"model.qk_layout": "aligned"}), 1)
    with pytest.raises(ValueError, match=r"qk_layout"):
        PriorSettings(qk_layout="lanes")


def _vit(layout, dtype="float32"):
    """The canvas protocol's ViT shape (head dim 64, R = 16, M = 2), one block, in ``dtype``."""
    from goat_jax.models import vit  # pylint: disable=g-import-not-at-top
    return vit.ViT(vit.ViTConfig(num_classes=10, image_size=28, patch_size=7, channels=1, num_layers=1,
                                 embed_dim=128, num_heads=2, mlp_dim=64, pos_rank=16, abs_rank=2,
                                 qk_layout=layout, dtype=dtype))


def test_vit_takes_the_layout_and_lane_aligned_is_one_function_in_float32_and_bf16(rng):
    """``model.qk_layout`` of the ViT configs (the tiny report's bf16 layout rows): in bf16 the
    64-wide heads pack 66 channels under 'official' and 64 under 'lane_aligned'; a lane-aligned
    ViT gives the same logits in float32 as in bf16 (to bf16 rounding), and other logits than
    the official layout's."""
    from goat_jax.config.files import load_config  # pylint: disable=g-import-not-at-top
    from goat_jax.train import tasks, trainer  # pylint: disable=g-import-not-at-top
    images = jnp.asarray(rng.normal(size=(2, 28, 28, 1)), jnp.float32)
    widths = {}
    for layout in ("official", "lane_aligned"):
        config = load_config("configs/vit_tiny.py:goat,canvas",
                             {"model.dtype": "bfloat16", "model.qk_layout": layout})
        trainer.validate_config(config, 1)
        model = tasks.get_task("vit").build_model(config, AttentionPlan.from_config(config))
        with kernels.record_choices() as found:
            jax.eval_shape(lambda m=model: m.init(jax.random.key(0), images))
        widths[layout] = {c["qk_dim"] for c in found}
    assert widths == {"official": {66}, "lane_aligned": {64}}
    official, aligned = _vit("official"), _vit("lane_aligned")
    params = flax.core.meta.unbox(jitted.init(official, jax.random.key(1), images))
    params = jax.tree.map(lambda x: x + jnp.asarray(rng.normal(0, 0.1, x.shape), x.dtype), params)  # a prior that moves
    f32 = np.asarray(aligned.apply(params, images), np.float64)
    bf16 = np.asarray(_vit("lane_aligned", "bfloat16").apply(params, images), np.float64)
    spread = np.abs(f32).max()
    assert np.abs(bf16 - f32).max() < 0.05 * spread, np.abs(bf16 - f32).max() / spread
    assert np.abs(np.asarray(official.apply(params, images), np.float64) - f32).max() > 1e-3 * spread
    with pytest.raises(ValueError, match=r"qk_layout"):
        trainer.validate_config(load_config("configs/vit_tiny.py:goat,canvas", {"model.qk_layout": "aligned"}), 1)


def test_lane_aligned_2d_layer_with_cls_equals_the_float64_reference(rng):
    """The ViT's attention (2D prior, CLS token) with the bf16 layout's three sink channels, in
    float32: the float64 reference with two content dims fewer than the official layout's."""
    grid, fields = (4, 3), dict(pos_encoding="2d", has_cls_token_default=True, pos_rank=5, abs_rank=3)
    module, params = make_module_and_params(rng, 13, init_kwargs=dict(spatial_shape=grid, has_cls_token=True),
                                            sink_channels=3, qk_layout="lane_aligned", **fields)
    x = jnp.asarray(rng.normal(size=(2, 13, E)), jnp.float32)
    out = jitted.apply(module, params, x, x, x, spatial_shape=grid, has_cls_token=True)
    cfg = dict(ref_cfg(module), content_dims=16 - 2 * 5 - 3)
    want = ref.goat_attention(params, cfg, x, x, x, grid=grid, has_cls=True, offset_q=(0, 0), offset_k=(0, 0))
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    official = ref.goat_attention(params, ref_cfg(module), x, x, x, grid=grid, has_cls=True,
                                  offset_q=(0, 0), offset_k=(0, 0))
    assert np.abs(official - want).max() > 1e-3 * np.abs(want).max()


_TPU_SCRIPT = r'''
import json, re
import jax, jax.numpy as jnp, numpy as np, flax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from goat_jax import GoatAttention, PriorSettings, aot

devices = aot.target_devices(aot.parse_target("v5e-1"))
mesh = Mesh(np.array(devices).reshape(1), ("data",))
B, T, E = 1, 2048, 1024
x = jax.ShapeDtypeStruct((B, T, E), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
out = {}
for layout in ("official", "lane_aligned"):
    attn = GoatAttention(num_heads=8, head_dim=128, implementation="splash", dtype=jnp.bfloat16,
                         prior=PriorSettings(pos_rank=8, abs_rank=8, training_seq_len=T, qk_layout=layout))
    with jax.set_mesh(mesh):
        params = jax.eval_shape(lambda x: flax.core.meta.unbox(attn.init(jax.random.key(0), x, is_causal=True)), x)
        loss = lambda p, x: jnp.mean(attn.apply(p, x, is_causal=True).astype(jnp.float32) ** 2)
        compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
    text = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    # The q/k operands of splash's forward kernel, with their layouts.
    fwd = [l for l in text.splitlines() if "tpu_custom_call" in l and "splash_mha_fwd" in l][0]
    at = fwd.index("operand_layout_constraints={")
    shapes = fwd[at:fwd.index("frontend_attributes", at)]
    out[layout] = {"operands": shapes, "bytes_accessed": cost.get("bytes accessed"),
                   "tiled_qk": sorted(set(re.findall(r"bf16\[8,2048,(\d+)\]\{2,1,0:T\(8,128\)", text)))}
print("RESULT " + json.dumps(out))
'''


@pytest.mark.slow(reason="two TPU compiles of a 1024-wide layer (30 s); the default suite compiles splash for TPUs in tests/test_aot.py and tests/test_context.py")
def test_tpu_splash_sees_128_lanes_when_lane_aligned():
    """The TPU compiler's view: GOAT with a 128 head in bf16 hands splash q/k 130 wide under
    'official' (tiled in 128-lane tiles: padded to 256 in memory) and 128 wide under
    'lane_aligned'; the compiled step accesses fewer bytes."""
    from goat_jax import aot  # pylint: disable=g-import-not-at-top
    if not aot.libtpu_installed():
        pytest.skip("libtpu (the TPU compiler) is not installed: pip install 'goat-jax[aot]'")
    out = json.loads(run_on_fake_devices(_TPU_SCRIPT, devices=1, timeout=900).split("RESULT ")[-1])
    official, aligned = out["official"], out["lane_aligned"]
    assert "bf16[8,2048,130]" in official["operands"] and "130" in official["tiled_qk"], official
    assert "bf16[8,2048,130]" not in aligned["operands"] and "bf16[8,2048,128]" in aligned["operands"], aligned
    assert aligned["bytes_accessed"] < official["bytes_accessed"], out
