"""Ahead-of-time targets: a TPU slice or GPU node by name (:func:`parse_target`), its
compile-only devices built on this host (:func:`target_devices`: libtpu or JAX's CUDA plugin),
and the stand-in for the attached GPU that jax's cuDNN checks would otherwise ask for
(:func:`gpu_target`). The chips' numbers are the one chip table's (goat_jax/targets/chips.py).

Targets are named as Google Cloud names TPU slices: ``v5e-16`` and ``v6e-8`` count **chips**,
``v4-8`` and ``v5p-32`` count **TensorCores** (two per chip: v5p-32 is 16 chips). One JAX device
is one chip on all four (v4 and v5p as megacore). GPU nodes are model x GPUs: ``h100x8``,
``h200x1``, ``h200x8`` (more than 8 is nodes of 8), compiled from a committed target description
(``goat_jax/targets/*.txtpb``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import re
from typing import Any, Iterator, List, Optional, Tuple

from goat_jax.targets import chips as chips_lib
from goat_jax.targets.chips import Chip

INSTALL_HINT = "pip install 'goat-jax[aot]' (libtpu for jax 0.10.2; or: pip install 'jax[tpu]==0.10.2')"
# The CUDA plugin is its own extra: ~3.2 GB of wheels, ~4.9 GB installed (docs/aot.md).
GPU_INSTALL_HINT = ("pip install 'goat-jax[aot-gpu]' (the CUDA plugin for jax 0.10.2; or: "
                    "pip install 'jax[cuda12]==0.10.2')")
GPUS_PER_NODE = 8  # HGX / DGX H100 and H200 nodes


# The chips one can compile for, in the order the error messages list them: rows of the one chip
# table (goat_jax/targets/chips.py, where every chip's peak FLOP/s, HBM and bandwidth are stated).
TARGET_FAMILIES = ("v4", "v5e", "v5p", "v6e", "h100", "h200")
CHIPS = {family: chips_lib.CHIPS[family] for family in TARGET_FAMILIES}


@dataclasses.dataclass(frozen=True)
class Target:
    """A TPU slice by its Cloud name (``v5e-16``) or a GPU node (``h200x8``): the chip, the
    number of chips, and the arguments of ``jax.experimental.topologies.get_topology_desc``
    that build its devices (for GPUs ``topology_name`` is slices x hosts x GPUs per host)."""

    name: str
    chip: Chip
    num_chips: int
    topology_name: str
    topology_kwargs: Tuple[Tuple[str, Any], ...]


class TargetUnavailable(ValueError):
    """The host cannot compile for the target (libtpu or the CUDA plugin is not installed): one
    line naming the extra (a ValueError, so the commands print it as their one-line error)."""


def _grid(chips: int, dims: int) -> Tuple[int, ...]:
    """The slice's chip grid: 2D (v5e/v6e) 1x1, 1x2, 2x2, 2x4, 4x4, 4x8, ...; 3D (v4/v5p) from
    2x2x1 by doubling the last of the smallest sides: 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ..."""
    if dims == 2:
        x = 1 << (int(math.log2(chips)) // 2)
        return (x, chips // x)
    shape = [2, 2, 1]
    while math.prod(shape) < chips:
        low = min(shape)
        last = max(i for i, s in enumerate(shape) if s == low)
        shape[last] *= 2
    return tuple(shape)


def _parse_gpu_target(name: str, chip: Chip, count: int) -> Target:
    """``h200x8`` -> one node of 8; more than 8 GPUs are nodes of :data:`GPUS_PER_NODE`."""
    if count < 1 or (count <= GPUS_PER_NODE and count & (count - 1)) or (
            count > GPUS_PER_NODE and count % GPUS_PER_NODE):
        raise ValueError(f"--target {name!r}: {chip.family}xN counts GPUs: 1, 2, 4 or 8 in one node, "
                         f"or a multiple of {GPUS_PER_NODE} (nodes of {GPUS_PER_NODE}).")
    hosts, per_host = (1, count) if count <= GPUS_PER_NODE else (count // GPUS_PER_NODE, GPUS_PER_NODE)
    return Target(name.strip(), chip, count, f"1x{hosts}x{per_host}", ())


def parse_target(name: str) -> Target:
    """``'v5e-16'`` or ``'h200x8'`` -> :class:`Target`. The number counts chips for v5e/v6e,
    TensorCores for v4/v5p (Cloud's names) and GPUs for h100/h200. ValueError naming the
    accepted forms otherwise."""
    gpu = re.fullmatch(r"\s*(h100|h200)x(\d+)\s*", name or "")
    if gpu:
        return _parse_gpu_target(name, CHIPS[gpu.group(1)], int(gpu.group(2)))
    m = re.fullmatch(r"\s*(v4|v5e|v5p|v6e)-(\d+)\s*", name or "")
    known = ", ".join(f"{c.family}-N (N {c.name_counts})" for c in CHIPS.values() if c.platform == "tpu")
    if not m:
        raise ValueError(f"--target {name!r}: expected a TPU slice as Cloud names it, one of {known}; "
                         "e.g. v5e-16, v5p-32, v6e-8, v4-8; or a GPU node: h100x8, h200x1, h200x8 "
                         "(model x GPUs).")
    chip, count = CHIPS[m.group(1)], int(m.group(2))
    chips = count // 2 if chip.name_counts == "TensorCores" else count
    if count < 1 or chips < 1 or chips & (chips - 1) or (chip.name_counts == "TensorCores" and count % 2):
        raise ValueError(f"--target {name!r}: {chip.family} slices have a power-of-two number of "
                         f"chips ({chip.family}-N counts {chip.name_counts}).")
    if chip.topology_dims == 3 and chips < 4:
        raise ValueError(f"--target {name!r}: the smallest {chip.family} slice is {chip.family}-8 (4 chips).")
    grid = _grid(chips, chip.topology_dims)
    kwargs: List[Tuple[str, Any]] = []
    if chip.topology_dims == 3:
        kwargs.append(("chip_config_name", "megacore"))  # one JAX device per chip, as on Cloud
    elif chips < 4:  # smaller than one host's 2x2 chips
        kwargs.append(("chips_per_host_bounds", (grid[0], grid[1], 1)))
    return Target(name.strip(), chip, chips, f"{chip.family}:{'x'.join(map(str, grid))}", tuple(kwargs))


def libtpu_installed() -> bool:
    """Whether the libtpu wheel (the TPU compiler) is importable here."""
    return importlib.util.find_spec("libtpu") is not None


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin (the GPU compiler, ``jax[cuda12]``) is importable here."""
    try:
        return (importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
                and importlib.util.find_spec("jax_cuda12_plugin") is not None)
    except ImportError:  # no jax_plugins namespace at all
        return False


def _gpu_devices(target: Target) -> List[Any]:
    if not cuda_plugin_installed():
        raise TargetUnavailable(f"compiling for {target.name} needs JAX's CUDA plugin, which is not "
                                f"installed: {GPU_INSTALL_HINT}.")
    # The plugin checks the CUDA libraries against an attached GPU's driver; there is none.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
    from goat_jax import targets  # pylint: disable=g-import-not-at-top
    return list(topologies.get_topology_desc(platform="cuda", topology=target.topology_name,
                                             target_config=targets.read(target.chip.target_config)).devices)


def target_devices(target: Target) -> List[Any]:
    """The compile-only devices of ``target``'s slice or node, built on this host (no TPU or GPU
    needed).

    Raises :class:`TargetUnavailable` (one line naming the extra) when libtpu (TPU targets) or
    the CUDA plugin (GPU targets) is missing."""
    if target.chip.platform == "cuda":
        return _gpu_devices(target)
    if not libtpu_installed():
        raise TargetUnavailable(f"compiling for {target.name} needs the TPU compiler, which is not "
                                f"installed: {INSTALL_HINT}.")
    # libtpu guards real chips with a lockfile in /tmp; compile-only use touches no chip, and the
    # guard refuses it on some hosts ("Internal error when accessing libtpu multi-process lockfile").
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
    with libtpu_off_tpu_vm():
        return list(topologies.get_topology_desc(topology_name=target.topology_name, platform="tpu",
                                                 **dict(target.topology_kwargs)).devices)


# What libtpu 0.0.42.1 reads when it loads, set for a host without TPU chips (tried one by one:
# each of the first two silences one of its error lines, the third its log folder). Without them
# libtpu asks the host for a Cloud TPU VM's description, prints ``Failed to find host bounds for
# accelerator type`` and ``E0000 ... unexpected worker hostname ... TPU_WORKER_HOSTNAMES`` with a
# source-location trace, and writes /tmp/tpu_logs/. The compile-only devices come from the
# target's topology, not from these: compile.json is the same with or without them.
LIBTPU_OFF_TPU_VM_ENV = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1",
                         "TPU_LOG_DIR": "disabled"}


