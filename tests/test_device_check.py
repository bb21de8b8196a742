"""The prepared GPU check runs end to end in its CPU dry mode, without the modules the GPU image
lacks (tensorflow, grain, ml_collections are made unimportable by --dry_run)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow(reason="runs every section of the device check on CPU")
def test_device_check_dry_run_writes_every_section(tmp_path):
    out = tmp_path / "gpu.md"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-m", "experiments.device_check", "--dry_run", "--out", str(out),
                          "--sections", "1", "2", "2b", "ring", "ulysses", "3", "4"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = out.read_text()
    for heading in ("## 1. Kernels vs the float64 reference", "## 2. Attention forward+backward",
                    "## 2b. Packed documents", "## 2c. Packed documents", "## ring. Ring attention per step",
                    "## ulysses. One device's attention per layer, Ulysses vs ring",
                    "## 3. LM train step",
                    "## 4. GPU-only pytest tests", "## Environment"):
        assert heading in text
    assert "cuDNN rows skipped: no GPU" in text
    assert "**FAIL**" not in text and "**ERROR**" not in text
    # flash f32/bf16 and xla bf16, causal and padded; packed documents on flash: GOAT and RoPE, MHA and GQA;
    # the ring step on cuDNN blocks (the stand-in) and flash blocks
    assert text.count("| ok |") == 6 + 4 + 2
    assert "| ring:cudnn (pure-JAX stand-in) | 128 |" in text and "| 256 | ring:flash |" in text
    # Ulysses' whole-sequence call (flash standing in for cuDNN's packed layout) beside the ring's blocks
    for row in ("| 128 | ulysses:cudnn packed | T=128, 4 heads, 1 KV head |", "| 256 | ring:flash blocks | pair of 32",
                "| 256 | ring:cudnn blocks (no documents) |"):
        assert row in text
    for row in ("| 64 | goat_dense_bias:xla |", "| 64 | goat:flash |", "| 64 | goat:xla |", "| tiny (dry run) |"):
        assert row in text
    assert "| est. ms/step at peak |" in text and "| planned GiB |" in text  # the compile-time view beside it
    assert "test_error_cudnn_float32_or_no_gpu`: exit code 0" in text
    assert "Imported of ('tensorflow', 'grain', 'ml_collections'): none" in text


@pytest.mark.slow(reason="runs the width sweep and the train-step levers of the device check on CPU (~14 step compiles)")
def test_device_check_dry_run_width_sweep_and_levers(tmp_path):
    """Sections 5, 6 and 6b (issue #55) in their CPU form: every row runs (a large budget, so
    none is skipped), none errs, and the tables carry what the GPU run will fill in."""
    out = tmp_path / "gpu.md"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-m", "experiments.device_check", "--dry_run", "--out", str(out),
                          "--sections", "5", "6", "6b", "--budget_s", "5000"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = out.read_text()
    assert "**ERROR**" not in text and "skipped: time budget" not in text
    for heading in ("## 5. q/k width sweep", "## 6. 125M train step levers (a)", "## 6b. 125M train step levers (b)"):
        assert heading in text
    for row in ("| 1 x 2 x 64 | plain | 64 / 64 |", "| 1 x 2 x 64 | goat official | 64 / 64 (packed) |",
                "| 1 x 2 x 64 | q/k 65, v 64 | 65 / 64 |", "| 1 x 2 x 64 | q/k 128, v 128 | 128 / 128 |"):
        assert row in text
    assert text.count("| 1 x 2 x 64 |") == 4 + 6 + 2  # plain, 2 GOAT layouts, RoPE; 6 widths; 2 with wide v
    assert "ratios to plain: goat official" in text  # the cliff summary
    for change in ("| base | goat |", "| base | rope |", "| tokens per step x4 | goat | 8 x 32 |",
                   "| chunked loss (8 positions) | goat |", "| XLA GPU options (gpu_xla_flags) | goat |",
                   "| unrolled layers (scan_layers=False) |", "| remat, policy dots_no_batch |",
                   "| vocabulary 257 padded to a multiple of 128 |", "| qk_layout='lane_aligned' |"):
        assert change in text
    assert text.count("| candidate: ") == 2
    assert "Imported of ('tensorflow', 'grain', 'ml_collections'): none" in text


def test_each_lever_changes_one_thing_from_the_base():
    """Sections 6 / 6b at their GPU sizes (nothing compiled): every row but the base and the
    candidate differs from the base in exactly one setting; base and candidate run for GOAT and RoPE."""
    import dataclasses  # pylint: disable=g-import-not-at-top

    from goat_jax.device_check import levers  # pylint: disable=g-import-not-at-top
    from goat_jax.device_check.train_step import base_config  # pylint: disable=g-import-not-at-top

    base, batch, seq = base_config(False)
    assert (base.num_layers, base.embed_dim, base.vocab_size, batch, seq) == (12, 768, 32_000, 8, 2048)
    rows = levers.variants("6", False) + levers.variants("6b", False)
    assert [(v.name, v.encoding) for _, v in rows[:4]] == [("base", "goat"), ("base", "rope"),
                                                            ("candidate", "goat"), ("candidate", "rope")]
    for change, var in rows:
        if var.name in ("base", "candidate"):
            continue
        ref = dataclasses.replace(base, position_encoding=var.encoding)
        diffs = [f.name for f in dataclasses.fields(ref) if getattr(ref, f.name) != getattr(var.cfg, f.name)]
        diffs += ["batch"] * (var.batch != batch) + ["gpu_xla_flags"] * var.gpu_xla_flags
        if var.name == "vocab_pad":  # one change from the unpadded 50,257 row before it
            diffs.remove("vocab_size")
        if set(diffs) == {"remat", "remat_policy"}:  # remat on, with its policy: one lever
            diffs = ["remat"]
        assert len(diffs) == 1, (change, diffs)


def test_width_cliff_summary_reads_the_table():
    from goat_jax.device_check import widths  # pylint: disable=g-import-not-at-top

    times = {"plain": 1.0, "goat official": 1.4, "goat lane_aligned": 1.02, "rope": 1.05,
             "q/k 65, v 64": 1.3, "q/k 66, v 64": 1.3, "q/k 72, v 64": 1.3, "q/k 80, v 64": 1.35,
             "q/k 96, v 64": 1.4, "q/k 128, v 64": 1.5}
    rows = [["8 x 12 x 2048", name, "-", ms, None, ms, ""] for name, ms in times.items()]
    rows.append(["1 x 8 x 4096", "plain", "-", None, None, None, "skipped: time budget"])
    (line,) = widths.cliff(rows)
    assert "widths within 1.10x of 64: [64]; slower: [65, 66, 72, 80, 96, 128] (the cliff: above 64)" in line
    assert "goat official 1.40x, goat lane_aligned 1.02x, rope 1.05x" in line


def test_section_keys_match_the_registered_sections():
    """``--sections`` offers exactly the registered sections' keys, in their order."""
    from experiments import device_check  # pylint: disable=g-import-not-at-top

    assert tuple(s.key for s in device_check.sections()) == device_check.SECTIONS
