"""``experiments.compile --step decode`` (goat_jax/aot/decode.py): one KV-cache decode step of a
config's global batch against a cache of its full window, sharded as the config's mesh says.

On 8 fake CPU devices: the cache's bytes in all and per chip equal a count written out from the
config (rows over data x fsdp, slots over context, KV heads over tensor where they divide, per
layer, scanned or not), the compiled step reuses the donated cache, a mesh with context > 1 keeps
each chip's share of the cache (no gathered copy in its temporaries), and a step that cannot decode
(a ViT) is refused in one line before any compile. With libtpu: the real TPU compiler
through the command, compile.json recording ``step: "decode"``."""

import functools
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
    out[name] = {k: r[k] for k in ("step", "mesh", "cache_length", "global_batch_size", "kv_cache_bytes_total",
                                   "kv_cache_bytes_per_chip", "per_device_bytes", "fits", "packed_head_dim")}
print("RESULT " + json.dumps(out))
"""

# name: (overrides, (rows split, KV heads split, slots split)); the smoke LM: 1 layer, 2 KV heads,
# head dim 16.
CASES = {
    "data2_fsdp2_tensor2": ({"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}, (4, 2, 1)),
    "data8_two_layers_scanned": ({"mesh.data": 8, "model.num_layers": 2, "model.scan_layers": True}, (8, 1, 1)),
    "mqa_tensor2_batch16": ({"mesh.data": 4, "mesh.tensor": 2, "model.kv_num_heads": 1,
                             "global_batch_size": 16, "seq_len": 128}, (4, 1, 1)),
    # The cache's slots over context, the one-token step's activations whole (aot.decode.step_rules).
    "context4_mqa_tensor2": ({"mesh.data": 1, "mesh.context": 4, "mesh.tensor": 2, "model.kv_num_heads": 1},
                             (1, 1, 4)),
    "context4_data2_scanned": ({"mesh.data": 2, "mesh.context": 4, "model.num_layers": 2,
                                "model.scan_layers": True}, (2, 1, 4)),
}


@functools.lru_cache(maxsize=1)
def _reports() -> dict:
    cases = {name: overrides for name, (overrides, _) in CASES.items()}
    return json.loads(run_on_fake_devices(_SCRIPT, json.dumps(cases)).split("RESULT ")[-1])


def _total(overrides: dict) -> int:
    """The keys' and values' bytes of the smoke LM's cache, written out: packed key width = value
    width = 16 here, float32."""
    layers = overrides.get("model.num_layers", 1)
    b, s = overrides.get("global_batch_size", 8), overrides.get("seq_len", 64)
    kh, d = overrides.get("model.kv_num_heads", 2), 16
    return layers * 2 * b * s * kh * d * 4


def test_the_cache_bytes_per_chip_follow_the_mesh_and_the_step_reuses_the_donated_cache():
    out = _reports()
    for name, (overrides, (rows, heads, slots)) in CASES.items():
        r = out[name]
        assert "error" not in r, (name, r)
        b, s = overrides.get("global_batch_size", 8), overrides.get("seq_len", 64)
        total = _total(overrides)
        assert (r["step"], r["cache_length"], r["global_batch_size"], r["packed_head_dim"]) == ("decode", s, b, 16), r
        assert r["kv_cache_bytes_total"] == total and r["kv_cache_bytes_per_chip"] == total // (rows * heads * slots), r
        mem = r["per_device_bytes"]
        assert mem["aliased"] >= r["kv_cache_bytes_per_chip"] and mem["arguments"] >= r["kv_cache_bytes_per_chip"], r
        assert r["fits"] is True


def test_a_decode_step_at_context_4_holds_a_quarter_of_the_cache_per_chip():
    # 8 devices: context 4 x tensor 2, one KV head (not split over tensor), one row: each chip
    # holds 16 of the 64 slots. The compiled step keeps it so: the donated cache is reused and
    # its temporaries hold less than the whole cache (no shard gathers the others' slots).
    r = _reports()["context4_mqa_tensor2"]
    assert r["mesh"] == {"data": 1, "fsdp": 1, "context": 4, "tensor": 2}, r
    total = _total(CASES["context4_mqa_tensor2"][0])
    assert r["kv_cache_bytes_total"] == total and r["kv_cache_bytes_per_chip"] * 4 == total, r
    mem = r["per_device_bytes"]
    assert mem["aliased"] >= total // 4 and mem["temporaries"] < total, r


def test_step_rules_take_context_out_of_every_mapping_and_keep_the_rest():
    from goat_jax.aot.decode import step_rules
    from goat_jax.train import sharding

    rules = sharding.rules_from_config([("batch", ["data", "fsdp"]), ("length", "context"), ("embed", "fsdp"),
                                        ("heads", ["context", "tensor"]), ("mlp", None), ("x", ["context"])])
    assert step_rules(rules) == (("batch", ("data", "fsdp")), ("length", None), ("embed", "fsdp"),
                                 ("heads", "tensor"), ("mlp", None), ("x", None))
    assert step_rules(sharding.DEFAULT_RULES) == tuple((n, None if t == "context" else t)
                                                       for n, t in sharding.DEFAULT_RULES)


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


@needs_libtpu
def test_a_decode_step_at_context_4_compiles_for_v5e_4_through_experiments_compile(tmp_path):
    proc = run_compile_only(["-m", "experiments.compile", "--config", "configs/lm_tiny.py:goat,smoke",
                             "--target", "v5e-4", "--step", "decode", "--config.mesh.context=4",
                             "--config.mesh.data=1", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "compile.json").read_text())
    total = 2 * 8 * 64 * 2 * 16 * 4  # as above; the 64 slots over 4 chips
    assert report["mesh"] == {"data": 1, "fsdp": 1, "context": 4, "tensor": 1}
    assert report["kv_cache_bytes_total"] == total and report["kv_cache_bytes_per_chip"] == total // 4
    assert report["attention_implementation"] == "decode_merge" and report["fits"] is True
