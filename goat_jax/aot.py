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
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import math
import os
import re
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import jax
import numpy as np

from goat_jax import kernels
from goat_jax.targets import chips as chips_lib
from goat_jax.targets.chips import Chip
from goat_jax.train import memory as memory_lib

GiB = float(1 << 30)
# A step fits when XLA's plan leaves this fraction of the chip's HBM free: the runtime needs
# some for the program, collectives and fragmentation (XLA's own limit on v5e is ~15.75 of 16 GiB).
FIT_MARGIN = 0.05
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
    return list(topologies.get_topology_desc(topology_name=target.topology_name, platform="tpu",
                                             **dict(target.topology_kwargs)).devices)


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


def compile_train_step(config: Any, target: Target, devices: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
    """Compiles ``config``'s train step (the trainer's own, :func:`goat_jax.train.trainer.make_sharded_steps`)
    for ``target`` on this host and returns the report (:mod:`experiments.compile` writes it):
    target, num_devices, mesh, per_device_bytes, device_memory_bytes, fits, parameters,
    model_flops_per_step, estimated_step_seconds and tokens_per_second_per_chip (at peak; estimates),
    attention_implementation, packed_head_dim, compile_seconds.

    A program that does not fit (the compiler's HBM error) is reported with ``fits: False`` and
    the compiler's numbers instead of raising. Raises ValueError for an invalid config (naming
    the field) and :class:`TargetUnavailable` when libtpu or the CUDA plugin is missing. For
    GPU targets the cuDNN checks answer for the target (:func:`gpu_target`)."""
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
    with gpu_target(target):
        # The model's shapes are traced under the target's mesh too (make_sharded_steps
        # eval_shapes the init outside its own mesh context), so kernel choices are the target's.
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            steps = trainer.make_sharded_steps(task, config, mesh, rules, batch_shardings)
        abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                      steps.abstract_state, steps.state_shardings)
        # The kernels the train step uses, not the init's (traced without the batch's segment
        # ids, its choice can differ: cuDNN at init, 'flash' for packed documents).
        with kernels.record_choices() as choices:
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
    calls = custom_calls(compiled.as_text()) if compiled is not None else None
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
        "custom_calls": calls,  # in the compiled step: the kernels it really runs (splash, cuDNN)
        "compile_seconds": round(compile_seconds, 2),  # tracing and lowering included
        "lower_seconds": round(lower_seconds, 2),  # of which tracing and lowering
    }
    for key in ("attention_implementation", "packed_head_dim"):  # one value when all layers agree
        if report[key] is not None and len(report[key]) == 1:
            report[key] = report[key][0]
    if error is not None:
        report.update(fits=False, margin_bytes=None, compiler_error=error["message"],
                      compiler_used_bytes=error["used_bytes"], compiler_limit_bytes=error["limit_bytes"],
                      # by how much it does not fit: the compiler's own count (temporaries alone) over its limit
                      shortfall_bytes=(error["used_bytes"] - error["limit_bytes"]
                                       if error["used_bytes"] is not None and error["limit_bytes"] is not None
                                       else None))
    else:
        report.update(fit(None if per_device is None else per_device["total"], chip.hbm_bytes))
    return report


def with_batch(config: Any, per_device: int, remat: Optional[bool] = None, remat_field: str = "model.remat") -> Any:
    """A copy of ``config`` training ``per_device`` examples per device in one microbatch
    (``per_device_batch_size``, ``global_batch_size`` None, ``grad_accum_steps`` 1), with
    ``remat_field`` set to ``remat`` unless that is None."""
    c = copy.deepcopy(config)
    with c.unlocked():
        c.global_batch_size, c.per_device_batch_size, c.grad_accum_steps = None, int(per_device), 1
        if remat is not None:
            *path, name = remat_field.split(".")
            node = c
            for part in path:
                node = node[part]
            node[name] = bool(remat)
    return c


