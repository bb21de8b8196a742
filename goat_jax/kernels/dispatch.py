"""The front door of the kernel layer: :func:`attend` checks the inputs, builds the one
:class:`goat_jax.kernels.mask.AttentionMask` of the call (with the plan's window), chooses the
kernel once from it (or takes a layer's :class:`goat_jax.kernels.choice.Choice`, made from the
same mask), reading the mesh once, and runs it on one device's arrays
(:func:`goat_jax.kernels.local.attend_local`) or under the plan's context strategy
(:mod:`goat_jax.kernels.strategies`).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from goat_jax.kernels import capabilities as caps
from goat_jax.kernels import choice as choice_lib
from goat_jax.kernels import strategies
from goat_jax.kernels import mesh as mesh_lib
from goat_jax.kernels.local import attend_local, zero_empty_rows
from goat_jax.kernels.mask import AttentionMask
from goat_jax.kernels.plan import DEFAULT, AttentionPlan

Array = jax.Array


def _check_inputs(q: Array, k: Array, v: Array) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v must be [B, T, N, H], [B, S, K, H], [B, S, K, Hv]; got {q.shape}, {k.shape}, {v.shape}.")
    b, _, n, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"Incompatible q {q.shape}, k {k.shape}, v {v.shape}.")
    if n % k.shape[2]:
        raise ValueError(
            f"{n} query heads are not a multiple of {k.shape[2]} key/value heads; choose "
            "kv_num_heads among the divisors of num_heads.")


def attend(
    q: Array,
    k: Array,
    v: Array,
    *,
    implementation: Optional[str] = None,
    scale: float = 1.0,
    mask: Optional[AttentionMask] = None,
    bias: Optional[Array] = None,
    return_probs: bool = False,
    mesh: Any = None,
    is_causal: bool = False,
    causal_offset: Any = 0,
    key_padding_mask: Optional[Array] = None,
    kv_lengths: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    q_segment_ids: Optional[Array] = None,
    kv_segment_ids: Optional[Array] = None,
    plan: Optional[AttentionPlan] = None,
    choice: Optional[choice_lib.Choice] = None,
) -> Any:
    """``softmax(scale * q . k [+ bias] + mask) v`` on the chosen kernel.

    Args:
      q: [B, T, N, Hqk]; k: [B, S, K, Hqk]; v: [B, S, K, Hv].
      implementation: a kernel name (:data:`goat_jax.kernels.IMPLEMENTATIONS`); default the
        plan's; checked here against its capability row for this call (platform, dtype, head dim,
        mask features), so what it cannot do is refused with the reason, never computed wrong.
        None with a plan that leaves the kernel automatic: chosen here for this call.
      mask: the call's :class:`goat_jax.kernels.AttentionMask`; or the keyword form below
        (``is_causal``, ``causal_offset``, ``key_padding_mask`` [B, S] True = ignored,
        ``kv_lengths`` [B], ``segment_ids`` [B, T] for self-attention or ``q_segment_ids`` [B, T]
        with ``kv_segment_ids`` [B, S]), from which the mask is built, not both. The plan's
        window and ``max_documents_per_row`` fill the mask's where it has none.
      bias: optional additive [B or 1, N or 1, T, S] float bias (the kernels whose row takes
        ``bias``, 'xla' and 'dense': the materialized baselines, ALiBi-as-bias, the naive L x L
        prior). Flash kernels get none.
      return_probs: also return the attention probabilities (the kernels whose row takes
        ``return_probs``: 'dense' materializes them; evaluations read them through the modules'
        sown 'intermediates').
      mesh: the mesh the call runs on (default: the mesh in context, read here once): its
        context axis splits the sequence (the plan's strategy, :mod:`goat_jax.kernels.strategies`),
        and splash runs under ``jax.shard_map`` on it.
      plan: the :class:`goat_jax.kernels.plan.AttentionPlan` of the call (context strategy, balancing,
        axis, window, documents bound); default: the default plan.
      choice: the call's kernel as a layer chose it once from the same mask
        (:func:`goat_jax.kernels.choice.choose`): used as it is (its name, its mesh), not
        checked again; give it instead of ``implementation`` and ``mesh``.
    Returns:
      [B, T, N, Hv] in v's dtype; zeros for query rows without a visible key. With
      ``return_probs``: ``(out, probs)``, probs [B, N, T, S] float32 (zero rows likewise).
    """
    _check_inputs(q, k, v)
    plan = DEFAULT if plan is None else plan
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    keywords = dict(is_causal=is_causal, causal_offset=causal_offset, key_padding_mask=key_padding_mask,
                    kv_lengths=kv_lengths, segment_ids=segment_ids, q_segment_ids=q_segment_ids,
                    kv_segment_ids=kv_segment_ids)
    if mask is None:
        mask = AttentionMask.build(b, t, s, **keywords)
    else:
        given = [name for name, value in keywords.items()
                 if value is not None and value is not False and not (name == "causal_offset" and value == 0)]
        if given:
            raise ValueError(f"Pass either mask= or the keyword form of the mask, not both (got mask and {given}).")
        mask.check(b, t, s)
    if mask.window is None and plan.window is not None:
        mask = mask.replace(window=plan.window)
    mask = mask.bounded(t, s)  # an offset near 2**31 would wrap in int32 (AttentionMask.bounded)
    if choice is None:  # the one choice of this call, from its mask
        choice = choice_lib.choose(plan.implementation if implementation is None else implementation, q.dtype,
                                   q.shape[-1], (b, q.shape[2], t, s), like=(q,), mesh=mesh, plan=plan,
                                   bias=bias is not None, return_probs=return_probs, **mask.features())
    elif implementation is not None or mesh is not None:
        raise ValueError("Pass choice= (a layer's choice, with its mesh) or implementation= and mesh=, not both.")
    implementation, mesh = choice.implementation, choice.mesh
    mesh_lib.check_axis_types(mesh)
    shards = mesh_lib.context_shards(mesh, plan.context_axis)
    if shards > 1:  # the sequence is split over the mesh's context axis, by the plan's strategy
        if return_probs:
            raise ValueError(
                f"return_probs materializes the T x S probabilities, which mesh.context={shards} does "
                "not shard; read them with mesh.context=1.")
        return strategies.get(plan.context_strategy).attend(q, k, v, mask=mask, bias=bias, mesh=mesh, plan=plan,
                                                            implementation=implementation, scale=scale)
    if return_probs:  # the choice took a kernel whose row takes return_probs
        out, probs = caps.CAPABILITIES[implementation].attention(q, k, v, scale=scale, mask=mask, bias=bias,
                                                                 mesh=mesh, return_probs=True)
        visible = mask.rows_with_keys(t, s)
        if visible is not None:
            probs = jnp.where(visible[:, None, :, None], probs, 0.0)
        return zero_empty_rows(out, visible), probs
    return attend_local(q, k, v, mask, bias, implementation=implementation, scale=scale, mesh=mesh, plan=plan)
