"""Ulysses (goat_jax/kernels/ulysses.py; ``context_strategy='ulysses'``, all-to-all over heads) on
8 fake CPU devices: values and gradients against the float64 reference for c = 2, 4, 8, causal
and not, with segment ids, key padding, load balancing, GQA with KV heads divisible by c and
fewer than c (repeated, with the log line saying what it costs), on 'xla', 'flash' and 'dense';
the compiled program exchanges with all-to-alls and gathers only the [B, T] masks; a GOAT layer
and a bias encoding (Kerple-log, on 'xla') under Ulysses equal one device. The refusals: heads that
mesh.context does not divide (the config, before any work; a hand-built call, before its
compile) and the KV cache path, each in one line. The engine under Ulysses (the tiny LM with
packed documents at context 4 against context 1, resumed from all-gather and ring checkpoints)
runs in tests/test_context.py's engine plan (one process for every strategy)."""

import json
import logging

import numpy as np
import pytest

from tests.config_helpers import lm_smoke_config, run_on_fake_devices

_SCRIPT = r'''
import json, logging, sys
import flax, jax, jax.numpy as jnp, numpy as np
from goat_jax import kernels
from goat_jax.prior import segments as seglib
from goat_jax.kernels import balance
from goat_jax.layers.positional import PositionalAttention
from goat_jax.kernels.plan import AttentionPlan
from tests import goat_reference as ref
from tests import jitted
from tests.ring_cases import ring_case

notes = []
handler = logging.Handler()
handler.emit = lambda record: notes.append(record.getMessage())
logging.getLogger("goat_jax").addHandler(handler)
logging.getLogger("goat_jax").setLevel(logging.INFO)

B, T, N, H = 2, 32, 8, 8
rng = np.random.default_rng(0)
out = {"kernel": [], "layers": []}
for c, balanced, causal, seg, pad, kh, impl in json.loads(sys.argv[1]):
    q, k, v, ct = (rng.normal(size=s).astype(np.float32) for s in ((B, T, N, H), (B, T, kh, H), (B, T, kh, H + 2),
                                                                  (B, T, N, H + 2)))
    ids, kpm, want, order, perm, mesh = ring_case(rng, q, k, v, ct, c=c, balanced=balanced, seg=seg, pad=pad,
                                                  padded_tail=5, causal=causal)

    def f(q_, k_, v_, ct_, ids_, kpm_):
        kw = {} if ids_ is None else {"segment_ids": ids_}
        plan = AttentionPlan(context_strategy="ulysses", load_balanced=balanced)
        res, vjp = jax.vjp(lambda a, b_, d: kernels.attend(a, b_, d, implementation=impl, scale=0.3, plan=plan,
                                                           is_causal=causal, key_padding_mask=kpm_, **kw), q_, k_, v_)
        return (res,) + vjp(ct_)
    args = [perm(x) for x in (q, k, v, ct, ids, kpm)]
    with jax.set_mesh(mesh):
        compiled = jax.jit(f).lower(*args).compile()
        got = compiled(*args)
    text = compiled.as_text()
    inv = np.argsort(order)
    got = [np.asarray(jnp.take(g, inv, axis=1)) for g in got]
    out["kernel"].append({"case": [c, balanced, causal, seg, pad, kh, impl],
                          "errors": [float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want)],
                          "all_to_alls": text.count("all-to-all("), "gathers": text.count("all-gather(")})
# Layers: GOAT (packed prior) and Kerple-log (a materialized bias, on 'xla') under Ulysses vs one
# device, values and gradients, the engine's way (load-balanced batches, positions explicit).
E, t = 16, 32
x = jnp.asarray(rng.normal(size=(B, t, E)), jnp.float32)
w = jnp.asarray(rng.normal(size=(B, t, E)), jnp.float32)
for enc, impl, c, balanced, with_seg in json.loads(sys.argv[2]):
    common = dict(num_heads=4, kv_num_heads=2, head_dim=8, implementation=impl)
    module = (ref.goat_module(pos_rank=2, abs_rank=2, training_seq_len=t, **common) if enc == "goat"
              else PositionalAttention(position_encoding=enc, **common))
    seg = None
    if with_seg:
        cuts = np.sort(rng.integers(1, t, size=(B, 3)), axis=1)
        seg = jnp.asarray((np.arange(t)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t), (B, t)) if seg is None else seglib.segment_positions(seg)
    params = flax.core.meta.unbox(jitted.init(module, jax.random.key(0), x, is_causal=True))
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.5, a.shape), a.dtype), params)

    def grad_of(m):
        loss = lambda p, x_, pos_, seg_, w_: jnp.sum(m.apply(p, x_, is_causal=True, q_positions=pos_,
                                                             k_positions=pos_, segment_ids=seg_) * w_)
        return jax.value_and_grad(loss, argnums=(0, 1))
    ref_val, (ref_gp, ref_gx) = jax.jit(grad_of(module))(params, x, pos, seg, w)
    order = balance.balance_order(t, c) if balanced else np.arange(t)
    perm = lambda a: None if a is None else jnp.take(a, order, axis=1)
    mesh = jax.make_mesh((8 // c, 1, c, 1), ("data", "fsdp", "context", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 4)
    run = grad_of(module.clone(implementation=None,  # one holder: the plan
        plan=AttentionPlan(implementation=module.implementation, context_strategy="ulysses", load_balanced=balanced)))
    with jax.set_mesh(mesh):
        val, (gp, gx) = jax.jit(run)(params, perm(x), perm(pos), perm(seg), perm(w))
    gx = jnp.take(gx, np.argsort(order), axis=1)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves((ref_gp, ref_gx)))
    out["layers"].append({"case": [enc, impl, c, balanced, with_seg], "error": max(
        [abs(float(val - ref_val)) / abs(float(ref_val))]
        + [float(jnp.max(jnp.abs(a - b))) / scale for a, b in zip(jax.tree.leaves((gp, gx)),
                                                                   jax.tree.leaves((ref_gp, ref_gx)))])})
out["notes"] = notes
print("RESULT " + json.dumps(out))
'''

