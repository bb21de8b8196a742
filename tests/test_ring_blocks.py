"""Ring attention's block kernels (goat_jax/kernels/ring_blocks.py) on 8 fake CPU devices against
the float64 reference, values and gradients: splash kernels in interpret mode
('splash_interpret', forward with residuals, backward through splash's dq / dkv kernels fed with
the global output and log-sum-exp), and the cuDNN blocks' arithmetic through a pure-JAX stand-in
of jax's private cuDNN calls (tests/cudnn_stand_in.py). Cases: context shards c = 2, 4, 8,
load-balanced or not, segment ids, key padding, GQA / MQA, v narrower than q/k, causal or not.
Splash runs whole 128-token blocks, so every run here is one block (interpret mode is slow).
Also: the automatic choice under ring on TPU / GPU targets, and (slow) the tiny LM with packed
documents trained under ring on splash blocks with the losses of one device."""

import json

import numpy as np
import pytest

from tests.config_helpers import run_on_fake_devices

_SCRIPT = r'''
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from goat_jax.kernels import ring, ring_blocks
from goat_jax.kernels.mask import AttentionMask
from goat_jax.kernels.plan import AttentionPlan
from tests import cudnn_stand_in
from tests.ring_cases import ring_case

cases = json.loads(sys.argv[1])
rng = np.random.default_rng(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
out = []
for backend, c, balanced, seg, pad, n, kh, causal in cases:
    t0 = time.time()
    B, H, Hv = 2, 8, 6
    T = c * (2 if balanced else 1) * 128
    q = rng.normal(size=(B, T, n, H)).astype(np.float32)
    k = rng.normal(size=(B, T, kh, H)).astype(np.float32)
    v = rng.normal(size=(B, T, kh, Hv)).astype(np.float32)
    ct = rng.normal(size=(B, T, n, Hv)).astype(np.float32)
    ids, kpm, want, order, perm, mesh = ring_case(rng, q, k, v, ct, c=c, balanced=balanced, seg=seg, pad=pad,
                                                  padded_tail=37, causal=causal)
    blocks = None
    impl = backend
    if backend == "cudnn_stand_in":
        blocks, impl = ring_blocks.CudnnBlocks(cudnn_stand_in.calls), "cudnn"

    def f(q_, k_, v_, ct_, ids_, kpm_):
        mask = AttentionMask(causal=causal, key_padding=kpm_, q_segment_ids=ids_, kv_segment_ids=ids_)
        plan = AttentionPlan(context_strategy="ring", load_balanced=balanced)
        fn = lambda a, b_, d: ring.attend(a, b_, d, mask=mask, bias=None, mesh=mesh, plan=plan,
                                          implementation=impl, scale=0.3, blocks=blocks)
        res, vjp = jax.vjp(fn, q_, k_, v_)
        return (res,) + vjp(ct_)
    with jax.set_mesh(mesh):
        step = jax.jit(f)
        lowered = step.lower(perm(q), perm(k), perm(v), perm(ct), perm(ids), perm(kpm))
        text = lowered.as_text()
        got = step(perm(q), perm(k), perm(v), perm(ct), perm(ids), perm(kpm))
    inv = np.argsort(order)
    got = [np.asarray(jnp.take(g, inv, axis=1)) for g in got]
    out.append({"case": [backend, c, balanced, seg, pad, n, kh, causal],
                "errors": [float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want)],
                "permutes": text.count("collective_permute"), "gathers": text.count("all_gather"),
                "seconds": round(time.time() - t0, 1)})
    print(out[-1], file=sys.stderr, flush=True)
print("RESULT " + json.dumps(out))
'''

TOLERANCE = 2e-6  # float32 round-off relative to the largest entry (1e-7 to 6e-7 seen)


def _run(cases, timeout=600):
    out = json.loads(run_on_fake_devices(_SCRIPT, json.dumps(cases), timeout=timeout).split("RESULT ")[-1])
    assert len(out) == len(cases)
    for row in out:
        assert max(row["errors"]) <= TOLERANCE, row
        assert row["permutes"] > 0 and row["gathers"] == 0, row  # K/V travel by ppermute only
    return out