def largest_batch(config: Any, target: Target, remat_options: Sequence[bool] = (False, True), start: int = 1,
                  max_compiles: int = 8, remat_field: str = "model.remat",
                  log: Callable[[str], None] = lambda _: None, compile_fn: Optional[Callable[..., Dict[str, Any]]] = None,
                  ) -> Dict[str, Any]:
    """The largest per-device batch of ``config`` (one microbatch: :func:`with_batch`) whose
    train step fits ``target``, for each ``remat_options`` value of ``remat_field``: the search
    MaxText's memory estimator makes, with the real compiler. From ``start`` the batch doubles
    while it fits (halves while it does not), then bisects between the last fitting and the first
    failing batch; at most ``max_compiles`` compiles per remat setting (the bracket is then
    reported as it stands). Returns ``{'target', 'per_remat': [{'remat', 'largest' (None: not
    even the smallest tried fits), 'first_failing' (None: never failed within the compiles),
    'exact' (the two are adjacent), 'tried': [{'per_device', 'fits', 'total_bytes',
    'compile_seconds'}], 'report' (the largest fitting batch's compile report)}]}``.
    ``compile_fn`` (default :func:`compile_train_step`) is the tests' hook."""
    compile_fn = compile_fn or compile_train_step
    if int(start) < 1 or int(max_compiles) < 1:
        raise ValueError(f"largest_batch: start={start} and max_compiles={max_compiles} must be >= 1.")
    devices = target_devices(target) if compile_fn is compile_train_step else None
    out: Dict[str, Any] = {"target": target.name, "per_remat": []}
    for remat in remat_options:
        tried: List[Dict[str, Any]] = []
        reports: Dict[int, Dict[str, Any]] = {}

        def attempt(b: int) -> bool:
            rep = compile_fn(with_batch(config, b, remat, remat_field), target,
                             **({"devices": devices} if devices is not None else {}))
            mem = rep.get("per_device_bytes") or {}
            total = mem.get("total", rep.get("compiler_used_bytes"))
            tried.append({"per_device": b, "fits": bool(rep["fits"]), "total_bytes": total,
                          "compile_seconds": rep.get("compile_seconds")})
            reports[b] = rep
            log(f"  {target.name} remat={remat} per-device batch {b}: "
                f"{'n/a' if total is None else f'{total / GiB:.2f} GiB'}, fits={rep['fits']}")
            return bool(rep["fits"])

        lo, hi, b = None, None, int(start)
        while len(tried) < max_compiles:  # bracket: double while it fits, halve while it does not
            if attempt(b):
                lo = b
            else:
                hi = b
            if lo is not None and hi is not None:
                break
            if lo is None and b == 1:
                break  # not even one example per device fits
            b = b * 2 if lo is not None else b // 2
        while lo is not None and hi is not None and hi - lo > 1 and len(tried) < max_compiles:
            mid = (lo + hi) // 2
            if attempt(mid):
                lo = mid
            else:
                hi = mid
        out["per_remat"].append({"remat": bool(remat), "largest": lo, "first_failing": hi,
                                 "exact": (lo is not None and hi is not None and hi - lo == 1) or (lo is None and hi == 1),
                                 "tried": tried, "report": reports.get(lo)})
    return out


def search_markdown(search: Dict[str, Any], config_text: str = "") -> str:
    """The result of :func:`largest_batch` as a short Markdown page (OUT/search.md)."""
    def gib(b):
        return "-" if b is None else f"{b / GiB:.2f}"

    lines = [f"# Largest per-device batch that fits: {search['target']}", ""]
    if config_text:
        lines += [f"Config: `{config_text}` (one microbatch per step: grad_accum_steps 1)", ""]
    lines += ["| remat | largest fitting per-device batch | first failing | GiB/chip at the largest | "
              "tried (batch: GiB/chip) |", "|---|---:|---:|---:|---|"]
    for r in search["per_remat"]:
        best = next((t for t in r["tried"] if t["per_device"] == r["largest"]), {})
        tried = ", ".join(f"{t['per_device']}: {gib(t['total_bytes'])}{'' if t['fits'] else ' (no)'}"
                          for t in r["tried"])
        largest = "none" if r["largest"] is None else str(r["largest"])
        lines.append(f"| {'on' if r['remat'] else 'off'} | {largest}"
                     f"{'' if r['exact'] else ' (bracket only: compile budget spent)'} | "
                     f"{r['first_failing'] or '-'} | {gib(best.get('total_bytes'))} | {tried} |")
    return "\n".join(lines) + "\n"


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
    if report.get("custom_calls"):
        kernels_found = [f"`{k}` x{v}" for k, v in report["custom_calls"].items()
                         if k == "tpu_custom_call" or "fmha" in k]
        if kernels_found:
            lines.append(f"| attention kernels in the compiled step | {', '.join(kernels_found)} |")
    lines.append(f"| HBM per chip | {gib(report['device_memory_bytes'])} |")
    verdict = {True: "yes", False: "**no**", None: "unknown"}[report["fits"]]
    lines.append(f"| fits (leaving {report['fit_margin']:.0%} free) | {verdict}"
                 + (f", margin {gib(report['margin_bytes'])}" if report.get("margin_bytes") is not None else "")
                 + (f", short by at least {gib(report['shortfall_bytes'])} (the compiler's count of the temporaries "
                    "alone, over what it can use)" if report.get("shortfall_bytes") is not None else "") + " |")
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
