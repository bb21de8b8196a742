"""The engine's side of context parallelism (docs/training.md, Long context): the checks of a
run's ``mesh.context``, ``context_strategy`` and ``context_load_balance`` (the run's
:class:`goat_jax.plan.AttentionPlan`) before any work, and the load-balanced step wrapper. The
attention itself is the plan's strategy (:mod:`goat_jax.kernels.strategies`), which the model
carries in its plan; the sequence order :mod:`goat_jax.kernels.balance`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from goat_jax.kernels import capabilities as caps
from goat_jax.kernels import strategies
from goat_jax.kernels.balance import BALANCE_FIELD, STRATEGY_FIELD, balanced_step, check_length
from goat_jax.plan import DEFAULT, AttentionPlan
from goat_jax.positional import ENCODINGS

BIAS_ENCODINGS = frozenset(e.name for e in ENCODINGS if e.materialized_bias)  # xla/dense only


def context_step(step: Callable[..., Any], config: Any, mesh: Any, plan: AttentionPlan) -> Callable[..., Any]:
    """``step`` (a train or eval step) on the batch in load-balanced order
    (:func:`goat_jax.kernels.balance.balanced_step`) when the run's ``plan`` is balanced and
    ``mesh``'s context axis has more than one device; else ``step`` itself. The model carries
    the same plan (its task builds it from the same config), so its attention expects that order."""
    num_shards = dict(mesh.shape).get(plan.context_axis, 1)
    if num_shards <= 1 or not plan.load_balanced:
        return step
    return balanced_step(step, int(config.seq_len), num_shards)


def check_config(config: Any, num_shards: int, task_name: str, platform: Optional[str] = None,
                 plan: AttentionPlan = DEFAULT) -> None:
    """The checks of ``mesh.context`` (resolved to ``num_shards``) and ``context_load_balance``
    of a run's config, before any work: an explicit kernel that cannot run on the run's
    ``platform`` at all (said first: it is the decisive reason, whatever the lengths), a task
    with a ``seq_len``, which the shards (and their chunks, and splash's blocks) divide, and no
    encoding that cannot run reordered, and with ``strategy='ring'`` a kernel and an encoding that
    can run in a ring (``plan``: the run's :class:`goat_jax.plan.AttentionPlan`, whose
    ``load_balanced`` and ``context_strategy`` are its ``context_load_balance`` and
    ``context_strategy``). Raises ValueError naming the field and the fix."""
    balanced, strategy = plan.load_balanced, plan.context_strategy
    needs = strategies.get(strategy).needs
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
    if needs is not None:
        row = caps.CAPABILITIES.get(implementation)
        if row is not None and not row.takes(needs):
            raise ValueError(f"{STRATEGY_FIELD}={strategy!r} with model.implementation={implementation!r}: "
                             f"{row.why_not[needs]}.")
    if strategy == "ring":
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
