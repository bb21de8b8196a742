"""The one chip table (goat_jax/targets/chips.py): each chip's peak FLOP/s is stated in one
file of the repository's code, the ahead-of-time compiles, the trainer's MFU and the one-GPU
check all read it, and it loads on the GPU image (standard library only)."""

import ast
import io
import os
import tokenize

import pytest

from goat_jax import aot
from goat_jax.targets import chips
from goat_jax.train import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join("goat_jax", "targets", "chips.py")
# tests/ restates datasheet values on purpose (to check the table against them); virtual
# environments, run directories and caches are not the repository's code.
SKIP_DIRS = {"tests", "runs", "build", "__pycache__"}


def _python_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in filenames:
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def _numbers(path):
    """The float literals of a Python file (and integers of 1e12 or more), as floats."""
    with open(path, "rb") as f:
        tokens = list(tokenize.tokenize(io.BytesIO(f.read()).readline))
    for tok in tokens:
        if tok.type != tokenize.NUMBER or tok.string[-1:] in "jJ" or tok.string[:2].lower() in ("0x", "0o", "0b"):
            continue
        value = float(tok.string.replace("_", ""))
        if any(c in tok.string for c in ".eE") or value >= 1e12:
            yield value


def test_each_chips_peak_flops_is_stated_in_one_file():
    """A chip's peak (as FLOP/s or TFLOP/s, per chip or per device) as a number in the code:
    only in the table. A second table elsewhere (the trainer's MFU, the device check) fails."""
    found = {family: set() for family in chips.CHIPS}
    for path in _python_files():
        values = set(_numbers(path))
        for family, chip in chips.CHIPS.items():
            peaks = {chip.peak_bf16_flops, chip.peak_bf16_flops_per_device}
            if values & (peaks | {p / 1e12 for p in peaks}):
                found[family].add(os.path.relpath(path, ROOT))
    assert found["h200"] and found["v5e"]  # the walk reads the table
    assert {family: files for family, files in found.items() if files != {TABLE}} == {}


def test_the_table_is_what_the_compiles_and_the_mfu_read():
    for family, chip in aot.CHIPS.items():
        assert chip is chips.CHIPS[family]
    assert set(aot.CHIPS) == {"v4", "v5e", "v5p", "v6e", "h100", "h200"}  # the compile targets
    for chip in chips.CHIPS.values():
        assert metrics.peak_flops_per_device(chip.device_kind) == chip.peak_bf16_flops_per_device
    assert metrics.peak_flops_per_device("cpu") is None
    assert metrics.peak_flops_per_device("cpu", override=5e12) == 5e12
    with open(os.path.join(ROOT, "goat_jax", "device_check", "train_step.py")) as f:  # the GPU check's MFU
        assert "chips.peak_flops_per_device(device.device_kind)" in f.read()


@pytest.mark.parametrize("kind, peak", [
    # The answers of the trainer's former table (first matching substring wins).
    ("TPU v6 lite", 918e12), ("TPU v6e", 918e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12),
    ("TPU v5", 459e12), ("TPU v5p", 459e12), ("TPU v4", 275e12),
    ("TPU v3", 61.5e12),  # per TensorCore: one JAX device per core (123 TFLOP/s per chip)
    ("NVIDIA B200", 2250e12), ("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L4", 121e12), ("cpu", None), ("", None),
])
def test_device_kinds_find_their_chip(kind, peak):
    assert chips.peak_flops_per_device(kind) == peak


def test_the_table_loads_on_the_gpu_image():
    """The device check's image has no tensorflow, grain or ml_collections: the table and its
    package import the standard library only."""
    allowed = {"__future__", "dataclasses", "typing", "os"}
    for path in (TABLE, os.path.join("goat_jax", "targets", "__init__.py")):
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert names <= allowed, (path, names - allowed)
