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
    res = subprocess.run([sys.executable, "-m", "experiments.device_check", "--dry_run", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = out.read_text()
    for heading in ("## 1. Kernels vs the float64 reference", "## 2. Attention forward+backward",
                    "## 2b. Packed documents", "## 2c. Packed documents", "## ring. Ring attention per step",
                    "## 3. LM train step",
                    "## 4. GPU-only pytest tests", "## Environment"):
        assert heading in text
    assert "cuDNN rows skipped: no GPU" in text
    assert "**FAIL**" not in text and "**ERROR**" not in text
    # flash f32/bf16 and xla bf16, causal and padded; packed documents on flash: GOAT and RoPE, MHA and GQA;
    # the ring step on cuDNN blocks (the stand-in) and flash blocks
    assert text.count("| ok |") == 6 + 4 + 2
    assert "| ring:cudnn (pure-JAX stand-in) | 128 |" in text and "| 256 | ring:flash |" in text
    for row in ("| 64 | goat_dense_bias:xla |", "| 64 | goat:flash |", "| 64 | goat:xla |", "| tiny (dry run) |"):
        assert row in text
    assert "| est. ms/step at peak |" in text and "| planned GiB |" in text  # the compile-time view beside it
    assert "test_error_cudnn_float32_or_no_gpu`: exit code 0" in text
    assert "Imported of ('tensorflow', 'grain', 'ml_collections'): none" in text
