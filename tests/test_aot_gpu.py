"""Ahead-of-time compilation for GPU nodes on this host (goat_jax/aot/, goat_jax/targets/).

Without JAX's CUDA plugin: GPU target names, the committed H100/H200 target descriptions against
the chip table, the one line that names the ``aot-gpu`` extra, and the cuDNN compute-capability
workaround on jax's own checks. With the plugin (the ``aot-gpu`` extra, not installed by CI: ~3.2
GB of wheels; skipped with the reason otherwise): the GOAT layer with cuDNN compiled for 8 H200s
(the fused-attention custom calls in the compiled program, the batch and the heads split per
device in memory_analysis and in the kernels' shapes) and a smoke LM's train step through
``python -m experiments.compile --target h200x8``."""

import json
import re

import pytest

from goat_jax import aot
from goat_jax import targets
from tests.config_helpers import run_compile_only

needs_cuda_plugin = pytest.mark.skipif(
    not aot.cuda_plugin_installed(),
    reason="JAX's CUDA plugin (the GPU compiler) is not installed: pip install 'goat-jax[aot-gpu]'")


def _run(args, timeout=600):
    return run_compile_only(args, timeout, gpu=True)


@pytest.mark.parametrize("name, gpus, topology, kind", [
    ("h100x8", 8, "1x1x8", "NVIDIA H100 80GB HBM3"), ("h200x1", 1, "1x1x1", "NVIDIA H200"),
    ("h200x8", 8, "1x1x8", "NVIDIA H200"), ("h200x4", 4, "1x1x4", "NVIDIA H200"),
    ("h100x32", 32, "1x4x8", "NVIDIA H100 80GB HBM3")])
def test_gpu_targets_are_model_x_gpus(name, gpus, topology, kind):
    target = aot.parse_target(name)
    assert (target.num_chips, target.topology_name, target.chip.device_kind) == (gpus, topology, kind)
    assert target.chip.platform == "cuda" and target.chip.compute_capability == (9, 0)


@pytest.mark.parametrize("name", ["h200x3", "h200x12", "h200x0"])
def test_bad_gpu_target_names_say_what_is_accepted(name):
    with pytest.raises(ValueError, match="counts GPUs: 1, 2, 4 or 8 in one node"):
        aot.parse_target(name)
    with pytest.raises(ValueError, match="h200x8"):  # an unknown name lists the GPU forms too
        aot.parse_target("a100x8")


def _field(text, name):
    return re.search(r"\b" + name + r":\s*([0-9.e]+|\"[^\"]*\")", text).group(1).strip('"')


@pytest.mark.parametrize("family", ["h100", "h200"])
def test_target_descriptions_agree_with_the_chip_table(family):
    # The committed GpuTargetConfig text and aot.CHIPS say the same memory, bandwidth, device
    # name and compute capability; Hopper's SM count and shared memory are NVIDIA's figures.
    chip = aot.CHIPS[family]
    text = targets.read(chip.target_config)
    assert int(_field(text, "device_memory_size")) == chip.hbm_bytes
    assert int(_field(text, "memory_bandwidth")) == int(chip.hbm_bytes_per_s)
    assert _field(text, "device_description_str") == chip.device_kind
    assert re.search(r"cuda_compute_capability \{ major: 9 minor: 0 \}", text)
    assert (int(_field(text, "core_count")), int(_field(text, "shared_memory_per_block_optin"))) == (132, 227 << 10)
    assert chip.peak_bf16_flops == 989e12  # dense BF16 (the datasheets' 1,979 is with sparsity)
    assert aot.target._dnn_version(aot.parse_target(f"{family}x8")) == 92800  # cuDNN 9.28.0


