"""Whether this host may have a TPU or a GPU, read from the operating system without starting
any JAX backend, and the one decision the command-line entry points (``experiments/``) take from
it: :func:`avoid_libtpu_without_tpu`.

Why: with libtpu installed (the ``aot`` extra that ``scripts/setup.sh`` installs for the compile
tool, or ``jax[tpu]``) and ``JAX_PLATFORMS`` unset, JAX's backend discovery tries every
registered platform, the TPU's included. On a host without TPU chips libtpu then prints
error-level lines before JAX falls back to the CPU (``Failed to find host bounds for accelerator
type``, ``E0000 ... INVALID_ARGUMENT: Error: unexpected worker hostname ... TPU_WORKER_HOSTNAMES``
and a source-location trace): harmless, but the first thing a newcomer reads is an error. Where
neither a TPU nor a GPU can be present, the CPU is the only backend JAX could end up with, so the
entry points ask for it (``JAX_PLATFORMS=cpu``) and libtpu is never initialised.

Nothing changes where a TPU or a GPU may be present, where the user set ``JAX_PLATFORMS`` (even
to ``''``, JAX's "choose for me"), or where libtpu is not installed. Compile-only TPU devices
(``experiments.compile``, docs/aot.md) load libtpu through ``jax.experimental.topologies``, not
through the TPU backend, so they work under ``JAX_PLATFORMS=cpu`` (the compile tool sets it
itself). The detection errs towards "may be present": a Google PCI device (vendor 0x1ae0, as
JAX's own TPU detection reads), ``/dev/accel*`` or ``/dev/vfio/<n>`` (TPU VMs), a TPU
environment variable (GKE and Cloud TPU VMs set them), an unreadable PCI device list, or an
NVIDIA / AMD device node each keep JAX's own discovery.

Imports nothing from JAX: it must be usable before ``jax`` is imported (the environment variable
then reaches JAX's configuration and every child process), and also after (it then updates
``jax.config`` too, which works until the first backend is started).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from typing import MutableMapping, Optional

_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips' PCI vendor (jax._src.hardware_utils reads the same)
# Set on Cloud TPU VMs and GKE TPU nodes (JAX_FORCE_TPU_INIT: JAX's own "start the TPU anyway").
_TPU_ENV = ("TPU_NAME", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY",
            "TPU_HOST_BOUNDS", "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "CLOUD_TPU_TASK_ID",
            "JAX_FORCE_TPU_INIT")
# NVIDIA (docker, WSL2) and AMD device nodes: a GPU backend may start.
_GPU_NODES = ("dev/nvidia0", "dev/nvidiactl", "dev/dxg", "dev/kfd")


def libtpu_installed() -> bool:
    """Whether JAX would find libtpu (the wheel, or ``TPU_LIBRARY_PATH``)."""
    return importlib.util.find_spec("libtpu") is not None or bool(os.environ.get("TPU_LIBRARY_PATH"))


def tpu_may_be_present(root: str = "/", environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Whether this host may have TPU chips (errs towards True; module docstring)."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in _TPU_ENV):
        return True
    if glob.glob(os.path.join(root, "dev", "accel*")) or any(
            os.path.basename(p).isdigit() for p in glob.glob(os.path.join(root, "dev", "vfio", "*"))):
        return True
    devices = os.path.join(root, "sys", "bus", "pci", "devices")
    try:
        names = os.listdir(devices)
    except OSError:
        return True  # no PCI list to read: cannot tell
    for name in names:
        try:
            with open(os.path.join(devices, name, "vendor")) as f:
                if f.read().strip() == _GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def gpu_may_be_present(root: str = "/") -> bool:
    """Whether a GPU backend may start here (an NVIDIA or AMD device node)."""
    return any(os.path.exists(os.path.join(root, node)) for node in _GPU_NODES)


def avoid_libtpu_without_tpu(root: str = "/", environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Sets ``JAX_PLATFORMS=cpu`` (the environment, and ``jax.config`` if JAX is imported and
    its platforms are unset) when libtpu is installed but neither a TPU nor a GPU may be present
    and the user has not chosen the platforms; returns whether it did. Called first by every
    entry point in ``experiments/`` (``tests/test_platforms.py`` checks each)."""
    environ = os.environ if environ is None else environ
    if "JAX_PLATFORMS" in environ:
        return False
    jax = sys.modules.get("jax")
    if jax is not None and getattr(jax.config, "jax_platforms", None) is not None:
        return False  # chosen in code before this call
    if not libtpu_installed() or tpu_may_be_present(root, environ) or gpu_may_be_present(root):
        return False
    environ["JAX_PLATFORMS"] = "cpu"
    if jax is not None and environ is os.environ:
        jax.config.update("jax_platforms", "cpu")
    return True


# XLA's GPU compiler options that MaxText sets for its GPU runs (its GPU recipes' XLA_FLAGS):
# the latency-hiding scheduler (overlaps collectives and copies with compute), cuBLAS rather than
# Triton for matmuls, the highest-priority stream for async collectives, and while-loop double
# buffering (a scanned layer stack prefetches the next layer's weights). Every name is checked
# against jax 0.10.2's compiler by a GPU-target compile (tests/test_aot_gpu.py, slow, with the
# CUDA plugin). Given per compile (``jax.jit(..., compiler_options=...)``), not through the
# process-wide XLA_FLAGS, so they reach only programs compiled for GPUs.
GPU_XLA_FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_enable_highest_priority_async_stream": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
}
_GPU_DEVICE_PLATFORMS = ("gpu", "cuda")  # what JAX's NVIDIA devices report as their platform


def gpu_compiler_options(enabled: bool, device_platform: str) -> dict:
    """The compiler options of a program compiled for devices of ``device_platform`` (a JAX
    device's ``.platform``): :data:`GPU_XLA_FLAGS` when ``enabled`` (``config.gpu_xla_flags``)
    and the devices are NVIDIA GPUs, else none (a CPU or TPU compile never sees a GPU option)."""
    return dict(GPU_XLA_FLAGS) if enabled and device_platform in _GPU_DEVICE_PLATFORMS else {}