TOLERANCE = 2e-5  # float32 round-off, relative to the largest entry (as tests/test_ring.py)
# Layers against one device in float32 (not float64): the parameters' gradients are summed over
# the devices in another order; up to 2.4e-5 seen (RoPE on 'xla', c = 2, segment ids, parameters of
# std 0.5), 1e-6 typical; tests/test_ring.py allows the ring 1e-4 for the same reason.
LAYER_TOLERANCE = 1e-4

# (c, balanced, causal, segment ids, key padding, KV heads, kernel): every c, causal and not,
# balanced and not, segments and padding, KV heads divisible by c (8 at c = 2) and fewer than c
# (2 at c = 4 and 8, MQA's 1 at c = 4), each kernel of the CPU rows; the slow test runs them all.
_DEFAULT_CASES = [[2, False, True, False, False, 8, "xla"], [4, True, True, True, True, 2, "flash"],
                  [8, False, False, True, True, 2, "flash"], [4, False, True, False, False, 1, "dense"]]
# The bias path here; GOAT's layer under Ulysses trains in tests/test_context.py's engine plan
# (the tiny GOAT LM, packed documents) and is compared layer by layer in the slow test.
_DEFAULT_LAYERS = [["kerple_log", "xla", 2, False, False]]


def _check(cases, layers, timeout):
    out = json.loads(run_on_fake_devices(_SCRIPT, json.dumps(cases), json.dumps(layers),
                                         timeout=timeout).split("RESULT ")[-1])
    for row in out["kernel"]:
        c, _, _, seg, pad, kh, _ = row["case"]
        assert max(row["errors"]) <= TOLERANCE, row
        # q, k, v there and the output back, forward and backward: all-to-alls; only the [B, T]
        # segment ids and key padding are gathered.
        assert row["all_to_alls"] >= 8, row
        assert row["gathers"] <= (2 if seg or pad else 0), row
    for row in out["layers"]:
        assert row["error"] <= LAYER_TOLERANCE, row
    return out


def test_ulysses_kernel_and_layers_equal_the_reference():
    out = _check(_DEFAULT_CASES, _DEFAULT_LAYERS, 900)
    # KV heads fewer than c are repeated, and the log line says by how much and what it costs.
    notes = [n for n in out["notes"] if "repeats each of a device's" in n]
    assert any("2 KV heads 2x (to 4" in n and "MiB per device and layer" in n for n in notes), notes
    assert any("1 KV heads 4x (to 4" in n for n in notes), notes  # MQA at c = 4
    assert any("context strategy 'ulysses' over 4 devices, load-balanced, heads exchanged all-to-all: each device "
               "runs flash on the whole sequence for 1/4 of the heads (load balancing not needed" in n
               for n in out["notes"]), out["notes"]


@pytest.mark.slow(reason="every combination of c, balancing, mask, segments, padding and KV heads (96 cases)")
def test_ulysses_kernel_every_combination():
    cases = [[c, bal, causal, seg, pad, kh, "flash"] for c in (2, 4, 8) for bal in (False, True)
             for causal in (False, True) for seg in (False, True) for pad in (False, True) for kh in (8, 2)]
    layers = [[enc, impl, c, bal, seg] for enc, impl in (("goat", "flash"), ("rope", "xla")) for c in (2, 4)
              for bal in (False, True) for seg in (False, True)] + [["kerple_log", "xla", 4, True, True]]
    _check(cases, layers, 3000)