def test_missing_cuda_plugin_is_one_line_naming_the_extra(tmp_path):
    # The command with the CUDA plugin hidden: one 'error:' line naming the extra, no traceback.
    script = ("import runpy, sys\nimport goat_jax.aot.target as a\na.cuda_plugin_installed = lambda: False\n"
              f"sys.argv = ['compile', '--config', 'configs/lm_tiny.py:goat,smoke', '--target', 'h200x8', "
              f"'--out', {str(tmp_path / 'out')!r}]\n"
              "runpy.run_module('experiments.compile', run_name='__main__')\n")
    proc = _run(["-c", script], timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "goat-jax[aot-gpu]" in errors[0] and "h200x8" in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_cudnn_checks_answer_for_the_gpu_target_only_inside_gpu_target():
    # jax's cuDNN checks ask the host's backend for the compute capability: on this CPU host
    # Hopper's 256 head-dim limit is 128 (GOAT's packed 130 -> 136 is refused). Inside
    # aot.gpu_target the target's 9.0 and cuDNN 9.28 answer; outside, jax's checks are back.
    import jax
    from jax._src import xla_bridge
    from jax._src.cudnn import fused_attention_stablehlo as fa

    if "cuda" in xla_bridge.get_backend().platform_version:
        pytest.skip("this host has a CUDA GPU: jax's checks read it")
    q = jax.ShapeDtypeStruct((2, 256, 4, 136), "bfloat16")
    layout = fa.AttentionLayout.BTNH.value
    originals = (fa.check_compute_capability, fa.check_cudnn_version)
    with pytest.raises(NotImplementedError, match="head dim must be <= 128"):
        fa.check_is_flash_attention(q, q, q, layout, 92800, False, True)
    with aot.gpu_target(aot.parse_target("h200x8")):
        assert fa.check_compute_capability("9.0") and not fa.check_compute_capability("10.0")
        assert fa.is_cuda_compute_capability_equal("9.0") and fa.check_cudnn_version() == 92800
        fa.check_is_flash_attention(q, q, q, layout, 92800, False, True)  # accepted: <= 256
    with aot.gpu_target(aot.parse_target("v5e-4")):  # a TPU target changes nothing
        assert fa.check_compute_capability is originals[0]
    assert (fa.check_compute_capability, fa.check_cudnn_version) == originals
    with pytest.raises(NotImplementedError, match="head dim must be <= 128"):
        fa.check_is_flash_attention(q, q, q, layout, 92800, False, True)


_LAYER = r'''
import json
import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from goat_jax import GoatAttention, PriorSettings, aot

target = aot.parse_target("h200x8")
devices = aot.target_devices(target)
B, T, E = 8, 1024, 512
HEADS = {"q_proj/kernel": P(None, "tensor"), "k_proj/kernel": P(None, "tensor"),
         "v_proj/kernel": P(None, "tensor"), "q_proj/bias": P("tensor"), "k_proj/bias": P("tensor"),
         "v_proj/bias": P("tensor"), "out_proj/kernel": P("tensor")}
out = {"device_kind": devices[0].device_kind}
cases = {"cudnn": ("cudnn", 64, (8, 1), False), "auto": (None, 64, (8, 1), False),
         "head_dim_128": ("cudnn", 128, (8, 1), False), "heads_over_tensor": ("cudnn", 64, (4, 2), True),
         "segments": (None, 64, (8, 1), False), "segments_heads_over_tensor": (None, 64, (4, 2), True)}
for case, (impl, head_dim, shape, heads) in cases.items():
    mesh = Mesh(np.array(devices).reshape(shape), ("data", "tensor"))
    attn = GoatAttention(num_heads=4, kv_num_heads=2, head_dim=head_dim, implementation=impl,
                         prior=PriorSettings(pos_rank=8, abs_rank=8, training_seq_len=T), dtype=jnp.bfloat16)
    x = jax.ShapeDtypeStruct((B, T, E), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    # Packed documents: segment ids [B, T] (abstract here; the packed layout is built in the step).
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    kw = {"segment_ids": seg} if case.startswith("segments") else {}
    def spec(path):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return next((s for k, s in HEADS.items() if heads and name.endswith(k)), P())
    with jax.set_mesh(mesh), aot.gpu_target(target):
        params = jax.eval_shape(lambda x: flax.core.meta.unbox(attn.init(jax.random.key(0), x, is_causal=True)), x)
        params = jax.tree_util.tree_map_with_path(
            lambda path, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec(path))), params)
        loss = lambda p, x, s: jnp.mean(attn.apply(p, x, is_causal=True, **({"segment_ids": s} if kw else {}))
                                        .astype(jnp.float32) ** 2)
        compiled = jax.jit(jax.grad(loss)).lower(params, x, seg).compile()
    text = compiled.as_text()
    fwd = [l for l in text.splitlines() if 'custom_call_target="__cudnn$fmhaSoftmax"' in l]
    out[case] = dict(calls=aot.custom_calls(text), memory=aot.memory(compiled),
                     operands=re.findall(r"bf16\[[0-9,]+\]", fwd[0].split("operand_layout_constraints=")[1])[:3] if fwd else None,
                     param_bytes=sum(int(np.prod(a.shape)) * 4 for a in jax.tree.leaves(params)))
print("RESULT " + json.dumps(out))
'''.replace("import json\n", "import json\nimport re\n", 1)


@needs_cuda_plugin
@pytest.mark.slow(reason="needs the aot-gpu extra (the CUDA plugin, ~3.2 GB of wheels), which CI does not install; four layer compiles for 8 H200s, ~20 s")
def test_goat_layer_with_cudnn_compiles_sharded_for_8_h200s():
    proc = _run(["-c", _LAYER])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ")[-1])
    assert out["device_kind"] == "NVIDIA H200"
    batch_per_device = 8 * 1024 * 512 * 4 // 8  # float32 inputs split over 8 GPUs
    for case in ("cudnn", "auto", "head_dim_128", "heads_over_tensor", "segments", "segments_heads_over_tensor"):
        r = out[case]
        # cuDNN's fused attention, forward and backward, in the compiled GPU program (with
        # segment ids: cuDNN's packed layout, chosen automatically for the H200).
        assert r["calls"].get("__cudnn$fmhaSoftmax") == 1 and r["calls"].get("__cudnn$fmhaSoftmaxBackward") == 1, r
        mem = r["memory"]
        assert mem["temporaries"] > 0 and mem["total"] == (mem["arguments"] + mem["outputs"]
                                                           + mem["temporaries"] - mem["aliased"]), r
    for case in ("cudnn", "auto", "head_dim_128"):  # batch over 8, parameters replicated
        r = out[case]  # (XLA drops the few parameters this prior leaves unused: 0.99)
        assert batch_per_device + 0.99 * r["param_bytes"] <= r["memory"]["arguments"] < 2 * batch_per_device + r["param_bytes"], r
    # Per device: 1 sequence, 4 query heads, 2 key heads; packed q/k 66 -> 72 and 130 -> 136
    # (multiples of 8), v at its own 64 (cuDNN >= 9.10 on Hopper takes q/k wider than v),
    # accepted for the H200 although this host has no GPU (aot.gpu_target).
    assert out["cudnn"]["operands"] == ["bf16[1,1024,4,72]", "bf16[1,1024,2,72]", "bf16[1,1024,2,64]"]
    assert out["head_dim_128"]["operands"][0] == "bf16[1,1024,4,136]"
    # Heads over a tensor axis of 2 (batch over 4): jax's partitioning of the cuDNN call runs
    # each GPU's 2 query heads and 1 key head, and the arguments hold half the projections.
    assert out["heads_over_tensor"]["operands"] == ["bf16[2,1024,2,72]", "bf16[2,1024,1,72]", "bf16[2,1024,1,64]"]
    # The packed layout (goat_jax/kernels/cudnn_packed.py): K/V repeated to the 4 query heads and
    # v padded to the q/k width, one device's rows under shard_map (and its heads over tensor).
    assert out["segments"]["operands"] == ["bf16[1,1024,4,72]"] * 3
    assert out["segments_heads_over_tensor"]["operands"] == ["bf16[2,1024,2,72]"] * 3
    r = out["heads_over_tensor"]
    assert r["memory"]["arguments"] - 2 * batch_per_device < 0.6 * r["param_bytes"], r  # a quarter of the batch


@needs_cuda_plugin
@pytest.mark.slow(reason="needs the aot-gpu extra (the CUDA plugin), which CI does not install; a smoke LM train step compiled for 8 H200s through experiments.compile, ~20 s")
def test_smoke_lm_train_step_compiles_for_h200x8_through_experiments_compile(tmp_path):
    proc = _run(["-m", "experiments.compile", "--config", "configs/lm_tiny.py:goat,smoke",
                 "--config.seq_len=128", "--config.model.dtype=bfloat16", "--target", "h200x8",
                 "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "compile.json").read_text())
    assert (report["target"], report["num_devices"], report["topology"]) == ("h200x8", 8, "1x1x8")
    assert report["device_kind"] == "NVIDIA H200" and report["device_memory_bytes"] == 141 << 30
    assert report["attention_implementation"] == "cudnn"  # chosen for the GPU mesh, not the CPU host
    assert report["custom_calls"]["__cudnn$fmhaSoftmax"] >= 1
    assert report["custom_calls"]["__cudnn$fmhaSoftmaxBackward"] >= 1
    mem = report["per_device_bytes"]
    assert mem["aliased"] > 0 and mem["total"] > 0 and report["fits"] is True
    assert report["estimated_step_seconds"] == pytest.approx(report["model_flops_per_step"] / (8 * 989e12))
    assert "__cudnn$fmhaSoftmax" in (tmp_path / "compile.md").read_text()


@pytest.mark.parametrize("t, s, causal, masking", [(197, 197, False, None), (9, 9, True, None),
                                                    (5, 9, False, "lengths"), (7, 7, False, "mask"), (6, 8, False, None)])
def test_odd_lengths_are_padded_exactly_for_cudnn(t, s, causal, masking):
    """kernels.pad_lengths to even lengths (what the cuDNN path applies: jax 0.10.2's cuDNN training rule needs
    even lengths): attention on the padded inputs, the extra query row dropped, equals the
    float64 reference on the real ones, values and gradients, with kv_lengths or a padding mask."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from goat_jax import kernels

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape) for shape in ((2, t, 2, 8), (2, s, 2, 8), (2, s, 2, 8)))
    lengths = jnp.array([s, s - 2]) if masking == "lengths" else None
    mask = jnp.zeros((2, s), bool).at[1, -3:].set(True) if masking == "mask" else None  # True = ignored

    def attention(q, k, v, lengths, mask):  # float64, cuDNN's masking contract (causal top-left)
        t, s = q.shape[1], k.shape[1]
        logits = jnp.einsum("btnd,bsnd->bnts", q, k) / np.sqrt(8)
        keep = jnp.ones((2, 1, t, s), bool)
        if causal:
            keep &= jnp.tril(jnp.ones((t, s), bool))
        if lengths is not None:
            keep &= (jnp.arange(s) < lengths[:, None])[:, None, None, :]
        if mask is not None:
            keep &= ~mask[:, None, None, :]
        p = jax.nn.softmax(jnp.where(keep, logits, -jnp.inf), axis=-1)
        return jnp.einsum("bnts,bsnd->btnd", p, v)

    def reference(q, k, v):
        return attention(q, k, v, lengths, mask)

    def padded(q, k, v):
        qp, kp, vp, padded_mask = kernels.pad_lengths(
            q, k, v, kernels.AttentionMask(key_padding=mask, kv_lengths=lengths), 2)
        assert qp.shape[1] % 2 == 0 and kp.shape[1] % 2 == 0
        return attention(qp, kp, vp, padded_mask.kv_lengths, padded_mask.key_padding)[:, :t]

    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(a, jnp.float64) for a in (q, k, v))
        # Compiled (op by op, each side compiled ~50 one-op programs); float64 either way.
        np.testing.assert_allclose(jax.jit(padded)(q, k, v), jax.jit(reference)(q, k, v), rtol=1e-10, atol=1e-12)
        g_ref = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(reference(*a))), argnums=(0, 1, 2)))(q, k, v)
        g_pad = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(padded(*a))), argnums=(0, 1, 2)))(q, k, v)
        for a, b in zip(g_pad, g_ref):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)


@needs_cuda_plugin
@pytest.mark.slow(reason="needs the aot-gpu extra (the CUDA plugin), which CI does not install; a ViT train "
                         "step (197 tokens) compiled for one H200 through experiments.compile, ~1 min")
def test_a_vit_with_197_tokens_trains_on_cudnn_for_one_h200(tmp_path):
    """197 tokens (196 patches + CLS) is odd: before padding to even lengths the cuDNN path failed at the
    first training step ("Unsupported sequence length Q 197, KV 197"); now it compiles with the
    fused-attention calls forward and backward."""
    proc = _run(["-m", "experiments.compile", "--config", "configs/vit_s16_imagenet.py:goat", "--target", "h200x1",
                 "--config.model.num_layers=2", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "compile.json").read_text())
    assert report["attention_implementation"] == "cudnn" and report["fits"] is True
    assert report["custom_calls"]["__cudnn$fmhaSoftmax"] >= 1 and report["custom_calls"]["__cudnn$fmhaSoftmaxBackward"] >= 1


@needs_cuda_plugin
@pytest.mark.slow(reason="needs the aot-gpu extra (the CUDA plugin), which CI does not install; a smoke LM train step under ring attention compiled for 8 H200s")
def test_ring_on_cudnn_blocks_compiles_for_h200x8(tmp_path):
    """The smoke LM (bf16) with its sequence over 8 GPUs and context_strategy='ring': the automatic
    choice runs the ring's block pairs on cuDNN (goat_jax/kernels/ring_blocks.py), so the compiled
    step holds cuDNN's fused forward and backward calls and the keys travel by collective permutes."""
    proc = _run(["-m", "experiments.compile", "--config", "configs/lm_tiny.py:goat,smoke",
                 "--config.seq_len=256", "--config.model.dtype=bfloat16", "--config.mesh.context=8",
                 "--config.mesh.data=1", "--config.context_strategy=ring", "--config.context_load_balance=True",
                 "--target", "h200x8", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "compile.json").read_text())
    assert report["attention_implementation"] == "cudnn" and report["fits"] is True, report
    assert report["custom_calls"]["__cudnn$fmhaSoftmax"] >= 1, report["custom_calls"]
    assert report["custom_calls"]["__cudnn$fmhaSoftmaxBackward"] >= 1, report["custom_calls"]


@needs_cuda_plugin
@pytest.mark.slow(reason="needs the aot-gpu extra (the CUDA plugin), which CI does not install; a smoke LM train step compiled for one H200 with config.gpu_xla_flags, ~20 s")
def test_gpu_xla_flags_are_accepted_by_the_gpu_compiler(tmp_path):
    """Every option of goat_jax.platforms.GPU_XLA_FLAGS is one jax 0.10.2's GPU compiler knows
    (an unknown one fails the compile: 'No such compile option')."""
    proc = _run(["-m", "experiments.compile", "--config", "configs/lm_tiny.py:goat,smoke",
                 "--config.seq_len=128", "--config.model.dtype=bfloat16", "--config.gpu_xla_flags=True",
                 "--target", "h200x1", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "compile.json").read_text())["fits"] is True
