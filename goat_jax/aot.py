"""Ahead-of-time compilation for TPU slices from any host: will a run fit, and how fast could it be?

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
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np

from goat_jax import kernels
from goat_jax.train import memory as memory_lib

GiB = float(1 << 30)
# A step fits when XLA's plan leaves this fraction of the chip's HBM free: the runtime needs
# some for the program, collectives and fragmentation (XLA's own limit on v5e is ~15.75 of 16 GiB).
FIT_MARGIN = 0.05
INSTALL_HINT = "pip install 'goat-jax[aot]' (libtpu for jax 0.10.2; or: pip install 'jax[tpu]==0.10.2')"


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation: per-chip peak dense bf16 FLOP/s, HBM and its bandwidth, and what the
    number in its Cloud slice name counts."""

    family: str
    device_kind: str  # as JAX reports it
    peak_bf16_flops: float  # per chip
    hbm_bytes: int  # per chip
    hbm_bytes_per_s: float  # per chip
    name_counts: str  # 'chips' | 'TensorCores'
    topology_dims: int  # 2 (v5e, v6e: 2D torus) or 3 (v4, v5p)
    source: str


# Google Cloud's system-architecture pages (numbers per chip; checked 2026-12).
CHIPS = {
    "v4": Chip("v4", "TPU v4", 275e12, 32 << 30, 1200e9, "TensorCores", 3,
               "https://cloud.google.com/tpu/docs/v4"),
    "v5e": Chip("v5e", "TPU v5 lite", 197e12, 16 << 30, 819e9, "chips", 2,
                "https://cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip("v5p", "TPU v5", 459e12, 95 << 30, 2765e9, "TensorCores", 3,
                "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip("v6e", "TPU v6 lite", 918e12, 32 << 30, 1640e9, "chips", 2,
                "https://cloud.google.com/tpu/docs/v6e"),
}


@dataclasses.dataclass(frozen=True)
class Target:
    """A TPU slice by its Cloud name (``v5e-16``): the chip, the number of chips, and the
    arguments of ``jax.experimental.topologies.get_topology_desc`` that build its devices."""

    name: str
    chip: Chip
    num_chips: int
    topology_name: str
    topology_kwargs: Tuple[Tuple[str, Any], ...]


class TargetUnavailable(ValueError):
    """The host cannot compile for the target (libtpu is not installed): one line naming the extra
    (a ValueError, so the commands print it as their one-line error)."""


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


def parse_target(name: str) -> Target:
    """``'v5e-16'`` -> :class:`Target`. The number counts chips for v5e/v6e and TensorCores for
    v4/v5p (Cloud's names). ValueError naming the accepted forms otherwise."""
    m = re.fullmatch(r"\s*(v4|v5e|v5p|v6e)-(\d+)\s*", name or "")
    known = ", ".join(f"{c.family}-N (N {c.name_counts})" for c in CHIPS.values())
    if not m:
        raise ValueError(f"--target {name!r}: expected a TPU slice as Cloud names it, one of {known}; "
                         "e.g. v5e-16, v5p-32, v6e-8, v4-8.")
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


def target_devices(target: Target) -> List[Any]:
    """The compile-only devices of ``target``'s slice, built on this host (no TPU needed).

    Raises :class:`TargetUnavailable` (one line naming the extra) when libtpu is missing."""
    if not libtpu_installed():
        raise TargetUnavailable(f"compiling for {target.name} needs the TPU compiler, which is not "
                                f"installed: {INSTALL_HINT}.")
    # libtpu guards real chips with a lockfile in /tmp; compile-only use touches no chip, and the
    # guard refuses it on some hosts ("Internal error when accessing libtpu multi-process lockfile").
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
    return list(topologies.get_topology_desc(topology_name=target.topology_name, platform="tpu",
                                             **dict(target.topology_kwargs)).devices)


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


