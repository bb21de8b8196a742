"""A toy context strategy, written only against the strategies' contract: it registers its own
row (:func:`goat_jax.kernels.strategies.register`) when imported and touches no other file.
tests/test_plan.py imports it in a fresh process, finds it among the strategies (and the engine's
``context_strategy`` choices) and runs attention with the sequence split over the context axis.

It hands the whole global arrays to the kernel and lets XLA partition the work (every kernel
but splash can be partitioned by XLA): correct for sequences in natural order.
"""

from goat_jax.kernels import strategies
from goat_jax.kernels.local import attend_local


CALLS = []  # one entry per call: the test sees the strategy ran


def attend(q, k, v, *, mask, bias, mesh, plan, implementation, scale):
    """The strategies' signature (:mod:`goat_jax.kernels.strategies`)."""
    CALLS.append(implementation)
    del mesh
    if plan.load_balanced:
        raise ValueError("context_strategy='toy' needs sequences in natural order (context_load_balance=False).")
    return attend_local(q, k, v, mask, bias, implementation=implementation, scale=scale)


STRATEGY = strategies.register(strategies.Strategy(name="toy", attend=attend,
                                                   summary="XLA partitions the global call (a test)"))
