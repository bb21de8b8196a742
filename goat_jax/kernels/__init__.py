"""Attention kernels behind one switch: ``implementation=`` 'xla' | 'flash' | 'cudnn' |
'splash' | 'splash_interpret' | 'dense' | None (automatic).

Every kernel computes plain ``softmax(q . k * scale + mask) v`` with *no additive bias* (only
'xla' and 'dense' take one, for the materialized baselines): GOAT's prior is packed into extra
q/k channels (:mod:`goat_jax.prior.packing`), so an unmodified flash kernel runs it exactly.
Shape legend: B batch, T queries, S keys, N query heads, K kv heads (N % K == 0, grouped-query
attention), Hqk q/k head dim, Hv value head dim.

One concern a module:

* :mod:`~goat_jax.kernels.mask`: :class:`AttentionMask`, the one mask value of a call (causal
  with its offset, key padding, kv lengths, segment ids, a sliding window) and its conversions;
  the masking contract every kernel honours is its module docstring.
* :mod:`~goat_jax.kernels.capabilities`: the table of kernel rows (platforms, dtypes, head dims,
  length padding, masking features and why each missing one is missing, where the automatic
  choice prefers it, the function that runs it, its ring blocks, its fast widths), read by the
  automatic choice, by every refusal, by :func:`attend`, by the strategies and by
  docs/layer.md's table. Each kernel module declares its own row (``ROW``); whatever a reader
  needs to know of a kernel it asks the row (e.g. :func:`returns_probs`), never its name.
* :mod:`~goat_jax.kernels.registry`: the one literal table of the built-in rows and strategies
  (name -> row), imported here explicitly.
* :mod:`~goat_jax.kernels.choice`: the target platform, :func:`resolve_implementation` /
  :func:`~goat_jax.kernels.choice.choose` (the one choice of a call, logged once with its reason)
  and :func:`record_choices`.
* :mod:`~goat_jax.kernels.dispatch`: :func:`attend`, the front door, under a
  :class:`goat_jax.kernels.plan.AttentionPlan`; :mod:`~goat_jax.kernels.local`: one kernel on one
  device's arrays.
* the kernels, one module each with its row: :mod:`~goat_jax.kernels.xla`,
  :mod:`~goat_jax.kernels.flash` (pure-JAX online softmax with a recomputing custom VJP, memory
  linear in T and S), :mod:`~goat_jax.kernels.cudnn`, :mod:`~goat_jax.kernels.splash` (Pallas TPU;
  interpret mode on CPU), :mod:`~goat_jax.kernels.dense` (the materialized float32 reference);
  exact padding for them in :mod:`~goat_jax.kernels.padding`.
* context parallelism: the strategies' table :mod:`~goat_jax.kernels.strategies`, one module
  each: :mod:`~goat_jax.kernels.all_gather` ('all_gather': keys all-gathered over the context mesh
  axis), :mod:`~goat_jax.kernels.ring` ('ring') and :mod:`~goat_jax.kernels.ulysses` ('ulysses':
  all-to-all over heads); :mod:`~goat_jax.kernels.balance`
  (load-balanced order), :mod:`~goat_jax.kernels.mesh` (the mesh, read once per call and passed
  down; how a shard_map splits batch and heads, its partition specs written once).

Importing this package imports the registry, which lists every built-in kernel and strategy: a
new one is a new module here and one line of the registry; a plugin's registers itself with one
call when the plugin is imported (:func:`goat_jax.kernels.capabilities.register`,
:func:`goat_jax.kernels.strategies.register`). :data:`IMPLEMENTATIONS` (:func:`implementations`)
is read when asked, so it holds the plugins' names too.

A query row with no visible key (every key padded, before the first key under causal masking
with a negative offset, or no key of its segment) outputs **zeros on every kernel**, and no
gradient flows through it: the kernels themselves disagree there (NaN from a dense softmax over
``-inf`` logits, a uniform average of the values from XLA and splash), so :func:`attend` selects
zeros for such rows after the kernel (:meth:`AttentionMask.rows_with_keys`).
"""

from typing import Any as _Any

from goat_jax.kernels import registry  # the literal table: every built-in kernel and strategy row
from goat_jax.kernels.capabilities import (CAPABILITIES, Capability, Request, implementations, refusal,
                                           returns_probs)
from goat_jax.kernels.choice import (FLASH_THRESHOLD_BYTES, Choice, choose, log_once, record_choices,
                                     resolve_implementation, target_platform)
from goat_jax.kernels.dispatch import attend
from goat_jax.kernels.local import attend_local
from goat_jax.kernels.mask import AttentionMask, check_segment_ids
from goat_jax.kernels.padding import pad_head_dims, pad_lengths


def __getattr__(name: str) -> _Any:
    """``IMPLEMENTATIONS``: the kernel names (:func:`implementations`), read when asked, so a
    plugin registered after this package was imported is in it."""
    if name == "IMPLEMENTATIONS":
        return implementations()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CAPABILITIES", "IMPLEMENTATIONS", "Capability", "Request", "implementations", "refusal", "returns_probs",
           "FLASH_THRESHOLD_BYTES", "Choice", "choose", "log_once", "record_choices", "resolve_implementation",
           "target_platform", "attend", "attend_local", "AttentionMask", "check_segment_ids", "pad_head_dims",
           "pad_lengths", "registry"]