def fit(per_device_total: Optional[int], hbm_bytes: int) -> Dict[str, Any]:
    """Whether ``per_device_total`` bytes fit one chip's HBM leaving :data:`FIT_MARGIN` free."""
    if per_device_total is None:
        return {"fits": None, "margin_bytes": None}
    usable = int(hbm_bytes * (1 - FIT_MARGIN))
    return {"fits": per_device_total <= usable, "margin_bytes": usable - per_device_total,
            "usable_bytes": usable}


def compile_train_step(config: Any, target: Target, devices: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
    """Compiles ``config``'s train step (the trainer's own, :func:`goat_jax.train.trainer.make_sharded_steps`)
    for ``target`` on this host and returns the report (:mod:`experiments.compile` writes it):
    target, num_devices, mesh, per_device_bytes, device_memory_bytes, fits, parameters,
    model_flops_per_step, estimated_step_seconds and tokens_per_second_per_chip (at peak; estimates),
    attention_implementation, packed_head_dim, compile_seconds.

    A program that does not fit (the compiler's HBM error) is reported with ``fits: False`` and
    the compiler's numbers instead of raising. Raises ValueError for an invalid config (naming
    the field) and :class:`TargetUnavailable` when libtpu is missing."""
    from goat_jax.train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
    from goat_jax.train import tasks as tasks_lib
    from goat_jax.train import trainer

    devices = target_devices(target) if devices is None else list(devices)
    hosts = len({d.process_index for d in devices})
    global_batch = trainer.validate_config(config, len(devices), hosts)
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
    with kernels.record_choices() as choices:
        # The model's shapes are traced under the target's mesh too (make_sharded_steps
        # eval_shapes the init outside its own mesh context), so kernel choices are the target's.
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            steps = trainer.make_sharded_steps(task, config, mesh, rules, batch_shardings)
        abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                      steps.abstract_state, steps.state_shardings)
        lowered = steps.train_step.lower(abstract_state, abstract_batch)
    lower_seconds = time.perf_counter() - start
    error = None
    try:
        compiled = lowered.compile()
    except Exception as e:  # pylint: disable=broad-except  # only the HBM refusal is reported
        error = out_of_memory(e)
        if error is None:
            raise
        compiled = None
    compile_seconds = time.perf_counter() - start

    chip = target.chip
    parameters = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(steps.abstract_state.params))
    tokens = global_batch * int(task.tokens_per_example(config))
    per_token = task.flops_per_token(config)
    flops = None if per_token is None else float(per_token) * tokens
    seconds = None if flops is None else flops / (chip.peak_bf16_flops * len(devices))
    per_device = memory(compiled) if compiled is not None else None
    report: Dict[str, Any] = {
        "target": target.name, "topology": target.topology_name, "device_kind": devices[0].device_kind,
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
        "compile_seconds": round(compile_seconds, 2),  # tracing and lowering included
        "lower_seconds": round(lower_seconds, 2),  # of which tracing and lowering
    }
    for key in ("attention_implementation", "packed_head_dim"):  # one value when all layers agree
        if report[key] is not None and len(report[key]) == 1:
            report[key] = report[key][0]
    if error is not None:
        report.update(fits=False, margin_bytes=None, compiler_error=error["message"],
                      compiler_used_bytes=error["used_bytes"], compiler_limit_bytes=error["limit_bytes"])
    else:
        report.update(fit(None if per_device is None else per_device["total"], chip.hbm_bytes))
    return report


