"""How attention runs, as one value: :class:`AttentionPlan` (the kernel, how attention crosses
the ``context`` mesh axis, whether the sequences arrive in load-balanced order, the bound of
cuDNN's packed layout, a sliding window).

A run builds its plan once from its config (:meth:`AttentionPlan.from_config`: the model's
``implementation`` and ``max_documents_per_row``, the run's ``context_strategy`` and
``context_load_balance``), the task hands it to the model, the model to every attention layer,
and the layer to :func:`goat_jax.kernels.attend` with each call, the way ``PriorSettings``
travels: each entry point (training, evaluation, the compile tool) builds the plan once and hands
the same value to the task's model (``task.build_model(config, plan)``) and to the engine, so
they run under the same plan and nothing is entered around a step. The models hold no copy of
its fields. A layer built by hand takes a plan (``plan=``) or, as a shorthand for a plan of those
fields alone, ``implementation=`` / ``max_documents_per_row=`` (never both). Each default is
stated here, once.

At import this module imports nothing of goat_jax (the kernels import it while their table is
built; :func:`config_fields` and :meth:`AttentionPlan.document_bound` read the table when called);
the names a plan holds (a kernel, a strategy) are checked against the kernels' own tables where
they are used (:mod:`goat_jax.kernels`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """How every attention call of a model (or one layer) runs.

    Attributes:
      implementation: the kernel (a name of :data:`goat_jax.kernels.IMPLEMENTATIONS`), or None:
        the automatic choice per call (:func:`goat_jax.kernels.resolve_implementation`).
      context_strategy: with a ``context`` mesh axis of more than one device, how attention
        crosses the shards (a name of :data:`goat_jax.kernels.strategies.STRATEGIES`): 'all_gather'
        (every device gathers all keys), 'ring' (keys pass around the ring) or 'ulysses' (an
        all-to-all trades sequence shards for whole sequences of 1 / c of the heads).
      load_balanced: the sequences arrive in the load-balanced order of
        :func:`goat_jax.kernels.balance.balance_order` when the context axis splits them (the
        engine reorders each batch once, :func:`goat_jax.kernels.balance.balanced_step`).
      context_axis: the mesh axis a sequence is split over.
      max_documents_per_row: the most documents (runs of equal segment ids, padding counting as
        one) a row may hold: the static size of cuDNN's packed layout (segment ids on Hopper GPUs,
        goat_jax/kernels/cudnn_packed.py); other kernels ignore it.
      window: None, or a sliding window: each query sees only the ``window`` keys ending at its
        own position (an evaluation's "last L keys"; on the kernels whose row takes a window).
    """

    implementation: Optional[str] = None
    context_strategy: str = "all_gather"
    load_balanced: bool = False
    context_axis: str = "context"
    max_documents_per_row: int = 64
    window: Optional[int] = None

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raises ValueError naming the field when a value cannot be a plan's (names of kernels
        and strategies are checked against their tables where they run)."""
        for name in ("implementation", "context_strategy", "context_axis"):
            value = getattr(self, name)
            if not (isinstance(value, str) or (value is None and name == "implementation")):
                raise ValueError(f"AttentionPlan.{name} must be a name (str), got {value!r}.")
        if not isinstance(self.load_balanced, (bool, np.bool_)):
            raise ValueError(f"AttentionPlan.load_balanced must be True or False, got {self.load_balanced!r}.")
        bound = self.max_documents_per_row
        if not isinstance(bound, (int, np.integer)) or isinstance(bound, bool) or bound < 1:
            raise ValueError(f"max_documents_per_row must be a positive integer, got {bound!r}.")
        window = self.window
        if window is not None and (not isinstance(window, (int, np.integer)) or isinstance(window, bool)
                                   or window < 1):
            raise ValueError(f"AttentionPlan.window must be a positive integer or None, got {window!r}.")

    def replace(self, **changes: Any) -> "AttentionPlan":
        """A copy with ``changes`` (checked)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_config(cls, config: Any) -> "AttentionPlan":
        """The plan of a run's ``config`` (an ``ml_collections`` config or a dict): the model's
        ``implementation`` and ``max_documents_per_row`` and the run's ``context_strategy`` and
        ``context_load_balance``, each field's default where the config leaves it out or None."""
        model = _get(config, "model") or {}
        given = {"implementation": _get(model, "implementation"),
                 "max_documents_per_row": _get(model, "max_documents_per_row"),
                 "context_strategy": _get(config, "context_strategy"),
                 "load_balanced": _get(config, "context_load_balance")}
        return cls(**{name: value for name, value in given.items() if value is not None})

    def may_use(self, implementation: str) -> bool:
        """Whether calls under this plan may run kernel ``implementation``: it is the plan's, or
        the plan leaves the kernel to the automatic choice."""
        return self.implementation in (None, implementation)

    def document_bound(self) -> Optional[int]:
        """The most documents a packed row may hold under this plan, for the data packers to check
        on the host (``max_documents_per_row``), when a kernel whose layout bounds them (its row's
        ``bounds_documents``: cuDNN's packed layout) may run it (its ``implementation`` is that
        kernel or automatic); None when no kernel of the plan bounds it."""
        # Imported here: the kernels read this module's DEFAULT while the package is imported.
        from goat_jax.kernels import capabilities  # pylint: disable=g-import-not-at-top
        return self.max_documents_per_row if capabilities.bounds_documents(self.implementation) else None


# The plan's fields that a config spells in its ``model`` section (``model.implementation``,
# ``model.max_documents_per_row``); the models hold no copy of them.
MODEL_SECTION_FIELDS = ("implementation", "max_documents_per_row")


@functools.lru_cache(maxsize=None)
def config_fields() -> Any:
    """The declarations (default, type, range, doc) of :data:`MODEL_SECTION_FIELDS`, as a
    :class:`goat_jax.config.fields.Section`: every task's ``model`` section takes them
    (:class:`goat_jax.train.tasks.TaskFields`), :meth:`AttentionPlan.from_config` reads them."""
    # Imported here: the kernels import this module while their table is being built.
    from goat_jax.config.fields import Int, Section, Str  # pylint: disable=g-import-not-at-top
    from goat_jax.kernels.capabilities import implementations  # pylint: disable=g-import-not-at-top
    return Section(
        implementation=(DEFAULT.implementation, Str(
            choices=implementations(), optional=True, doc="attention kernel; None: auto")),
        max_documents_per_row=(DEFAULT.max_documents_per_row, Int(
            min=1, doc="packed documents per row (padding counts as one) that cuDNN's packed layout is sized "
                       "for (GPUs; memory grows with it; a row with more is refused on the host: docs/packing.md)")))


def plan_fields_hint(names: Any) -> str:
    """What to say when a model's config is given fields of the plan (``names``: the unknown
    ones): '' when none of them is the plan's, else where they go now."""
    moved = [name for name in names if name in MODEL_SECTION_FIELDS]
    if not moved:
        return ""
    spelled = ", ".join(f"{name}=..." for name in moved)
    return (f" {moved} are the attention plan's, not the model's: build the model with "
            f"plan=goat_jax.kernels.plan.AttentionPlan({spelled}) (a config keeps them as model.<field>, which "
            "AttentionPlan.from_config reads).")


def _get(config: Any, name: str) -> Any:
    getter = getattr(config, "get", None)
    return getter(name) if getter is not None else getattr(config, name, None)


DEFAULT = AttentionPlan()  # every default of the plan, for the config declarations that expose one
