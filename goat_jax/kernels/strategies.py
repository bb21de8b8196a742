"""How attention crosses the ``context`` mesh axis: one row per context strategy
(:data:`STRATEGIES`), each declared by its own module (``STRATEGY = Strategy(...)``: 'all_gather'
in :mod:`goat_jax.kernels.all_gather`, 'ring' in :mod:`goat_jax.kernels.ring`, 'ulysses' in
:mod:`goat_jax.kernels.ulysses`) and listed in the literal table
:data:`goat_jax.kernels.registry.STRATEGIES` (a plugin registers its own with :func:`register`),
so a new strategy (the all-to-all one was) is one new module, and the plan's
``context_strategy`` (:class:`goat_jax.kernels.plan.AttentionPlan`) and the config's choices are read off
this table.

Every strategy has one signature: ``attend(q, k, v, *, mask, bias, mesh, plan, implementation,
scale) -> [B, T, N, Hv]``, called by :func:`goat_jax.kernels.attend` when ``mesh``'s context
axis has more than one device, after the capability table has accepted ``implementation`` for
the call; ``plan`` says the axis and whether the sequences are in load-balanced order.

A strategy states its own checks on its row: what it cannot take of a kernel (``kernel_gap``,
read by every refusal and the automatic choice), what it refuses of a run's config before any
work (``check_run``, called by :func:`check_config`), what the compile report and the choice's
log line say of it (``report``), and the situation a causal mask is in under it (``detour``).
:func:`check_config` holds the checks every strategy shares (the engine's config check calls it,
goat_jax/train/trainer.py, passing the registered encodings that add a bias: this floor imports
no encoding).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

from goat_jax.kernels import capabilities as caps
from goat_jax.kernels.balance import BALANCE_FIELD, check_length
from goat_jax.kernels.plan import DEFAULT, AttentionPlan


class Run(NamedTuple):
    """What a strategy checks of a run's config (:func:`check_config`): the explicit kernel
    (``model.implementation``, None: automatic) and its row, the position encoding and whether
    it adds a materialized ``[N, T, S]`` bias, the context shards and balancing, and the model's
    query and key/value heads (None when the model has none) with the ``mesh.tensor`` devices
    that may split them (``head_shards``)."""

    implementation: Optional[str]
    row: Optional[caps.Capability]
    position_encoding: Optional[str]
    bias: bool
    num_shards: int
    balanced: bool
    num_heads: Optional[int] = None
    kv_num_heads: Optional[int] = None
    head_shards: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    """One context strategy, built with keywords only: its name (``config.context_strategy``),
    the function that runs it (the signature of the module doc), one line for the docs and the
    config's help, and its own checks (module doc)."""

    name: str
    attend: Callable[..., Any] = dataclasses.field(compare=False, repr=False)
    summary: str = ""
    # fn(row, key_masks) -> (what it cannot take, why) or None: what the strategy needs of a kernel
    # beyond the call's own features (key_masks: segment ids, key padding or kv lengths travel with the keys)
    kernel_gap: Optional[Callable[[caps.Capability, bool], Optional[Tuple[str, str]]]] = dataclasses.field(
        default=None, compare=False, repr=False)
    # fn(run: Run) -> None, raising ValueError naming the field and the fix: its refusals of a config
    check_run: Optional[Callable[[Run], None]] = dataclasses.field(default=None, compare=False, repr=False)
    # fn(row) -> entries the compile report and the choice's log line add for it (e.g. ring_blocks)
    report: Optional[Callable[[caps.Capability], Dict[str, Any]]] = dataclasses.field(
        default=None, compare=False, repr=False)
    detour: Optional[str] = None  # the situation (capabilities.DETOURS) a causal mask is in under it
    # Each device's kernel attends whole sequences under the global mask (Ulysses): a kernel's packed
    # layout (cuDNN's documents bound, AttentionPlan.document_bound) applies as on one device.
    whole_sequences: bool = False
    # The row's kernel runs each device's queries (at their offset, with their ids) against other keys
    # (all-gather): segment ids reach it ragged (the capability feature), whatever the call's mask.
    ragged_segments: bool = False


