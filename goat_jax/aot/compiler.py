"""Compiling the trainer's own train step for a target, and reading what the compiler says:
memory per device (:func:`memory`), the HBM refusal (:func:`out_of_memory`), the kernels in the
compiled program (:func:`custom_calls`), whether a plan fits (:func:`fit`), and the report of
one compile (:func:`compile_train_step`; the numbers are explained in :mod:`goat_jax.aot`).
"""

from __future__ import annotations

import re
import time
from typing import Any, Dict, Optional, Sequence, Tuple

import jax
import numpy as np

from goat_jax import kernels
from goat_jax.kernels import widths as kernel_widths
from goat_jax.aot.target import Target, gpu_target, target_devices
from goat_jax.train import memory as memory_lib

GiB = float(1 << 30)
# A step fits when XLA's plan leaves this fraction of the chip's HBM free: the runtime needs
# some for the program, collectives and fragmentation (XLA's own limit on v5e is ~15.75 of 16 GiB).
FIT_MARGIN = 0.05


def memory(compiled: Any) -> Optional[Dict[str, int]]:
    """Per-device bytes of one call of ``compiled``: arguments, outputs, temporaries, aliased and
    total (:func:`goat_jax.train.memory.step_memory`, the engine's own memory check's numbers);
    None where the backend gives none."""
    return memory_lib.step_memory(compiled)


_SIZE = r"([0-9.]+)\s*([KMGT]?)i?B?"


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit])


def out_of_memory(error: BaseException) -> Optional[Dict[str, Any]]:
    """``{'message', 'used_bytes', 'limit_bytes'}`` when ``error`` is the TPU compiler's refusal of
    a program that does not fit in HBM (RESOURCE_EXHAUSTED: "Ran out of memory on HBM, the total
    memory required for HLO temporaries (X) exceeds available HBM (Y)", or "... Used X of Y hbm"),
    else None. ``used_bytes`` is the compiler's X (what it counted, e.g. the temporaries alone),
    ``limit_bytes`` its Y (the HBM XLA may use); None where the message has no numbers."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
        return None
    used = (re.search(r"Used\s+" + _SIZE + r"\s+of\s+" + _SIZE + r"\s+hbm", text)
            or re.search(r"\(" + _SIZE + r"\)\s+exceeds available HBM\s+\(" + _SIZE + r"\)", text))
    first = next((line.strip() for line in text.splitlines() if "memory" in line.lower()), text.strip())
    return {"message": first[:500],
            "used_bytes": _bytes(used.group(1), used.group(2)) if used else None,
            "limit_bytes": _bytes(used.group(3), used.group(4)) if used else None}


def custom_calls(hlo_text: str) -> Dict[str, int]:
    """``{custom call target: count}`` in a compiled program's text (``compiled.as_text()``):
    ``tpu_custom_call`` for Mosaic kernels (splash), ``__cudnn$fmhaSoftmax`` and its backward
    for cuDNN's fused attention, the GEMM and collective calls of the GPU compiler."""
    found: Dict[str, int] = {}
    for name in re.findall(r'custom_call_target="([^"]+)"', hlo_text):
        found[name] = found.get(name, 0) + 1
    return dict(sorted(found.items()))


def fit(per_device_total: Optional[int], hbm_bytes: int) -> Dict[str, Any]:
    """Whether ``per_device_total`` bytes fit one chip's HBM leaving :data:`FIT_MARGIN` free."""
    if per_device_total is None:
        return {"fits": None, "margin_bytes": None}
    usable = int(hbm_bytes * (1 - FIT_MARGIN))
    return {"fits": per_device_total <= usable, "margin_bytes": usable - per_device_total,
            "usable_bytes": usable}


def compile_or_out_of_memory(lowered: Any) -> Tuple[Any, Optional[Dict[str, Any]]]:
    """``(compiled, None)``, or ``(None, error)`` when the compiler refuses the program for want
    of device memory (:func:`out_of_memory`: reported, not raised); any other error is raised."""
    try:
        return lowered.compile(), None
    except Exception as e:  # pylint: disable=broad-except  # only the HBM refusal is reported
        error = out_of_memory(e)
        if error is None:
            raise
        return None, error


def finish(report: Dict[str, Any], error: Optional[Dict[str, Any]], per_device: Optional[Dict[str, int]],
           hbm_bytes: int) -> Dict[str, Any]:
    """``report`` completed with whether the program fits: the compiler's out-of-memory ``error``
    (:func:`out_of_memory`: its message, used and limit bytes, and the shortfall) or the
    :func:`fit` of the ``per_device`` memory (:func:`memory`) in ``hbm_bytes``. Returns it."""
    if error is not None:
        report.update(fits=False, margin_bytes=None, compiler_error=error["message"],
                      compiler_used_bytes=error["used_bytes"], compiler_limit_bytes=error["limit_bytes"],
                      # by how much it does not fit: the compiler's own count (temporaries alone) over its limit
                      shortfall_bytes=(error["used_bytes"] - error["limit_bytes"]
                                       if error["used_bytes"] is not None and error["limit_bytes"] is not None
                                       else None))
    else:
        report.update(fit(None if per_device is None else per_device["total"], hbm_bytes))
    return report


