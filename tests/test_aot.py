"""Ahead-of-time compilation for TPU slices on this host (goat_jax/aot/, experiments/compile.py).

Without libtpu: target names, the compiler's out-of-memory message, and the one line that names
the extra. With libtpu (the ``aot`` extra; skipped with the reason otherwise): the real TPU
compiler on compile-only devices of v5e:2x2, the GOAT layer with splash sharded over the 4 chips
(the Mosaic kernels in the compiled program, the batch split per device in memory_analysis),
and the smoke LM's train step through ``python -m experiments.compile``, fitting and not."""

import json

import pytest

from goat_jax import aot
from tests.config_helpers import run_compile_only

needs_libtpu = pytest.mark.skipif(
    not aot.libtpu_installed(),
    reason="libtpu (the TPU compiler) is not installed: pip install 'goat-jax[aot]'")


def _run(args, timeout=300):
    return run_compile_only(args, timeout)


@pytest.mark.parametrize("name, chips, topology", [
    ("v5e-1", 1, "v5e:1x1"), ("v5e-4", 4, "v5e:2x2"), ("v5e-16", 16, "v5e:4x4"),
    ("v5e-256", 256, "v5e:16x16"), ("v6e-8", 8, "v6e:2x4"), ("v4-8", 4, "v4:2x2x1"),
    ("v5p-8", 4, "v5p:2x2x1"), ("v5p-32", 16, "v5p:2x2x4"), ("v5p-128", 64, "v5p:4x4x4")])
def test_targets_are_named_as_cloud_names_them(name, chips, topology):
    # v5e/v6e count chips, v4/v5p TensorCores (2 per chip).
    target = aot.parse_target(name)
    assert (target.num_chips, target.topology_name) == (chips, topology)


@pytest.mark.parametrize("name, message", [
    ("v5e16", "as Cloud names it"), ("v7-8", "as Cloud names it"), ("v5e-12", "power-of-two"),
    ("v5p-9", "power-of-two"), ("v5p-2", "smallest v5p slice is v5p-8")])
def test_bad_target_names_say_what_is_accepted(name, message):
    with pytest.raises(ValueError, match=message):
        aot.parse_target(name)


def test_out_of_memory_is_read_from_the_compilers_message():
    new = aot.out_of_memory(RuntimeError(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (49.27G) exceeds available HBM (15.75G)."))
    assert new["used_bytes"] == int(49.27 * 2**30) and new["limit_bytes"] == int(15.75 * 2**30)
    old = aot.out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran "
                                         "out of memory in memory space hbm. Used 20.5G of 15.75G hbm."))
    assert old["used_bytes"] == int(20.5 * 2**30)
    assert aot.out_of_memory(ValueError("INVALID_ARGUMENT: something else")) is None
    assert aot.fit(10 * 2**30, 16 << 30)["fits"] and not aot.fit(int(15.5 * 2**30), 16 << 30)["fits"]


def test_missing_libtpu_is_one_line_naming_the_extra(tmp_path):
    # The command with the TPU compiler hidden: one 'error:' line naming the extra, no traceback.
    script = ("import runpy, sys\nimport goat_jax.aot.target as a\na.libtpu_installed = lambda: False\n"
              f"sys.argv = ['compile', '--config', 'configs/lm_tiny.py:goat,smoke', '--target', 'v5e-4', "
              f"'--out', {str(tmp_path / 'out')!r}]\n"
              "runpy.run_module('experiments.compile', run_name='__main__')\n")
    proc = _run(["-c", script])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "goat-jax[aot]" in errors[0] and "v5e-4" in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