# name -> strategy, in registration order: goat_jax/kernels/registry.py's literal table, filled
# when the package is imported, then the plugins' (register).
STRATEGIES: Dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Adds ``strategy`` to :data:`STRATEGIES` and returns it (ValueError for a name taken)."""
    if strategy.name in STRATEGIES:
        raise ValueError(f"context_strategy={strategy.name!r} is registered already.")
    STRATEGIES[strategy.name] = strategy
    return strategy


def names() -> Tuple[str, ...]:
    """The registered strategies' names, in registration order (read when called: a plugin's too)."""
    return tuple(STRATEGIES)


def __getattr__(name: str) -> Any:
    """``NAMES``: :func:`names`, read when asked (a plugin registered later is in it)."""
    if name == "NAMES":
        return names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get(name: str) -> Strategy:
    """The strategy called ``name``; ValueError naming the choices otherwise."""
    if name not in STRATEGIES:
        raise ValueError(f"context_strategy={name!r} is not a strategy; choose one of {names()}.")
    return STRATEGIES[name]


def check_config(config: Any, num_shards: int, task_name: str, platform: Optional[str] = None,
                 plan: AttentionPlan = DEFAULT, bias_encodings: frozenset = frozenset()) -> None:
    """The checks of ``mesh.context`` (resolved to ``num_shards``) and ``context_load_balance``
    of a run's config, before any work: an explicit kernel that cannot run on the run's
    ``platform`` at all (said first: it is the decisive reason, whatever the lengths), a task
    with a ``seq_len``, the strategy's own refusals (its ``check_run``: ring's kernel and bias),
    a ``seq_len`` the shards (and their chunks, and splash's blocks) divide, and no encoding that
    cannot run reordered (``plan``: the run's :class:`goat_jax.kernels.plan.AttentionPlan`, whose
    ``load_balanced`` and ``context_strategy`` are its ``context_load_balance`` and
    ``context_strategy``; ``bias_encodings``: the names of the position encodings that add a
    materialized bias, which the caller reads from the registry, since kernels import no
    encoding: docs/architecture.md). Raises ValueError naming the field and the fix."""
    balanced, strategy = plan.load_balanced, get(plan.context_strategy)
    model = config.get("model") or {}
    implementation = model.get("implementation")
    row = caps.CAPABILITIES.get(implementation) if implementation is not None else None
    if platform is not None and row is not None and platform not in row.platforms:
        raise ValueError(f"model.implementation={implementation!r}: " + caps.platform_refusal(
            row, caps.Request(platform, "the devices this run uses", "float32", 0)))
    if num_shards <= 1:
        return  # one shard: nothing is split, and the balanced order is the identity
    if "seq_len" not in config:
        raise ValueError(
            f"mesh.context={num_shards} splits each sequence over devices, but the {task_name!r} task "
            "has no seq_len (sequences of its own length, e.g. a ViT's patches); use mesh.context=1.")
    encoding = model.get("position_encoding")
    if strategy.check_run is not None:
        bias = encoding in bias_encodings
        heads = model.get("num_heads")
        tensor = (config.get("mesh") or {}).get("tensor") or 1
        strategy.check_run(Run(implementation, row, encoding, bias, num_shards, balanced, heads,
                               model.get("kv_num_heads") or heads, max(int(tensor), 1)))
    check_length(int(config.seq_len), num_shards, balanced, implementation, field="seq_len")
    if balanced and encoding == "fox":
        raise ValueError(
            f"{BALANCE_FIELD}=True reorders each sequence, but FoX's forget gates are a cumulative "
            f"sum along the sequence order (goat_jax/positional/fox.py). Set {BALANCE_FIELD}=False "
            "(FoX runs under mesh.context > 1 unbalanced).")