def _validate(**overrides):
    from goat_jax.train import trainer  # pylint: disable=g-import-not-at-top
    return trainer.validate_config(lm_smoke_config(**overrides), 8)


@pytest.mark.parametrize("overrides,match", [
    ({"mesh.context": 8, "mesh.data": 1, "context_strategy": "ulysses"},
     r"^context_strategy='ulysses' splits the query heads over mesh.context=8, but model.num_heads is 4, not a "
     r"multiple of 8: choose mesh.context among \[2, 4\], or context_strategy='ring'"),
    ({"mesh.context": 4, "mesh.data": 1, "mesh.tensor": 2, "context_strategy": "ulysses"},
     r"^context_strategy='ulysses' .* model.num_heads=4 over mesh.tensor=2, per device, is 2, not a multiple of 4"),
])
def test_heads_that_the_context_axis_does_not_divide_are_refused_before_any_work(overrides, match):
    with pytest.raises(ValueError, match=match) as err:
        _validate(**overrides)
    assert "\n" not in str(err.value)


def test_ulysses_settings_that_run_are_accepted():
    """KV heads fewer than c (the smoke LM's 2 at context 4) are repeated, not refused; load
    balancing is accepted (exact, only not needed)."""
    _validate(**{"mesh.context": 4, "mesh.data": 2, "context_strategy": "ulysses"})
    _validate(**{"mesh.context": 2, "mesh.data": 4, "context_strategy": "ulysses", "context_load_balance": True})


def _abstract_call(n, t, s, plan_strategy="ulysses", **kw):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    from goat_jax import kernels  # pylint: disable=g-import-not-at-top
    from goat_jax.kernels.plan import AttentionPlan  # pylint: disable=g-import-not-at-top
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "context"))
    q = jnp.zeros((2, t, n, 8), jnp.float32)
    k = jnp.zeros((2, s, 2, 8), jnp.float32)
    return kernels.attend(q, k, k, implementation="xla", mesh=mesh, plan=AttentionPlan(context_strategy=plan_strategy),
                          **kw)


def test_a_hand_built_call_with_heads_c_does_not_divide_is_refused_before_its_compile():
    with pytest.raises(ValueError, match=r"^context_strategy='ulysses' splits the query heads over mesh.context=4, "
                                         r"but model.num_heads is 6, not a multiple of 4") as err:
        _abstract_call(6, 16, 16)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("t,s,kw,match", [
    (1, 16, {}, r"mesh.context=4 with context_strategy='ulysses' shards self-attention over one sequence, but the "
                r"queries have 1 positions and the keys 16 .*Run decoding and cross-attention with mesh.context=1"),
    (16, 16, {"is_causal": True, "causal_offset": np.int32(3) * 1},
     r"context_strategy='ulysses' needs a static causal offset"),
])
def test_the_kv_cache_path_is_refused_in_one_line(t, s, kw, match):
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    if "causal_offset" in kw:
        kw = dict(kw, causal_offset=jnp.asarray(3, jnp.int32))  # traced, as while decoding
    with pytest.raises(ValueError, match=match) as err:
        _abstract_call(8, t, s, **kw)
    assert "\n" not in str(err.value)


def test_the_choice_names_ulysses_and_the_kernel_it_runs_on_the_whole_sequence(caplog):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    from goat_jax.kernels import choice  # pylint: disable=g-import-not-at-top
    from goat_jax.kernels.plan import AttentionPlan  # pylint: disable=g-import-not-at-top
    mesh = jax.sharding.AbstractMesh((1, 4), ("data", "context"))
    with caplog.at_level(logging.INFO, logger="goat_jax"), choice.record_choices() as found:
        choice.resolve_implementation(None, jnp.float32, 26, (1, 4, 48, 48), mesh=mesh,
                                      plan=AttentionPlan(context_strategy="ulysses"))
    assert [(c["implementation"], c["context_strategy"], c["whole_sequence"]) for c in found] == [
        ("xla", "ulysses", "xla")]
    assert ("context strategy 'ulysses' over 4 devices, not load-balanced, heads exchanged all-to-all: each device "
            "runs xla on the whole sequence for 1/4 of the heads (no load balancing needed)") in caplog.text


class _Hopper:
    device_kind = "NVIDIA H200"