_LAYER = r'''
import json
import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from goat_jax import GoatAttention, PriorSettings, aot

devices = aot.target_devices(aot.parse_target("v5e-4"))
mesh = Mesh(np.array(devices).reshape(4, 1), ("data", "tensor"))
B, T, E = 8, 1024, 256
x = jax.ShapeDtypeStruct((B, T, E), jnp.float32, sharding=NamedSharding(mesh, P("data")))
out = {"device_kind": devices[0].device_kind}
for impl in ("splash", None):
    attn = GoatAttention(num_heads=4, kv_num_heads=2, head_dim=64, implementation=impl,
                         prior=PriorSettings(pos_rank=8, abs_rank=8, training_seq_len=T), dtype=jnp.bfloat16)
    with jax.set_mesh(mesh):
        params = jax.eval_shape(lambda x: flax.core.meta.unbox(attn.init(jax.random.key(0), x, is_causal=True)), x)
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), params)
        loss = lambda p, x: jnp.mean(attn.apply(p, x, is_causal=True).astype(jnp.float32) ** 2)
        compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
    text = compiled.as_text()
    out[str(impl)] = dict(custom_calls=text.count("tpu_custom_call"), memory=aot.memory(compiled),
                          param_bytes=sum(int(np.prod(a.shape)) * 4 for a in jax.tree.leaves(params)))
print("RESULT " + json.dumps(out))
'''


@needs_libtpu
def test_goat_layer_with_splash_compiles_sharded_for_4_tpu_chips():
    proc = _run(["-c", _LAYER])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ")[-1])
    assert out["device_kind"] == "TPU v5 lite"
    batch_per_device = 8 * 1024 * 256 * 4 // 4  # float32 inputs split over 4 chips
    for impl in ("splash", "None"):  # explicit, and the automatic choice for a TPU mesh
        r = out[impl]
        # Splash's forward and its two backward kernels, as Mosaic custom calls on the TPU.
        assert r["custom_calls"] >= 3, r
        mem = r["memory"]
        # Per device: a quarter of the batch plus the (replicated) parameters, not the whole batch.
        assert batch_per_device + r["param_bytes"] <= mem["arguments"] < 2 * batch_per_device + r["param_bytes"], r
        assert mem["temporaries"] > 0 and mem["total"] == (mem["arguments"] + mem["outputs"]
                                                           + mem["temporaries"] - mem["aliased"]), r


@needs_libtpu
def test_smoke_lm_train_step_compiles_for_v5e_4_through_experiments_compile(tmp_path):
    proc = _run(["-m", "experiments.compile", "--config", "configs/lm_tiny.py:goat,smoke",
                 "--config.seq_len=128", "--target", "v5e-4", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "compile.json").read_text())
    assert (report["target"], report["num_devices"], report["mesh"]) == ("v5e-4", 4, {"data": 4, "fsdp": 1, "context": 1, "tensor": 1})
    assert report["attention_implementation"] == "splash"  # chosen for the TPU mesh, not the CPU host
    # head_dim 16 = 11 content dims + 2 * pos_rank 2 + 1 sink channel (float32)
    assert report["packed_head_dim"] == 16
    mem = report["per_device_bytes"]
    assert set(mem) == {"arguments", "outputs", "temporaries", "aliased", "total"}
    assert mem["aliased"] > 0  # the donated train state is reused for the new one
    assert report["fits"] is True and report["device_memory_bytes"] == 16 << 30
    from goat_jax.config import files as config_files
    from goat_jax.train import tasks
    config = config_files.load_config("configs/lm_tiny.py:goat,smoke", {"seq_len": 128})
    per_token = tasks.get_task("lm").flops_per_token(config)
    assert report["model_flops_per_step"] == pytest.approx(per_token * 8 * 128)
    assert report["estimated_step_seconds"] == pytest.approx(per_token * 8 * 128 / (4 * 197e12))
    assert report["parameters"] > 0 and report["compile_seconds"] > 0
    assert "v5e-4" in (tmp_path / "compile.md").read_text()