def test_splash_ring_blocks_equal_the_reference():
    """Two representative cases: segment ids, key padding and GQA unbalanced at c = 2; MQA
    load-balanced at c = 2 (the four chunk pairs: the static full and empty ones and the two that
    switch on the device and step)."""
    _run([["splash_interpret", 2, False, True, True, 4, 2, True],
          ["splash_interpret", 2, True, True, False, 4, 1, True]])


def test_cudnn_ring_blocks_equal_the_reference_through_the_stand_in():
    """cuDNN's block arithmetic (BTNH layouts, stats [B, N, T], the backward bound with the
    global output and stats) on the stand-in: unbalanced, load-balanced, GQA, MQA, not causal."""
    _run([["cudnn_stand_in", 2, False, False, False, 4, 2, True],
          ["cudnn_stand_in", 4, True, False, False, 4, 1, True],
          ["cudnn_stand_in", 2, False, False, False, 4, 4, False]])


_SWITCH_SCRIPT = r'''
import json
import jax, jax.numpy as jnp
from goat_jax.kernels import ring
from goat_jax.kernels.mask import AttentionMask
from goat_jax.kernels.plan import AttentionPlan
from tests import cudnn_stand_in
from goat_jax.kernels import ring_blocks

switches = []
real = jax.lax.switch
def counting(index, branches, *args, **kw):
    switches.append(len(branches))
    return real(index, branches, *args, **kw)
jax.lax.switch = counting
out = {}
for name, blocks, impl in (("splash", None, "splash_interpret"), ("cudnn", ring_blocks.CudnnBlocks(cudnn_stand_in.calls), "cudnn")):
    for c, balanced in ((2, True), (4, True), (2, False)):
        mesh = jax.make_mesh((8 // c, 1, c, 1), ("data", "fsdp", "context", "tensor"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 4)
        x = jax.ShapeDtypeStruct((2, c * 2 * 128, 4, 8), jnp.float32)
        def loss(q, k, v):
            o = ring.attend(q, k, v, mask=AttentionMask(causal=True), bias=None, mesh=mesh, blocks=blocks,
                            plan=AttentionPlan(context_strategy="ring", load_balanced=balanced),
                            implementation=impl, scale=0.3)
            return jnp.sum(o)
        del switches[:]
        with jax.set_mesh(mesh):
            jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, x, x)
        out[f"{name}_{c}_{balanced}"] = list(switches)
print("RESULT " + json.dumps(out))
'''


def test_fused_ring_blocks_run_no_switch_over_masks_when_load_balanced():
    """A load-balanced causal ring hands splash and cuDNN blocks only pairs of one static kind
    (the first step's diagonal pairs causal, every later pair full), so no block switches over
    its masks: the switches' conditionals cost 0.28 GiB of a 65,536-token splash ring's 0.91 on a
    TPU (benchmarks/context.md). Unbalanced, a later step is full or empty: a switch of two."""
    out = json.loads(run_on_fake_devices(_SWITCH_SCRIPT, timeout=600).split("RESULT ")[-1])
    for name in ("splash", "cudnn"):
        assert out[f"{name}_2_True"] == [] and out[f"{name}_4_True"] == [], out
        assert out[f"{name}_2_False"] and set(out[f"{name}_2_False"]) == {2}, out


@pytest.mark.slow(reason="the full matrix of splash ring blocks in interpret mode (~10 min on 2 cores)")
def test_splash_ring_blocks_every_combination():
    cases = [["splash_interpret", c, bal, seg, pad, 4, kh, True] for c in (2, 4, 8) for bal in (False, True)
             for seg in (False, True) for pad in (False, True) for kh in ((2,) if seg == pad else (1, 4))]
    cases += [["splash_interpret", 4, False, True, True, 4, 2, False], ["cudnn_stand_in", 8, True, False, False, 4, 2, True]]
    _run(cases, timeout=3000)


class _Device:
    def __init__(self, kind):
        self.device_kind = kind


def _context_mesh(platform: str, kind: str):
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType  # pylint: disable=g-import-not-at-top
    return AbstractMesh((2, 4), ("data", "context"), axis_types=(AxisType.Auto,) * 2,
                        abstract_device=AbstractDevice(device_kind=kind, num_cores=1, platform=platform))


