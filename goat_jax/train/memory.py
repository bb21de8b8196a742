"""Will the train step fit? XLA's memory estimate of the compiled step against the machine.

The trainer compiles its train step ahead of time (the same compilation the first step would
do) and reads XLA's own plan of the memory one step needs per device: its arguments (the train
state and the batch), its outputs, and its temporaries (activations kept for the backward
pass, attention scores, gradients), minus the outputs that reuse donated arguments. A config
whose step cannot fit (e.g. ``seq_len=100000`` on the tiny LM: ~57 GiB per step on a 23 GiB
machine) is refused before any work with the estimate in the message, instead of running for
minutes and being killed by the kernel's OOM killer; one that fits only the memory not in use
now gets a warning.

What "the machine" is: for CPU devices the host's RAM (``/proc/meminfo``; every local CPU
device shares it, so the per-device need is multiplied by their number); for an accelerator,
the device's own limit (``memory_stats()['bytes_limit']``) where the backend reports it. With
no estimate or no limit known, nothing is checked. ``GOAT_SKIP_MEMORY_CHECK=1`` turns the
refusal into a warning (the estimate is XLA's plan, and allocators differ).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional, Tuple

SKIP_ENV = "GOAT_SKIP_MEMORY_CHECK"
GiB = float(1 << 30)


def step_memory(compiled: Any) -> Optional[Dict[str, int]]:
    """Per-device bytes of one call of ``compiled`` (a ``jax.stages.Compiled``) from XLA's memory
    analysis: ``arguments``, ``outputs``, ``temporaries``, ``aliased`` (outputs reusing donated
    arguments) and ``total`` = arguments + outputs + temporaries - aliased; None where the
    backend gives no analysis."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # pylint: disable=broad-except  # not implemented on some backends
        return None
    if m is None:
        return None
    out = {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
           "temporaries": int(m.temp_size_in_bytes), "aliased": int(m.alias_size_in_bytes)}
    out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
    return out


def step_bytes(compiled: Any) -> Optional[int]:
    """Bytes one call of ``compiled`` needs per device (:func:`step_memory`'s ``total``); None
    where the backend gives no analysis."""
    parts = step_memory(compiled)
    return None if parts is None else parts["total"]


def _meminfo() -> dict:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                out[key] = int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return out


def machine_memory(device: Any, local_devices: int) -> Tuple[Optional[int], Optional[int], str]:
    """``(limit, available now, what)`` in bytes for the memory ``local_devices`` devices like
    ``device`` draw on: host RAM for CPU devices, the device's limit otherwise (None: unknown)."""
    if device.platform == "cpu":
        info = _meminfo()
        return info.get("MemTotal"), info.get("MemAvailable"), "host RAM"
    try:
        stats = device.memory_stats() or {}
    except Exception:  # pylint: disable=broad-except  # not every backend has memory_stats
        stats = {}
    limit = stats.get("bytes_limit")
    free = limit - stats.get("bytes_in_use", 0) if limit else None
    return limit, free, f"{device.device_kind} memory"


def check_fits(per_device: Optional[int], device: Any, local_devices: int, *,
               limit: Optional[int] = None, available: Optional[int] = None,
               what: Optional[str] = None) -> None:
    """Refuses (ValueError) a step whose estimated ``per_device`` bytes exceed the machine's
    memory (:func:`machine_memory`, or the ``limit``/``available`` given); warns when it
    exceeds what is available now. The message holds the estimate and the ways to lower it."""
    if per_device is None:
        return
    if limit is None and available is None:
        limit, available, what = machine_memory(device, local_devices)
    what = what or "memory"
    cpu = device.platform == "cpu"
    need = per_device * (local_devices if cpu else 1)
    where = (f"{local_devices} CPU device(s) x {per_device / GiB:.2f} GiB" if cpu
             else "per device")
    estimate = (f"one train step needs an estimated {need / GiB:.2f} GiB ({where}; XLA's plan of "
                "the step: state, batch, activations and gradients)")
    advice = ("Lower the memory per step: a smaller global_batch_size or more grad_accum_steps "
              "(smaller microbatches), a shorter sequence or smaller images, rematerialization, "
              "or more devices (fsdp/tensor sharding).")
    if limit and need > limit:
        if os.environ.get(SKIP_ENV, "") not in ("", "0"):
            logging.warning("%s, more than the %.2f GiB of %s; running anyway (%s is set).",
                            estimate, limit / GiB, what, SKIP_ENV)
            return
        raise ValueError(f"{estimate}, more than the {limit / GiB:.2f} GiB of {what}: it would be "
                         f"killed for lack of memory. {advice} ({SKIP_ENV}=1 runs it anyway.)")
    if available and need > available:
        logging.warning("%s, more than the %.2f GiB of %s available now (of %.2f GiB): it may "
                        "swap or be killed. %s", estimate, available / GiB, what,
                        (limit or 0) / GiB, advice)