def markdown(report: Dict[str, Any]) -> str:
    """The report as a short Markdown page (OUT/compile.md)."""
    def gib(b):
        if b is None:
            return "n/a"
        return f"{b / GiB:.2f} GiB" if abs(b) >= GiB / 4 else f"{b / 2**20:.2f} MiB"

    mem = report.get("per_device_bytes") or {}
    lines = [f"# Ahead-of-time compile: {report['target']} ({report['topology']}, {report['device_kind']})", ""]
    if report.get("config"):
        lines += [f"Config: `{report['config']}`", ""]
    lines += ["| | |", "|---|---|",
              f"| devices (chips) | {report['num_devices']} on {report['num_hosts']} host(s), mesh {report['mesh']} |",
              f"| global batch | {report['global_batch_size']} ({report['tokens_per_step']} tokens/step) |",
              f"| parameters | {report['parameters']:,} |",
              f"| attention | {report['attention_implementation']}, packed q/k head dim {report['packed_head_dim']} |"]
    for key in ("arguments", "outputs", "temporaries", "aliased", "total"):
        lines.append(f"| per device: {key} | {gib(mem.get(key))} |")
    lines.append(f"| HBM per chip | {gib(report['device_memory_bytes'])} |")
    verdict = {True: "yes", False: "**no**", None: "unknown"}[report["fits"]]
    lines.append(f"| fits (leaving {report['fit_margin']:.0%} free) | {verdict}"
                 + (f", margin {gib(report['margin_bytes'])}" if report.get("margin_bytes") is not None else "") + " |")
    if report.get("compiler_error"):
        lines.append(f"| compiler | {report['compiler_error']} |")
    flops = report["model_flops_per_step"]
    lines.append(f"| model FLOPs/step (analytic) | {'n/a' if flops is None else f'{flops:.4g}'} |")
    if report["estimated_step_seconds"]:
        step = report["estimated_step_seconds"]
        lines.append(f"| estimated step time at peak | "
                     f"{f'{step * 1e3:.2f} ms' if step >= 1e-3 else f'{step * 1e6:.1f} us'} |")
        lines.append(f"| estimated tokens/s/chip at peak | {report['estimated_tokens_per_second_per_chip']:,.0f} |")
    lines.append(f"| compile time on this host | {report['compile_seconds']:.1f} s "
                 f"(tracing and lowering {report.get('lower_seconds', 0):.1f} s) |")
    lines += ["", f"Estimates: {report['estimate_note']}; peak {report['peak_bf16_flops_per_chip'] / 1e12:.0f} "
              f"TFLOP/s per chip ({report['peak_source']}). Memory: XLA's plan of one step per device "
              "(arguments + outputs + temporaries - aliased donated state).", ""]
    return "\n".join(lines)


def summary_table(reports: Sequence[Dict[str, Any]]) -> str:
    """One Markdown row per compile report (benchmarks/aot.md): config, target, kernel, packed
    head dim, per-device GiB (arguments, temporaries, total), HBM, fits, the estimates at peak
    and the compile time."""
    g = lambda b: "-" if b is None else f"{b / GiB:.3f}"
    rows = ["| config | target | attention | packed head dim | parameters | args GiB | temps GiB | "
            "total GiB/chip | HBM GiB | fits | model TFLOP/step | est. step at peak | "
            "est. tokens/s/chip at peak | compile s |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in reports:
        m = r.get("per_device_bytes") or {}
        total = m.get("total")
        if total is None and r.get("compiler_used_bytes"):
            total = r["compiler_used_bytes"]  # the compiler's own count when it refused
        step = r.get("estimated_step_seconds")
        flops = r.get("model_flops_per_step")
        rate = r.get("estimated_tokens_per_second_per_chip")
        rows.append(
            f"| `{r.get('config') or '-'}` | {r['target']} | {r['attention_implementation']} | "
            f"{r['packed_head_dim']} | {r['parameters']:,} | {g(m.get('arguments'))} | "
            f"{g(m.get('temporaries'))} | {g(total)}{'' if m else ' (compiler)'} | "
            f"{g(r['device_memory_bytes'])} | {'yes' if r['fits'] else '**no**'} | "
            f"{'-' if flops is None else f'{flops / 1e12:.1f}'} | "
            f"{'-' if not step else f'{step * 1e3:.1f} ms'} | "
            f"{'-' if not rate else f'{rate:,.0f}'} | "
            f"{r['compile_seconds']:.0f} |")
    return "\n".join(rows) + "\n"
