"""Ahead-of-time compilation for TPU slices and GPU nodes from any host: will a run fit, and how fast could it be?

JAX can compile for TPUs that are not there: with libtpu installed (the ``aot`` extra,
``pip install 'goat-jax[aot]'``), :func:`target_devices` gives the compile-only devices of a
slice (``jax.experimental.topologies``), a mesh over them is the run's mesh, and
``jit(...).lower(abstract inputs).compile()`` runs the real TPU compiler, Mosaic kernels
(splash attention) included; ``memory_analysis()`` then gives the bytes one step needs on each
device. :func:`compile_train_step` does that for the trainer's own train step (MaxText's
``train_compile.py`` is the model): target -> mesh from ``config.mesh`` -> the train state as
abstract arrays with their shardings (nothing materialized) -> the batch as
``ShapeDtypeStruct`` s -> lower, compile -> memory per device, fit, and an analytic
FLOP-count estimate of the step time at peak. ``python -m experiments.compile`` is the command
(docs/aot.md).

GPU nodes compile the same way with the CUDA plugin (the ``aot-gpu`` extra): ``h100x8``,
``h200x1``, ``h200x8`` (GPU model x GPUs; more than 8 is nodes of 8) build compile-only CUDA
devices from a committed target description (``goat_jax/targets/*.txtpb``, a
``GpuTargetConfig`` from NVIDIA's published specifications), and :func:`gpu_target` stands in
for the attached GPU that jax's cuDNN checks would otherwise ask for (:func:`gpu_target`).

Targets are named as Google Cloud names TPU slices: ``v5e-16`` and ``v6e-8`` count **chips**,
``v4-8`` and ``v5p-32`` count **TensorCores** (two per chip: v5p-32 is 16 chips). One JAX device
is one chip on all four (v4 and v5p as megacore), so "per device" below is per chip.

What the numbers are: ``per_device_bytes`` is XLA's plan (arguments + outputs + temporaries -
aliased, i.e. donated state reused for the new state); the runtime needs a little more (program
code, collectives' buffers), hence the margin in :data:`FIT_MARGIN`. ``model_flops_per_step``
is the task's analytic count (PaLM appendix B for the LM, ``goat_jax.models.lm``), not XLA's
``cost_analysis()`` (which counts what the compiler emitted, rematerialization and padding
included, and on TPU is not a model FLOP count). ``estimated_step_seconds`` divides it by the
slice's peak bf16 FLOP/s: a lower bound at 100% MFU, **an estimate, not a measurement**.

One concern a module, every public name re-exported here (``aot.compile_train_step``):
:mod:`~goat_jax.aot.target` (target names, compile-only devices, the cuDNN stand-in),
:mod:`~goat_jax.aot.compiler` (the compile and what it reports: memory, the HBM refusal, custom
calls, fit), :mod:`~goat_jax.aot.decode` (one KV-cache decode step against a cache of the full
window, split over ``context`` where the mesh has it, and the cache's bytes per chip), :mod:`~goat_jax.aot.search` (the largest batch that fits) and
:mod:`~goat_jax.aot.report` (the Markdown pages). The chips' numbers come from the one chip
table, :mod:`goat_jax.targets.chips`.
"""

from goat_jax.aot.compiler import (FIT_MARGIN, GiB, compile_train_step, custom_calls, fit, memory,
                                   out_of_memory)
from goat_jax.aot.decode import cache_bytes, cache_shardings, compile_decode_step, step_rules
from goat_jax.aot.report import markdown, search_markdown, summary_table
from goat_jax.aot.search import largest_batch, with_batch
from goat_jax.aot.target import (CHIPS, GPU_INSTALL_HINT, GPUS_PER_NODE, INSTALL_HINT, TARGET_FAMILIES, Chip,
                                 Target, TargetUnavailable, cuda_plugin_installed, gpu_target,
                                 libtpu_installed, parse_target, target_devices)

__all__ = ["CHIPS", "FIT_MARGIN", "GPU_INSTALL_HINT", "GPUS_PER_NODE", "GiB", "INSTALL_HINT", "TARGET_FAMILIES",
           "Chip", "Target", "TargetUnavailable", "cache_bytes", "cache_shardings", "compile_decode_step",
           "compile_train_step", "cuda_plugin_installed", "custom_calls",
           "fit", "gpu_target", "largest_batch", "libtpu_installed", "markdown", "memory", "out_of_memory",
           "parse_target", "search_markdown", "step_rules", "summary_table", "target_devices", "with_batch"]
