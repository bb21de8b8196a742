"""The engine's side of context parallelism (docs/training.md, Long context): the checks of a
run's ``mesh.context`` and ``context_load_balance`` before any work, and the load-balanced step
wrapper. The attention itself is :mod:`goat_jax.kernels.context`; the sequence order
:mod:`goat_jax.kernels.balance`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from goat_jax.kernels import capabilities as caps
from goat_jax.kernels.balance import BALANCE_FIELD, balanced_step, check_length
from goat_jax.kernels.mesh import CONTEXT_AXIS
from goat_jax.train import validation


def balanced_if_asked(step: Callable[..., Any], config: Any, mesh: Any) -> Callable[..., Any]:
    """:func:`goat_jax.kernels.balance.balanced_step` of ``step`` when the run's ``config`` asks
    for load balancing and ``mesh`` has a ``context`` axis of more than one device; else ``step``."""
    num_shards = dict(mesh.shape).get(CONTEXT_AXIS, 1)
    if num_shards <= 1 or not bool(validation.ENGINE[""].value(config, BALANCE_FIELD)):
        return step
    return balanced_step(step, int(config.seq_len), num_shards)


def check_config(config: Any, num_shards: int, task_name: str, platform: Optional[str] = None) -> None:
    """The checks of ``mesh.context`` (resolved to ``num_shards``) and ``context_load_balance``
    of a run's config, before any work: an explicit kernel that cannot run on the run's
    ``platform`` at all (said first: it is the decisive reason, whatever the lengths), a task
    with a ``seq_len``, which the shards (and their chunks, and splash's blocks) divide, and no
    encoding that cannot run reordered. Raises ValueError naming the field and the fix."""
    model = config.get("model") or {}
    implementation = model.get("implementation")
    if platform is not None and implementation in caps.CAPABILITIES:
        row = caps.CAPABILITIES[implementation]
        if platform not in row.platforms:
            raise ValueError(f"model.implementation={implementation!r}: " + caps.platform_refusal(
                row, caps.Request(platform, "the devices this run uses", "float32", 0)))
    if num_shards <= 1:
        return  # one shard: nothing is split, and the balanced order is the identity
    balanced = bool(validation.ENGINE[""].value(config, BALANCE_FIELD))
    if "seq_len" not in config:
        raise ValueError(
            f"mesh.context={num_shards} splits each sequence over devices, but the {task_name!r} task "
            "has no seq_len (sequences of its own length, e.g. a ViT's patches); use mesh.context=1.")
    check_length(int(config.seq_len), num_shards, balanced, implementation, field="seq_len")
    if balanced and model.get("position_encoding") == "fox":
        raise ValueError(
            f"{BALANCE_FIELD}=True reorders each sequence, but FoX's forget gates are a cumulative "
            f"sum along the sequence order (goat_jax/positional/fox.py). Set {BALANCE_FIELD}=False "
            "(FoX runs under mesh.context > 1 unbalanced).")