@pytest.mark.parametrize("strategy,packed", [("all_gather", False), ("ring", False), ("ulysses", True)])
def test_packed_documents_take_cudnns_packed_layout_only_where_the_kernel_sees_whole_sequences(
        monkeypatch, strategy, packed):
    """On a Hopper GPU with segment ids over context 4: Ulysses runs the whole sequence under the
    global mask, so cuDNN's packed layout serves it; under all-gather (each shard's queries at their
    offset against every key) and ring the ids are ragged per device, so the automatic choice runs
    flash and an explicit 'cudnn' is refused in one line (all-gather's shards used to reach the
    packed layout, which aligns query and key documents top-left: wrong there)."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    from goat_jax.kernels import choice  # pylint: disable=g-import-not-at-top
    from goat_jax.kernels.plan import AttentionPlan  # pylint: disable=g-import-not-at-top
    # Its own "where": choice.log_once keeps every line once per process, and tests/test_ring_blocks.py
    # asserts the ring's line.
    monkeypatch.setattr(choice, "target", lambda *a, **kw: ("gpu", "the Ulysses choice test", _Hopper()))
    mesh = jax.sharding.AbstractMesh((1, 4), ("data", "context"))
    plan = AttentionPlan(context_strategy=strategy)
    shape = (1, 8, 4096, 4096)
    pick = lambda impl, **kw: choice.resolve_implementation(impl, jnp.bfloat16, 72, shape, mesh=mesh, plan=plan, **kw)
    assert pick(None, segments=True) == ("cudnn" if packed else "flash")
    if packed:
        assert pick("cudnn", segments=True) == "cudnn"
    else:
        why = "packed self-attention only" if strategy == "all_gather" else "under context_strategy='ring'"
        with pytest.raises(ValueError, match=why) as err:
            pick("cudnn", segments=True)
        assert "\n" not in str(err.value)
    if strategy != "ring":  # without segment ids cuDNN serves every strategy but the ring's masks
        assert pick(None) == "cudnn"


@pytest.mark.slow(reason="compiles the FineWeb 1B step for 8 H200s with the CUDA plugin (the aot-gpu extra, not installed in CI)")
def test_fineweb_with_packed_documents_under_ulysses_runs_cudnn_packed_on_8_h200s():
    """The issue's done-when on a host with the aot-gpu extra: configs/lm_fineweb_1b.py (packed
    documents, GQA 32:8) at 32,768 tokens over context 8 compiles for h200x8 under Ulysses with
    cuDNN's fused forward and backward calls (not flash: each device runs cuDNN's packed layout on
    the whole sequence) and fits. Not run where the plugin is missing (benchmarks/context.md)."""
    from goat_jax import aot  # pylint: disable=g-import-not-at-top
    from tests.config_helpers import run_compile_only  # pylint: disable=g-import-not-at-top
    if not aot.cuda_plugin_installed():
        pytest.skip("JAX's CUDA plugin is not installed: pip install 'goat-jax[aot-gpu]'")
    proc = run_compile_only(["benchmarks/context_strategies.py", "--config", "configs/lm_fineweb_1b.py:goat",
                             "--target", "h200x8", "--seq_len", "32768", "--context", "8", "--strategies", "ulysses"],
                            1800, gpu=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["whole_sequence"] == "cudnn" and row["fits"] is True, row
    calls = row["custom_calls"]
    assert any(k.startswith("__cudnn$fmha") and "Backward" not in k for k in calls), calls
    assert any(k.startswith("__cudnn$fmha") and "Backward" in k for k in calls), calls
    assert row["collectives"]["all-to-all"]["count"] >= 8, row


def test_the_compile_tool_names_ulysses_and_the_kernel_it_runs(tmp_path):
    """experiments.compile for a TPU slice (libtpu installed) under Ulysses: compile.json and
    compile.md name the strategy and the kernel each device runs on the whole sequence (splash,
    the automatic choice on TPU), whose calls are in the compiled step; the tiny LM's 4 heads over
    context 4."""
    from goat_jax import aot  # pylint: disable=g-import-not-at-top
    from tests.config_helpers import run_compile_only  # pylint: disable=g-import-not-at-top
    if not aot.libtpu_installed():
        pytest.skip("libtpu is not installed: pip install 'goat-jax[aot]'")
    proc = run_compile_only(["-m", "experiments.compile", "--config", "configs/lm_tiny.py:goat,smoke",
                             "--config.seq_len=512", "--config.global_batch_size=1", "--config.mesh.data=1",
                             "--config.mesh.context=4", "--config.context_strategy=ulysses", "--target", "v5e-4",
                             "--out", str(tmp_path)], 600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "compile.json").read_text())
    assert (report["context_strategy"], report["whole_sequence"], report["attention_implementation"]) == (
        "ulysses", "splash", "splash"), report
    assert report["custom_calls"].get("tpu_custom_call", 0) >= 3, report["custom_calls"]
    assert "context strategy ulysses, heads exchanged: splash on the whole sequence" in proc.stdout
    assert ("| context parallelism | strategy ulysses, load-balanced False, heads exchanged all-to-all: splash on "
            "the whole sequence per device |") in (tmp_path / "compile.md").read_text()