def compile_train_step(config: Any, target: Target, devices: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
    """Compiles ``config``'s train step (the trainer's own, :func:`goat_jax.train.trainer.make_sharded_steps`)
    for ``target`` on this host and returns the report (:mod:`experiments.compile` writes it):
    target, num_devices, mesh, per_device_bytes, device_memory_bytes, fits, parameters,
    model_flops_per_step, estimated_step_seconds and tokens_per_second_per_chip (at peak; estimates),
    attention_implementation, packed_head_dim, context_strategy / load_balanced / ring_blocks /
    whole_sequence (under context parallelism: how attention crosses the shards, which kernel's
    block math computes a ring's blocks, which kernel Ulysses runs on the whole sequence; None
    otherwise), compile_seconds.

    A program that does not fit (the compiler's HBM error) is reported with ``fits: False`` and
    the compiler's numbers instead of raising. Raises ValueError for an invalid config (naming
    the field) and :class:`TargetUnavailable` when libtpu or the CUDA plugin is missing. For
    GPU targets the cuDNN checks answer for the target (:func:`gpu_target`)."""
    from goat_jax.train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
    from goat_jax.train import tasks as tasks_lib
    from goat_jax.train import trainer

    devices = target_devices(target) if devices is None else list(devices)
    hosts = len({d.process_index for d in devices})
    global_batch, plan = trainer.validate_config(config, len(devices), hosts)  # the compile's one plan
    task = tasks_lib.get_task(config.task)
    config = tasks_lib.with_field_defaults(config, task)
    mesh = sharding_lib.make_mesh(config.mesh, devices)
    rules = sharding_lib.rules_from_config(config.sharding_rules)
    # One host's rows, as the trainer: the hosts feed `groups` distinct row blocks.
    groups = sharding_lib.batch_groups(mesh, global_batch, process_index=devices[0].process_index)[1]
    local = task.dummy_batch(config, global_batch // groups)
    batch_shardings = {k: sharding_lib.batch_sharding(mesh, np.ndim(v)) for k, v in local.items()}
    abstract_batch = trainer.global_abstract_batch(local, batch_shardings, groups)

    start = time.perf_counter()
    with gpu_target(target):
        # The model's shapes are traced under the target's mesh too (make_sharded_steps
        # eval_shapes the init outside its own mesh context), so kernel choices are the target's.
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            steps = trainer.make_sharded_steps(task, config, mesh, rules, batch_shardings, plan=plan)
        abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                      steps.abstract_state, steps.state_shardings)
        # The kernels the train step uses, not the init's (traced without the batch's segment
        # ids, its choice can differ: cuDNN at init, 'flash' for packed documents).
        with kernels.record_choices() as choices, kernel_widths.record_layout_warnings() as layout_warnings:
            lowered = steps.train_step.lower(abstract_state, abstract_batch)
    lower_seconds = time.perf_counter() - start
    compiled, error = compile_or_out_of_memory(lowered)
    compile_seconds = time.perf_counter() - start

    chip = target.chip
    parameters = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(steps.abstract_state.params))
    tokens = global_batch * int(task.tokens_per_example(config))
    per_token = task.flops_per_token(config)
    flops = None if per_token is None else float(per_token) * tokens
    seconds = None if flops is None else flops / (chip.peak_bf16_flops * len(devices))
    per_device = memory(compiled) if compiled is not None else None
    calls = custom_calls(compiled.as_text()) if compiled is not None else None
    report: Dict[str, Any] = {
        "step": "train", "target": target.name, "topology": target.topology_name, "device_kind": devices[0].device_kind,
        "num_devices": len(devices), "num_hosts": hosts, "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "global_batch_size": global_batch, "tokens_per_step": tokens,
        "per_device_bytes": per_device,
        "device_memory_bytes": chip.hbm_bytes, "fit_margin": FIT_MARGIN,
        "parameters": parameters,
        "model_flops_per_step": flops,
        "peak_bf16_flops_per_chip": chip.peak_bf16_flops, "peak_source": chip.source,
        "estimated_step_seconds": seconds,
        "estimated_tokens_per_second_per_chip": None if not seconds else tokens / seconds / len(devices),
        "estimate_note": "at 100% of the chips' peak bf16 FLOP/s (analytic model FLOPs / peak): a lower "
                         "bound on the step time, not a measurement",
        "attention_implementation": sorted({c["implementation"] for c in choices}) or None,
        "packed_head_dim": sorted({c["qk_dim"] for c in choices}) or None,
        # How attention crosses the mesh's context axis (None without context parallelism); a
        # ring's blocks are computed by ring_blocks' block math, whatever the implementation says.
        **{key: sorted({c[key] for c in choices if key in c}) or None
           for key in ("context_strategy", "load_balanced", "ring_blocks", "whole_sequence")},
        "custom_calls": calls,  # in the compiled step: the kernels it really runs (splash, cuDNN)
        "layout_warnings": layout_warnings,  # GOAT's packed width off the kernel's fast path (kernels/widths.py)
        "compile_seconds": round(compile_seconds, 2),  # tracing and lowering included
        "lower_seconds": round(lower_seconds, 2),  # of which tracing and lowering
    }
    for key in ("attention_implementation", "packed_head_dim", "context_strategy", "load_balanced",
                "ring_blocks", "whole_sequence"):  # one value when all layers agree
        if report[key] is not None and len(report[key]) == 1:
            report[key] = report[key][0]
    return finish(report, error, per_device, chip.hbm_bytes)
