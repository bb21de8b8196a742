"""The one table of the built-in kernels and context strategies: a literal mapping from each
name to the row its module declares, imported explicitly by :mod:`goat_jax.kernels` (nothing
is found by walking the package).

* :data:`KERNELS`: ``implementation=`` name -> :class:`goat_jax.kernels.capabilities.Capability`
  (the ``ROW`` at the end of each kernel module). They fill
  :data:`goat_jax.kernels.capabilities.CAPABILITIES`, the live table every reader asks.
* :data:`STRATEGIES`: ``context_strategy`` name -> :class:`goat_jax.kernels.strategies.Strategy`
  (the ``STRATEGY`` of each strategy module). They fill
  :data:`goat_jax.kernels.strategies.STRATEGIES`.

A new built-in kernel or strategy is its module and one line here. A plugin (a kernel or a
strategy defined outside the package, e.g. tests/toy_kernel.py, tests/toy_strategy.py) does not
edit this file: it registers its own row with one call
(:func:`goat_jax.kernels.capabilities.register`, :func:`goat_jax.kernels.strategies.register`).

Kernel names are compared nowhere but here and in the kernel's own module: every other module
reads a row's fields (tests/test_kernel_rows.py keeps it so).
"""

from __future__ import annotations

from typing import Dict

from goat_jax.kernels import all_gather, capabilities, cudnn, dense, flash, ring, splash, strategies, ulysses, xla

KERNELS: Dict[str, capabilities.Capability] = {
    "cudnn": cudnn.ROW,
    "dense": dense.ROW,
    "flash": flash.ROW,
    "splash": splash.ROW,
    "splash_interpret": splash.INTERPRET_ROW,
    "xla": xla.ROW,
}

STRATEGIES: Dict[str, strategies.Strategy] = {
    "all_gather": all_gather.STRATEGY,
    "ring": ring.STRATEGY,
    "ulysses": ulysses.STRATEGY,
}


def _install() -> None:
    """Fills the live tables from the literal ones (each name must be its row's own)."""
    for table, register in ((KERNELS, capabilities.register), (STRATEGIES, strategies.register)):
        for name, row in table.items():
            if row.name != name:
                raise ValueError(f"goat_jax/kernels/registry.py lists {row.name!r} as {name!r}.")
            register(row)


_install()