@needs_libtpu
def test_a_step_that_does_not_fit_is_reported_not_raised(tmp_path):
    # 131072 sequences of 128 tokens: ~49 GiB of temporaries per v5e chip (16 GiB).
    proc = _run(["-m", "experiments.compile", "--config", "configs/lm_tiny.py:goat,smoke",
                 "--config.seq_len=128", "--config.global_batch_size=131072", "--target", "v5e-4",
                 "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "compile.json").read_text())
    assert report["fits"] is False and report["per_device_bytes"] is None
    assert "HBM" in report["compiler_error"] and report["compiler_used_bytes"] > report["compiler_limit_bytes"]
    assert report["shortfall_bytes"] == report["compiler_used_bytes"] - report["compiler_limit_bytes"]
    assert "short by at least" in (tmp_path / "compile.md").read_text()


def test_reports_render_without_a_compile():
    # compile.md and the benchmarks table from a report's fields, fitting and refused.
    fits = {"target": "v5e-4", "topology": "v5e:2x2", "device_kind": "TPU v5 lite", "num_devices": 4,
            "num_hosts": 1, "mesh": {"data": 4, "fsdp": 1, "tensor": 1}, "global_batch_size": 8,
            "tokens_per_step": 1024, "parameters": 53687, "attention_implementation": "splash",
            "packed_head_dim": 16, "per_device_bytes": {"arguments": 2 << 20, "outputs": 1 << 20,
                                                        "temporaries": 6 << 20, "aliased": 1 << 20,
                                                        "total": 8 << 20},
            "device_memory_bytes": 16 << 30, "fit_margin": 0.05, "fits": True, "margin_bytes": 15 << 30,
            "model_flops_per_step": 4.29e8, "estimated_step_seconds": 5.4e-7,
            "estimated_tokens_per_second_per_chip": 4.7e8, "peak_bf16_flops_per_chip": 197e12,
            "peak_source": aot.CHIPS["v5e"].source, "estimate_note": "at peak", "compile_seconds": 5.6,
            "config": "--config configs/lm_tiny.py:goat,smoke"}
    refused = dict(fits, per_device_bytes=None, fits=False, margin_bytes=None,
                   compiler_error="RESOURCE_EXHAUSTED: Ran out of memory on HBM",
                   compiler_used_bytes=49 << 30, compiler_limit_bytes=int(15.75 * 2**30),
                   shortfall_bytes=(49 << 30) - int(15.75 * 2**30))
    page = aot.markdown(fits)
    assert "| per device: total | 8.00 MiB |" in page and "0.5 us" in page and "| fits (leaving 5% free) | yes" in page
    assert "**no**" in aot.markdown(refused) and "Ran out of memory on HBM" in aot.markdown(refused)
    assert "short by at least 33.25 GiB" in aot.markdown(refused)
    table = aot.summary_table([fits, refused]).splitlines()
    assert len(table) == 4 and "| yes |" in table[2] and "49.000 (compiler)" in table[3]


def test_kernels_are_chosen_for_the_mesh_not_the_host():
    # A TPU mesh in context on this CPU host (an abstract one: no libtpu needed): the automatic
    # choice is splash, an explicit 'splash' is accepted, 'cudnn' is refused naming the TPU.
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    from goat_jax import kernels

    tpu = AbstractMesh((4,), ("data",), axis_types=(AxisType.Auto,),
                       abstract_device=AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu"))
    shape = (8, 4, 256, 256)
    host = jax.default_backend()
    with jax.sharding.use_abstract_mesh(tpu):
        assert kernels.target_platform() == ("tpu", "the mesh in context (TPU v5 lite)")
        with kernels.record_choices() as choices:
            assert kernels.resolve_implementation(None, jnp.bfloat16, 66, shape) == "splash"
            assert kernels.resolve_implementation("splash", jnp.bfloat16, 66, shape) == "splash"
        assert [c["implementation"] for c in choices] == ["splash", "splash"] and choices[0]["qk_dim"] == 66
        # Lengths splash cannot block: the automatic choice says why and takes another kernel.
        assert kernels.resolve_implementation(None, jnp.bfloat16, 66, (8, 4, 64, 64)) == "xla"
        with pytest.raises(ValueError, match=r"needs a GPU, but the computation runs on 'tpu' \(the mesh in context"):
            kernels.resolve_implementation("cudnn", jnp.bfloat16, 66, shape)
    if host == "cpu":  # no mesh: the host's backend, and the refusal says how to target a TPU
        assert kernels.target_platform() == ("cpu", "JAX's default backend, as no mesh was set where this attention call was traced")
        assert kernels.resolve_implementation(None, jnp.bfloat16, 66, shape) in ("xla", "flash")
        with pytest.raises(ValueError, match="splash_interpret.*jax.set_mesh"):
            kernels.resolve_implementation("splash", jnp.bfloat16, 66, shape)


def test_the_batch_search_brackets_then_bisects_to_the_largest_fitting_batch():
    """aot.largest_batch on a stand-in compiler (a step fits while per-device batch x cost <=
    100; remat halves the cost): the exact answer from any start, the budget's bracket when it
    runs out, 'none' when not even one example fits, and the remat setting in every config tried."""
    import ml_collections

    config = ml_collections.ConfigDict({"global_batch_size": 512, "per_device_batch_size": None,
                                        "grad_accum_steps": 8, "model": {"remat": True}})
    seen = []

    def fake(c, target, **_):
        assert c.global_batch_size is None and c.grad_accum_steps == 1
        seen.append((c.per_device_batch_size, c.model.remat))
        fits = c.per_device_batch_size * (6 if c.model.remat else 12) <= 100  # 16 with remat, 8 without
        return {"fits": fits, "per_device_bytes": {"total": c.per_device_batch_size << 30} if fits else None,
                "compiler_used_bytes": None if fits else c.per_device_batch_size << 30, "compile_seconds": 1.0}

    target = aot.parse_target("v5e-4")
    for start in (1, 5, 16, 64):
        out = aot.largest_batch(config, target, start=start, max_compiles=12, compile_fn=fake)["per_remat"]
        assert [(r["remat"], r["largest"], r["first_failing"], r["exact"]) for r in out] == [
            (False, 8, 9, True), (True, 16, 17, True)], (start, out)
        assert all(t["fits"] == (t["per_device"] <= (16 if r["remat"] else 8)) for r in out for t in r["tried"])
        assert out[0]["report"]["fits"] and out[0]["report"]["per_device_bytes"]["total"] == 8 << 30
    assert {r for _, r in seen} == {False, True} and config.global_batch_size == 512  # the caller's config untouched
    short = aot.largest_batch(config, target, remat_options=(True,), start=1, max_compiles=3, compile_fn=fake)
    r = short["per_remat"][0]
    assert (r["largest"], r["first_failing"], r["exact"], len(r["tried"])) == (4, None, False, 3)
    assert "bracket only" in aot.search_markdown(short)
    never = aot.largest_batch(config, target, remat_options=(False,), start=4, max_compiles=8,
                              compile_fn=lambda c, t, **_: {"fits": False, "per_device_bytes": None,
                                                            "compiler_used_bytes": 1, "compile_seconds": 0.1})
    r = never["per_remat"][0]
    assert (r["largest"], r["first_failing"], r["exact"], [t["per_device"] for t in r["tried"]]) == (None, 1, True, [4, 2, 1])
    with pytest.raises(ValueError, match="start=0"):
        aot.largest_batch(config, target, start=0, compile_fn=fake)


@needs_libtpu
@pytest.mark.slow(reason="4 real TPU compiles of the smoke LM at 4k-16k sequences per chip (1-3 min); the "
                         "search's logic is tested in the default suite on a stand-in compiler, the TPU "
                         "compile itself by test_smoke_lm_train_step_compiles_for_v5e_4_through_experiments_compile")
def test_the_batch_search_runs_through_experiments_compile_on_a_tpu_slice(tmp_path):
    """--search_batch with the real TPU compiler: the smoke LM on v5e-4, starting at 4096
    sequences of 128 tokens per chip (fits), doubling to the compiler's HBM refusal, then
    bisecting within a budget of 4 compiles: a consistent bracket, and the largest fitting
    batch's own compile report beside the search."""
    proc = _run(["-m", "experiments.compile", "--config", "configs/lm_tiny.py:goat,smoke", "--config.seq_len=128",
                 "--target", "v5e-4", "--out", str(tmp_path), "--search_batch", "--search_remat=off",
                 "--search_start=4096", "--max_compiles=4"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    search = json.loads((tmp_path / "search.json").read_text())
    (r,) = search["per_remat"]
    assert r["remat"] is False and r["tried"][0] == {**r["tried"][0], "per_device": 4096, "fits": True}
    assert r["largest"] is not None and r["first_failing"] is not None and r["largest"] < r["first_failing"]
    assert all(t["fits"] == (t["per_device"] <= r["largest"]) for t in r["tried"]) and len(r["tried"]) <= 4
    report = json.loads((tmp_path / "compile.json").read_text())
    assert report["global_batch_size"] == 4 * r["largest"] and report["fits"] is True
    assert f"--config.per_device_batch_size={r['largest']}" in report["config"]
    assert "Largest per-device batch that fits: v5e-4" in (tmp_path / "search.md").read_text()


_QUIET = '''
import json, os
from goat_jax import aot
before = dict(os.environ)
devices = aot.target_devices(aot.parse_target("v5e-4"))
after = {k: os.environ.get(k) for k in ("TPU_WORKER_HOSTNAMES", "TPU_HOST_BOUNDS", "TPU_LOG_DIR")}
print("RESULT " + json.dumps({"n": len(devices), "pid": os.getpid(), "env_restored": after == {k: before.get(k) for k in after}}))
'''


@needs_libtpu
def test_building_tpu_devices_prints_no_libtpu_error_and_writes_no_tpu_logs():
    """On a host without TPU chips libtpu printed 'Failed to find host bounds' and 'E0000 ...
    TPU_WORKER_HOSTNAMES' lines and wrote /tmp/tpu_logs/ on every compile (JAX_PLATFORMS=cpu
    does not reach it); the environment the tool sets while it loads is gone afterwards."""
    import os

    from goat_jax import platforms
    if platforms.tpu_may_be_present():
        pytest.skip("this host may have TPU chips: its own TPU environment applies")
    proc = _run(["-c", _QUIET], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ")[-1])
    assert out["n"] == 4 and out["env_restored"], out
    for words in ("host bounds", "TPU_WORKER_HOSTNAMES", "E0000", "Source Location Trace"):
        assert words not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    logs = "/tmp/tpu_logs"  # libtpu's own default, not under TMPDIR; its files end in the pid
    mine = [n for n in (os.listdir(logs) if os.path.isdir(logs) else []) if n.endswith(f".{out['pid']}")]
    assert not mine, mine


@needs_libtpu
def test_a_ring_run_is_reported_with_its_strategy_and_the_kernel_of_its_blocks(tmp_path):
    """compile.json said only attention_implementation 'xla' for a ring run, whose blocks run
    flash's block math; it now names the strategy, the balancing and the blocks' kernel."""
    proc = _run(["-m", "experiments.compile", "--config", "configs/lm_tiny.py:goat,smoke", "--config.seq_len=128",
                 "--config.global_batch_size=2", "--config.mesh.data=1", "--config.mesh.context=4",
                 "--config.context_strategy=ring", "--target", "v5e-4", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "compile.json").read_text())
    assert (report["context_strategy"], report["load_balanced"], report["ring_blocks"]) == ("ring", False, "flash")
    assert "context strategy ring, blocks by flash's block math" in proc.stdout
    assert "| context parallelism | strategy ring, load-balanced False, each block computed by flash's block math |" \
        in (tmp_path / "compile.md").read_text()
