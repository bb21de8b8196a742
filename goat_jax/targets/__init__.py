"""The accelerators the repository knows: the chip table (:mod:`goat_jax.targets.chips`: peak
FLOP/s, HBM and bandwidth per chip, read by the compiles, the trainer's MFU and the one-GPU check)
and the GPU target descriptions for ahead-of-time compiles (:mod:`goat_jax.aot`, docs/aot.md).

Each ``*.txtpb`` file is an XLA ``stream_executor.GpuTargetConfigProto`` in text format: what
the CUDA compiler would otherwise read from an attached GPU (compute capability, SM count,
shared memory, registers, memory size and bandwidth, L2, clock) plus the cuDNN and CUDA runtime
versions of the compile. ``jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=<text>, topology="1x1x8")`` turns one into compile-only devices. The figures are
NVIDIA's published specifications; each file says which publication each came from.
"""

import os

FOLDER = os.path.dirname(os.path.abspath(__file__))


def read(name: str) -> str:
    """The text of the target description ``name`` (a file in this folder, e.g. 'h200_sxm.txtpb')."""
    with open(os.path.join(FOLDER, name), encoding="utf-8") as f:
        return f.read()
