"""Side-by-side measurement of compiled JAX functions: what the benchmark scripts share.

A :class:`Variant` is one compiled function (e.g. a forward+backward) with its compiled memory;
:func:`measure` times several variants in rotated order, so that background load on a shared
machine hits every variant alike and ratios between them stay meaningful. Wall and process CPU
times are both kept: CPU time is robust to other processes, wall time is what a user waits.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Tuple

import jax


class Variant:
    """A benchmarked function: ``run()`` does one forward+backward and blocks until done."""

    def __init__(self, name: str, run: Callable[[], None], memory: Optional[int]):
        self.name, self.run, self.memory = name, run, memory
        self.note = ""  # why it was not run, if it was not
        self.times: List[float] = []  # wall seconds
        self.cpu: List[float] = []  # process CPU seconds (all threads): robust to other load


def jax_variant(name: str, loss: Callable, args: Tuple, argnums: Sequence[int]) -> Variant:
    """Compiles ``grad(loss)`` once; its memory is temp + argument + output bytes."""
    grad = jax.jit(jax.grad(loss, argnums=tuple(argnums)))
    compiled = grad.lower(*args).compile()
    mem = compiled.memory_analysis()
    total = None
    if mem is not None:
        total = int(mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes)
    return Variant(name, lambda: jax.block_until_ready(compiled(*args)), total)


def measure(variants: List[Variant], repeats: int, warmup: bool = True) -> None:
    """Warm-up, then ``repeats`` rounds, each variant once per round in a rotated order."""
    variants = [v for v in variants if v.run is not None]
    for var in variants if warmup else []:
        var.run()
    for r in range(repeats):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for var in order:
            t0, c0 = time.perf_counter(), time.process_time()
            var.run()
            var.times.append(time.perf_counter() - t0)
            var.cpu.append(time.process_time() - c0)