@contextlib.contextmanager
def libtpu_off_tpu_vm() -> Iterator[None]:
    """While libtpu loads for compile-only devices on a host without TPU chips: the environment of
    :data:`LIBTPU_OFF_TPU_VM_ENV` (each variable only where unset), restored afterwards so that
    child processes and :func:`goat_jax.platforms.tpu_may_be_present` (which reads TPU variables
    as signs of a TPU VM) see the environment as it was. Where a TPU may be present nothing is
    set: that host's own TPU environment is the right one."""
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top

    added = {} if platforms.tpu_may_be_present() else {
        k: v for k, v in LIBTPU_OFF_TPU_VM_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@contextlib.contextmanager
def gpu_target(target: Optional[Target]) -> Iterator[None]:
    """While tracing for a GPU ``target`` on a host without that GPU: jax's cuDNN attention
    checks answer for the target's compute capability and cuDNN version, not the host's.

    jax 0.10.2 (``jax._src.cudnn.fused_attention_stablehlo``) asks the *local* default backend
    for the compute capability; on a CPU host that is "not CUDA", so Hopper's head-dim limit of
    256 becomes 128 and Hopper-only layouts are refused. This AOT-only workaround replaces those
    three queries for the ``with`` block (and the cuDNN version, read from the host's libraries
    otherwise, by the target description's). Nothing changes for TPU targets or ``None``, nor
    on a host whose own default backend is a CUDA GPU."""
    if target is None or target.chip.platform != "cuda":
        yield
        return
    from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    if "cuda" in str(getattr(xla_bridge.get_backend(), "platform_version", "")):
        yield  # a real GPU answers for itself
        return
    have = target.chip.compute_capability
    dnn = _dnn_version(target)
    saved = {k: getattr(fa, k) for k in ("check_compute_capability", "is_cuda_compute_capability_equal",
                                         "check_cudnn_version")}
    fa.check_compute_capability = lambda c: have >= tuple(int(x) for x in c.split("."))
    fa.is_cuda_compute_capability_equal = lambda c: have == tuple(int(x) for x in c.split("."))
    fa.check_cudnn_version = lambda: dnn
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(fa, k, v)


def _dnn_version(target: Target) -> int:
    """The target description's cuDNN version as cuDNN numbers it (9.28.0 -> 92800)."""
    from goat_jax import targets  # pylint: disable=g-import-not-at-top
    text = targets.read(target.chip.target_config)
    m = re.search(r"dnn_version_info\s*\{\s*major:\s*(\d+)\s*minor:\s*(\d+)\s*patch:\s*(\d+)", text)
    if not m:
        raise ValueError(f"goat_jax/targets/{target.chip.target_config} has no dnn_version_info.")
    major, minor, patch = map(int, m.groups())
    return major * 10000 + minor * 100 + patch
