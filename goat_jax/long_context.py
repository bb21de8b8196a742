"""The engine's side of context parallelism (docs/training.md, Long context): the checks of a
run's ``mesh.context`` and ``context_load_balance`` before any work, and the load-balanced step
wrapper. The attention itself is :mod:`goat_jax.kernels.context`; the sequence order
:mod:`goat_jax.kernels.balance`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from goat_jax.kernels import capabilities as caps
from goat_jax.kernels.balance import (BALANCE_FIELD, STRATEGY_FIELD, balanced_step, check_length,
                                      context_strategy)
from goat_jax.kernels.mesh import CONTEXT_AXIS
from goat_jax.positional import ENCODINGS

BIAS_ENCODINGS = frozenset(e.name for e in ENCODINGS if e.materialized_bias)  # xla/dense only


def context_step(step: Callable[..., Any], config: Any, mesh: Any, balanced: bool, strategy: str) -> Callable[..., Any]:
    """``step`` (a train or eval step) as the run's context settings ask (``balanced``,
    ``strategy``: its ``context_load_balance`` and ``context_strategy``), when ``mesh`` has a
    ``context`` axis of more than one device: traced under the strategy
    (:func:`goat_jax.kernels.balance.context_strategy`) and, balanced, on the batch in
    load-balanced order (:func:`goat_jax.kernels.balance.balanced_step`); else ``step`` itself."""
    num_shards = dict(mesh.shape).get(CONTEXT_AXIS, 1)
    if num_shards <= 1:
        return step
    if balanced:
        step = balanced_step(step, int(config.seq_len), num_shards)

    @functools.wraps(step)
    def with_strategy(*args, **kwargs):
        with context_strategy(strategy):
            return step(*args, **kwargs)
    return with_strategy


def check_config(config: Any, num_shards: int, task_name: str, platform: Optional[str] = None,
                 balanced: bool = False, strategy: str = "all_gather") -> None:
    """The checks of ``mesh.context`` (resolved to ``num_shards``) and ``context_load_balance``
    of a run's config, before any work: an explicit kernel that cannot run on the run's
    ``platform`` at all (said first: it is the decisive reason, whatever the lengths), a task
    with a ``seq_len``, which the shards (and their chunks, and splash's blocks) divide, and no
    encoding that cannot run reordered, and with ``strategy='ring'`` a kernel and an encoding that
    can run in a ring (``balanced``, ``strategy``: the run's ``context_load_balance`` and
    ``context_strategy``). Raises ValueError naming the field and the fix."""
    model = config.get("model") or {}
    implementation = model.get("implementation")
    if platform is not None and implementation in caps.CAPABILITIES:
        row = caps.CAPABILITIES[implementation]
        if platform not in row.platforms:
            raise ValueError(f"model.implementation={implementation!r}: " + caps.platform_refusal(
                row, caps.Request(platform, "the devices this run uses", "float32", 0)))
    if num_shards <= 1:
        return  # one shard: nothing is split, and the balanced order is the identity
    if "seq_len" not in config:
        raise ValueError(
            f"mesh.context={num_shards} splits each sequence over devices, but the {task_name!r} task "
            "has no seq_len (sequences of its own length, e.g. a ViT's patches); use mesh.context=1.")
    if strategy == "ring":
        row = caps.CAPABILITIES.get(implementation)
        if row is not None and not row.takes("ring"):
            raise ValueError(f"{STRATEGY_FIELD}='ring' with model.implementation={implementation!r}: "
                             f"{row.why_not['ring']}.")
        if model.get("position_encoding") in BIAS_ENCODINGS:
            raise ValueError(
                f"{STRATEGY_FIELD}='ring' with model.position_encoding={model.get('position_encoding')!r}: "
                "the encoding adds a materialized [N, T, S] bias, which would travel around the ring whole. "
                f"Use {STRATEGY_FIELD}='all_gather', or an encoding packed into q/k ('alibi_packed', 'goat', "
                "'rope').")
    check_length(int(config.seq_len), num_shards, balanced, implementation, field="seq_len")
    if balanced and model.get("position_encoding") == "fox":
        raise ValueError(
            f"{BALANCE_FIELD}=True reorders each sequence, but FoX's forget gates are a cumulative "
            f"sum along the sequence order (goat_jax/positional/fox.py). Set {BALANCE_FIELD}=False "
            "(FoX runs under mesh.context > 1 unbalanced).")