def test_automatic_choice_runs_the_ring_on_the_platforms_fused_blocks(monkeypatch, caplog):
    """Under context_strategy='ring' on a compile-only TPU mesh the automatic choice is splash; on
    a GPU (an H200 here) cuDNN, except with packed documents, which go to flash with cuDNN's reason
    logged; an explicit cuDNN with segment ids is refused in one line; 'dense' is refused."""
    import logging

    import jax
    import jax.numpy as jnp

    from goat_jax import kernels
    from goat_jax.kernels.plan import AttentionPlan

    shape = (1, 8, 4096, 4096)
    ring = AttentionPlan(context_strategy="ring")
    tpu = _context_mesh("tpu", "TPU v5p")
    with jax.sharding.use_abstract_mesh(tpu), kernels.record_choices() as found:
        assert kernels.resolve_implementation(None, jnp.bfloat16, 66, shape, segments=True, plan=ring) == "splash"
        assert found[0]["ring_blocks"] == "splash"  # what compile.json reports
        assert kernels.resolve_implementation("splash", jnp.bfloat16, 66, shape, segments=True, plan=ring) == "splash"
        with pytest.raises(ValueError, match=r"^implementation='dense' cannot take context_strategy='ring'[^\n]*$"):
            kernels.resolve_implementation("dense", jnp.float32, 66, shape, plan=ring)
    gpu = _context_mesh("gpu", "NVIDIA H200")
    monkeypatch.setattr(kernels.choice, "target", lambda *a, **kw: ("gpu", "this test", _Device("NVIDIA H200")))
    caplog.set_level(logging.INFO, logger="goat_jax")
    with kernels.record_choices() as found:
        assert kernels.resolve_implementation(None, jnp.bfloat16, 72, shape, mesh=gpu, plan=ring) == "cudnn"
        assert kernels.resolve_implementation(None, jnp.bfloat16, 72, shape, mesh=gpu, segments=True,
                                              plan=ring) == "flash"
        assert [c["ring_blocks"] for c in found] == ["cudnn", "flash"]
        assert any("cuDNN ring blocks run the plain causal" in r.getMessage() for r in caplog.records)
        with pytest.raises(ValueError, match=r"^implementation='cudnn' cannot take segment ids or key padding under "
                                             r"context_strategy='ring': [^\n]*$"):
            kernels.resolve_implementation("cudnn", jnp.bfloat16, 72, shape, mesh=gpu, segments=True, plan=ring)
    # Under all-gather (the default plan) each shard's ids reach the kernel ragged: flash
    # (tests/test_ulysses.py); on one device, cuDNN's packed layout on Hopper.
    assert kernels.resolve_implementation(None, jnp.bfloat16, 72, shape, mesh=gpu, segments=True) == "flash"
    assert kernels.resolve_implementation(None, jnp.bfloat16, 72, shape, segments=True) == "cudnn"


def test_cudnn_under_all_gather_logs_why_a_causal_mask_is_explicit(monkeypatch, caplog):
    """jax 0.10.2's cuDNN call has top-left causal only, so under context_strategy='all_gather' a
    shard's offset causal mask reaches cuDNN as an explicit mask: the automatic choice keeps cuDNN
    and its log line says why (the cuDNN row's detour), for causal masks only; flash, whose
    loops take the offset, and ring (cuDNN blocks in their own causal mode) say nothing of it."""
    import logging

    import jax.numpy as jnp

    from goat_jax import kernels
    from goat_jax.kernels import capabilities as caps
    from goat_jax.kernels.plan import AttentionPlan

    gpu = _context_mesh("gpu", "NVIDIA H200")
    monkeypatch.setattr(kernels.choice, "target", lambda *a, **kw: ("gpu", "this test", _Device("NVIDIA H200")))
    caplog.set_level(logging.INFO, logger="goat_jax")
    why = "jax 0.10.2's cuDNN call has no causal offset"
    assert caps.CUDNN_GATHERED_CAUSAL_WHY.startswith(why)
    gather = AttentionPlan(context_strategy="all_gather")
    said = lambda: [r.getMessage() for r in caplog.records if why in r.getMessage()]
    for implementation, causal, plan in ((None, False, gather), ("flash", True, gather),
                                         (None, True, AttentionPlan(context_strategy="ring"))):
        assert kernels.choose(implementation, jnp.bfloat16, 72, mesh=gpu, plan=plan, gathered_causal=causal)
        assert not said(), (implementation, causal, plan)
    assert kernels.choose(None, jnp.bfloat16, 72, mesh=gpu, plan=gather, gathered_causal=True).implementation == "cudnn"
    assert len(said()) == 1 and "context strategy 'all_gather' over 4 devices" in said()[0], said()


