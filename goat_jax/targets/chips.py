"""The one table of accelerator chips: peak dense bf16 FLOP/s, HBM and its bandwidth, per chip.

Every number the repository uses about a chip is stated here once and read by the code that
needs it: the ahead-of-time compiles (:mod:`goat_jax.aot`: will a step fit one chip's HBM, how
fast could it be at peak), the trainer's MFU (:func:`goat_jax.train.metrics.peak_flops_per_device`)
and the prepared one-GPU check (``experiments/device_check.py``). A device is matched to its row
by :func:`chip_for`, from the ``device_kind`` string JAX reports.

This module imports nothing beyond the standard library: the GPU image the device check runs on
has no tensorflow, grain or ml_collections, and the table must load there.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation or GPU model: per-chip peak dense bf16 FLOP/s, HBM and its bandwidth,
    and what the number in its target name counts. GPUs also name their target description
    (a file in goat_jax/targets/) and compute capability.

    ``matches`` are the substrings of JAX's ``device_kind`` (case-insensitive) that identify the
    chip (:func:`chip_for`; the table is searched in order, so a more specific row comes first).
    ``devices_per_chip`` is how many JAX devices one chip is (2 on v3: one per TensorCore; 1 on
    v4/v5p, run as megacore, and on every other chip). ``hbm_bytes`` and ``hbm_bytes_per_s`` are
    None on the rows that only the MFU reads (no compile target uses them)."""

    family: str
    device_kind: str  # as JAX reports it
    peak_bf16_flops: float  # per chip, dense (no sparsity)
    hbm_bytes: Optional[int]  # per chip
    hbm_bytes_per_s: Optional[float]  # per chip
    name_counts: str  # what N counts in a target name: 'chips' | 'TensorCores' | 'GPUs'
    topology_dims: int  # 2 (v3, v5e, v6e: 2D torus) or 3 (v4, v5p); 0 for GPUs
    source: str
    platform: str = "tpu"  # 'tpu' | 'cuda'
    target_config: Optional[str] = None  # GPUs: the GpuTargetConfig text file in goat_jax/targets/
    compute_capability: Optional[Tuple[int, int]] = None  # GPUs
    matches: Tuple[str, ...] = ()
    devices_per_chip: int = 1

    @property
    def peak_bf16_flops_per_device(self) -> float:
        """Peak dense bf16 FLOP/s of one JAX device (the chip's over :attr:`devices_per_chip`)."""
        return self.peak_bf16_flops / self.devices_per_chip


# Google Cloud's system-architecture pages for TPUs, NVIDIA's datasheets for GPUs (numbers per
# chip; checked 2026-12). HBM as GiB, as Cloud states it; GPUs' "GB" are read as GiB the same way.
# GPU peaks are the BF16 Tensor Core figures without sparsity, i.e. half the datasheets' "with
# sparsity" figure (H100/H200 SXM: 1,979 TFLOP/s with sparsity, 989 dense).
CHIPS = {
    "v4": Chip("v4", "TPU v4", 275e12, 32 << 30, 1200e9, "TensorCores", 3,
               "https://cloud.google.com/tpu/docs/v4", matches=("v4",)),
    "v5e": Chip("v5e", "TPU v5 lite", 197e12, 16 << 30, 819e9, "chips", 2,
                "https://cloud.google.com/tpu/docs/v5e", matches=("v5 lite", "v5e")),
    # "TPU v5" (v5p's device kind) after "TPU v5 lite": the first matching row wins.
    "v5p": Chip("v5p", "TPU v5", 459e12, 95 << 30, 2765e9, "TensorCores", 3,
                "https://cloud.google.com/tpu/docs/v5p", matches=("v5p", "v5")),
    "v6e": Chip("v6e", "TPU v6 lite", 918e12, 32 << 30, 1640e9, "chips", 2,
                "https://cloud.google.com/tpu/docs/v6e", matches=("v6 lite", "v6e")),
    "h100": Chip("h100", "NVIDIA H100 80GB HBM3", 989e12, 80 << 30, 3.35e12, "GPUs", 0,
                 "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 989 TFLOP/s dense BF16, 80 GB HBM3, "
                 "3.35 TB/s", platform="cuda", target_config="h100_sxm.txtpb", compute_capability=(9, 0),
                 matches=("H100",)),
    "h200": Chip("h200", "NVIDIA H200", 989e12, 141 << 30, 4.8e12, "GPUs", 0,
                 "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 989 TFLOP/s dense BF16, 141 GB HBM3e, "
                 "4.8 TB/s", platform="cuda", target_config="h200_sxm.txtpb", compute_capability=(9, 0),
                 matches=("H200",)),
    # Read by the MFU only (no compile target): one JAX device per v3 TensorCore.
    "v3": Chip("v3", "TPU v3", 123e12, 32 << 30, 900e9, "TensorCores", 2,
               "https://cloud.google.com/tpu/docs/v3", matches=("v3",), devices_per_chip=2),
    "b200": Chip("b200", "NVIDIA B200", 2250e12, None, None, "GPUs", 0,
                 "NVIDIA datasheet: 2,250 TFLOP/s dense BF16", platform="cuda", compute_capability=(10, 0),
                 matches=("B200",)),
    "a100": Chip("a100", "NVIDIA A100", 312e12, None, None, "GPUs", 0,
                 "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16", platform="cuda", compute_capability=(8, 0),
                 matches=("A100",)),
    "l4": Chip("l4", "NVIDIA L4", 121e12, None, None, "GPUs", 0,
               "NVIDIA L4 datasheet: 121 TFLOP/s dense BF16", platform="cuda", compute_capability=(8, 9),
               matches=("L4",)),
}


def chip_for(device_kind: str) -> Optional[Chip]:
    """The row of :data:`CHIPS` whose ``matches`` first occur in ``device_kind``
    (case-insensitive, rows in table order), or None for an unknown device (e.g. a CPU)."""
    kind = (device_kind or "").lower()
    for chip in CHIPS.values():
        if any(m.lower() in kind for m in chip.matches):
            return chip
    return None


def peak_flops_per_device(device_kind: str) -> Optional[float]:
    """Peak dense bf16 FLOP/s of one JAX device of kind ``device_kind``, or None when the table
    does not know it."""
    chip = chip_for(device_kind)
    return None if chip is None else chip.peak_bf16_flops_per_device
