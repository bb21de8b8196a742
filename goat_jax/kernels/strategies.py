"""How attention crosses the ``context`` mesh axis: one row per context strategy
(:data:`STRATEGIES`), each declared by its own module (``STRATEGY = strategies.register(...)``:
'all_gather' in :mod:`goat_jax.kernels.context`, 'ring' in :mod:`goat_jax.kernels.ring`), so a new
strategy (an all-to-all one, say) is one new module, and the plan's ``context_strategy``
(:class:`goat_jax.plan.AttentionPlan`) and the config's choices are read off this table.

Every strategy has one signature: ``attend(q, k, v, *, mask, bias, mesh, plan, implementation,
scale) -> [B, T, N, Hv]``, called by :func:`goat_jax.kernels.attend` when ``mesh``'s context
axis has more than one device, after the capability table has accepted ``implementation`` for
the call; ``plan`` says the axis and whether the sequences are in load-balanced order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One context strategy: its name (``config.context_strategy``), the function that runs it
    (the signature of the module doc) and one line for the docs and the config's help."""

    name: str
    attend: Callable[..., Any] = dataclasses.field(compare=False, repr=False)
    summary: str = ""
    # the capability feature a kernel must take to run under it (goat_jax.kernels.capabilities.FEATURES)
    needs: Optional[str] = None


STRATEGIES: Dict[str, Strategy] = {}
NAMES: Tuple[str, ...] = ()


def register(strategy: Strategy) -> Strategy:
    """Adds ``strategy`` to :data:`STRATEGIES` and returns it (ValueError for a name taken)."""
    global NAMES  # pylint: disable=global-statement
    if strategy.name in STRATEGIES:
        raise ValueError(f"context_strategy={strategy.name!r} is registered already.")
    STRATEGIES[strategy.name] = strategy
    NAMES = tuple(STRATEGIES)
    return strategy


def get(name: str) -> Strategy:
    """The strategy called ``name``; ValueError naming the choices otherwise."""
    if name not in STRATEGIES:
        raise ValueError(f"context_strategy={name!r} is not a strategy; choose one of {NAMES}.")
    return STRATEGIES[name]


def names() -> Tuple[str, ...]:
    """The registered strategies' names, in registration order (read when called: a plugin's too)."""
    return NAMES