_ENGINE_SCRIPT = r'''
import json, sys, time
from goat_jax.train import trainer
from tests.config_helpers import lm_smoke_config
root = sys.argv[1]
cases = json.loads(sys.argv[2])


def losses(workdir):
    return [r["train_loss"] for r in map(json.loads, open(workdir + "/metrics.jsonl")) if "train_loss" in r]


out = {}
for name, context, strategy, balance, seq_len in cases:
    t0 = time.time()
    cfg = lm_smoke_config(**{"mesh.context": context, "mesh.data": -1, "context_load_balance": balance,
                             "context_strategy": strategy, "data.packing": "documents", "seq_len": seq_len,
                             "model.implementation": "splash_interpret", "num_train_steps": 3,
                             "log_every_steps": 1, "checkpoint_every_steps": 100, "eval_every_steps": 3})
    summary = trainer.train_and_evaluate(cfg, f"{root}/{name}")
    out[name] = {"losses": losses(f"{root}/{name}"), "eval_loss": summary.get("eval_loss"),
                 "seconds": round(time.time() - t0, 1)}
    print(name, out[name], file=sys.stderr, flush=True)
print("RESULT " + json.dumps(out))
'''


@pytest.mark.slow(reason="three tiny-LM runs with splash in interpret mode (~6 min on 2 busy cores)")
def test_engine_ring_on_splash_blocks_trains_packed_documents_like_one_device(tmp_path):
    """The smoke LM with packed documents, model.implementation='splash_interpret': under
    context_strategy='ring' (c = 2 load-balanced, c = 4 not) its losses and eval loss equal those of
    mesh.context=1 on the same kernel (relative difference <= 1e-4; ~1e-7 seen)."""
    cases = [["c1", 1, "all_gather", False, 512], ["ring_c2_balanced", 2, "ring", True, 512],
             ["ring_c4", 4, "ring", False, 512]]
    out = json.loads(run_on_fake_devices(_ENGINE_SCRIPT, str(tmp_path), json.dumps(cases),
                                         timeout=3000).split("RESULT ")[-1])
    base = out["c1"]
    assert len(base["losses"]) == 3
    for name in ("ring_c2_balanced", "ring_c4"):
        np.testing.assert_allclose(out[name]["losses"], base["losses"], rtol=1e-4, atol=0, err_msg=name)
        np.testing.assert_allclose(out[name]["eval_loss"], base["eval_loss"], rtol=1e-4, err_msg=name)


@pytest.mark.slow(reason="a smoke LM train step under ring compiled for a TPU slice with its Mosaic kernels (~1 min)")
def test_ring_on_splash_blocks_compiles_for_a_tpu_slice(tmp_path):
    """The smoke LM with its sequence over 4 TPU chips and context_strategy='ring': the automatic
    choice runs the blocks on splash, so the compiled step holds Mosaic calls and the report names
    splash as the ring's block kernel (configs/dna_1m.py on v5p-128 does the same:
    benchmarks/context.md)."""
    from goat_jax import aot  # pylint: disable=g-import-not-at-top
    from tests.config_helpers import run_compile_only  # pylint: disable=g-import-not-at-top

    if not aot.libtpu_installed():
        pytest.skip("libtpu (the TPU compiler) is not installed: pip install 'goat-jax[aot]'")
    proc = run_compile_only(["-m", "experiments.compile", "--config", "configs/lm_tiny.py:goat,smoke",
                             "--config.seq_len=1024", "--config.global_batch_size=1", "--config.mesh.data=1",
                             "--config.mesh.context=4", "--config.context_strategy=ring",
                             "--config.context_load_balance=True", "--target", "v5e-4", "--out", str(tmp_path)],
                            timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "compile.json").read_text())
    assert (report["attention_implementation"], report["ring_blocks"]) == ("splash", "splash"), report
    assert report["custom_calls"].get("tpu_custom_call", 0) >= 4 and report["fits"] is True, report["custom_calls"]
