"""``experiments.compile --step decode`` (goat_jax/aot/decode.py): one KV-cache decode step of a
config's global batch against a cache of its full window, sharded as the config's mesh says.

On 8 fake CPU devices: the cache's bytes in all and per chip equal a count written out from the
config (rows over data x fsdp, KV heads over tensor where they divide, per layer, scanned or not),
the compiled step reuses the donated cache, and a step that cannot decode (a ViT, a mesh with
context > 1) is refused in one line before any compile. With libtpu: the real TPU compiler
through the command, compile.json recording ``step: "decode"``."""

import json

import pytest

from goat_jax import aot
from tests.config_helpers import run_compile_only, run_on_fake_devices

needs_libtpu = pytest.mark.skipif(
    not aot.libtpu_installed(),
    reason="libtpu (the TPU compiler) is not installed: pip install 'goat-jax[aot]'")

_SCRIPT = r"""
import json, sys
import jax
from goat_jax import aot
from goat_jax.config import files as config_files

out = {}
for name, overrides in json.loads(sys.argv[1]).items():
    config = config_files.load_config("configs/lm_tiny.py:goat,smoke", overrides)
    try:
        r = aot.compile_decode_step(config, aot.parse_target("v5e-8"), devices=jax.devices())
    except ValueError as e:
        out[name] = {"error": str(e)}
        continue
    out[name] = {k: r[k] for k in ("step", "cache_length", "global_batch_size", "kv_cache_bytes_total",
                                   "kv_cache_bytes_per_chip", "per_device_bytes", "fits", "packed_head_dim")}
print("RESULT " + json.dumps(out))
"""

# name: (overrides, (rows split, KV heads split)); the smoke LM: 1 layer, 2 KV heads, head dim 16.
CASES = {
    "data2_fsdp2_tensor2": ({"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}, (4, 2)),
    "data8_two_layers_scanned": ({"mesh.data": 8, "model.num_layers": 2, "model.scan_layers": True}, (8, 1)),
    "mqa_tensor2_batch16": ({"mesh.data": 4, "mesh.tensor": 2, "model.kv_num_heads": 1,
                             "global_batch_size": 16, "seq_len": 128}, (4, 1)),
    "context2": ({"mesh.data": 4, "mesh.context": 2}, None),
}


def test_the_cache_bytes_per_chip_follow_the_mesh_and_the_step_reuses_the_donated_cache():
    cases = {name: overrides for name, (overrides, _) in CASES.items()}
    out = json.loads(run_on_fake_devices(_SCRIPT, json.dumps(cases)).split("RESULT ")[-1])
    for name, (overrides, split) in CASES.items():
        r = out[name]
        if split is None:
            assert r["error"].startswith("--step decode with mesh.context=2: this compile path does not yet lay "
                                         "a one-token decode step out over context"), r
            continue
        layers = overrides.get("model.num_layers", 1)
        b, s = overrides.get("global_batch_size", 8), overrides.get("seq_len", 64)
        kh, d = overrides.get("model.kv_num_heads", 2), 16  # packed key width = value width = 16 here
        total = layers * 2 * b * s * kh * d * 4  # keys and values, float32
        rows, heads = split
        assert (r["step"], r["cache_length"], r["global_batch_size"], r["packed_head_dim"]) == ("decode", s, b, d), r
        assert r["kv_cache_bytes_total"] == total and r["kv_cache_bytes_per_chip"] == total // (rows * heads), r
        mem = r["per_device_bytes"]
        assert mem["aliased"] >= r["kv_cache_bytes_per_chip"] and mem["arguments"] >= r["kv_cache_bytes_per_chip"], r
        assert r["fits"] is True


def test_a_vit_config_and_search_batch_are_refused_in_one_line_before_any_compile(tmp_path):
    for args, words in (
            (["--config", "configs/vit_tiny.py:ape,smoke", "--target", "v5e-4"],
             "--step decode compiles the language model's KV-cache step; config.task='vit'"),
            (["--config", "configs/lm_tiny.py:goat,smoke", "--target", "v5e-4", "--search_batch"],
             "--search_batch searches the train step's batch; drop it with --step decode")):
        proc = run_compile_only(["-m", "experiments.compile", *args, "--step", "decode", "--out", str(tmp_path / "o")])
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 1 and len(errors) == 1 and words in errors[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and not (tmp_path / "o" / "compile.json").exists()


@needs_libtpu
def test_a_decode_step_compiles_for_v5e_4_through_experiments_compile(tmp_path):
    proc = run_compile_only(["-m", "experiments.compile", "--config", "configs/lm_tiny.py:goat,smoke",
                             "--target", "v5e-4", "--step", "decode", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "compile.json").read_text())
    total = 2 * 8 * 64 * 2 * 16 * 4  # keys and values of 1 layer: batch 8, 64 slots, 2 KV heads, width 16
    assert (report["step"], report["target"], report["mesh"]) == ("decode", "v5e-4",
                                                                  {"data": 4, "fsdp": 1, "context": 1, "tensor": 1})
    assert report["kv_cache_bytes_total"] == total and report["kv_cache_bytes_per_chip"] == total // 4
    assert report["fits"] is True and report["per_device_bytes"]["aliased"] >= total // 4
    assert "KV cache" in (tmp_path / "compile.md").read_text() and "decode step" in proc.stdout
