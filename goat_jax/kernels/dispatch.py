"""The front door of the kernel layer: :func:`attend` checks the inputs, builds the one
:class:`goat_jax.kernels.mask.AttentionMask` of the call, reads the mesh once, checks the chosen
kernel against its capability row, and runs it on one device's arrays (:func:`attend_local`)
or under context parallelism (:mod:`goat_jax.kernels.context`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import jax
import jax.numpy as jnp

from goat_jax.kernels import capabilities as caps
from goat_jax.kernels import context as context_lib
from goat_jax.kernels import cudnn, dense, flash, splash, xla
from goat_jax.kernels import mesh as mesh_lib
from goat_jax.kernels import ring
from goat_jax.kernels.balance import is_balanced
from goat_jax.kernels import choice
from goat_jax.kernels.mask import AttentionMask, ambient_window

Array = jax.Array

# Each kernel: fn(q, k, v, *, scale, mask, bias, mesh) -> [B, T, N, Hv] (its row in CAPABILITIES).
KERNELS: Dict[str, Callable[..., Array]] = {
    "xla": xla.attention,
    "flash": flash.attention,
    "cudnn": cudnn.attention,
    "splash": splash.attention,
    "splash_interpret": lambda *a, **kw: splash.attention(*a, **kw, interpret=True),
    "dense": dense.attention,
}


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


def _zero_empty_rows(out: Array, visible: Optional[Array]) -> Array:
    """Zeros the rows of ``out`` [B, T, N, H] without a visible key (a select: zero cotangent)."""
    if visible is None:
        return out
    return jnp.where(visible[:, :, None, None], out, jnp.zeros((), out.dtype))


def attend_local(q: Array, k: Array, v: Array, mask: AttentionMask, bias: Optional[Array], *,
                 implementation: str, scale: float, mesh: Any = None) -> Array:
    """Kernel ``implementation`` on q/k/v under ``mask``, with the rows that see no key zeroed
    (every kernel agrees there: module doc of :mod:`goat_jax.kernels`). ``mesh``: where a kernel
    that XLA cannot partition (splash) splits its work; None inside a shard_map."""
    out = KERNELS[implementation](q, k, v, scale=scale, mask=mask, bias=bias, mesh=mesh)
    return _zero_empty_rows(out, mask.rows_with_keys(q.shape[1], k.shape[1]))


def attend(
    q: Array,
    k: Array,
    v: Array,
    *,
    implementation: str,
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
) -> Any:
    """``softmax(scale * q . k [+ bias] + mask) v`` on the chosen kernel.

    Args:
      q: [B, T, N, Hqk]; k: [B, S, K, Hqk]; v: [B, S, K, Hv].
      implementation: a resolved name (see :func:`goat_jax.kernels.resolve_implementation`);
        checked here against its capability row for this call (platform, dtype, head dim, mask
        features), so what it cannot do is refused with the reason, never computed wrong.
      mask: the call's :class:`goat_jax.kernels.AttentionMask`; or the keyword form below
        (``is_causal``, ``causal_offset``, ``key_padding_mask`` [B, S] True = ignored,
        ``kv_lengths`` [B], ``segment_ids`` [B, T] for self-attention or ``q_segment_ids`` [B, T]
        with ``kv_segment_ids`` [B, S]), from which the mask is built, not both. A
        :func:`goat_jax.kernels.local_window` in context adds its window.
      bias: optional additive [B or 1, N or 1, T, S] float bias ('xla' and 'dense' only: the
        materialized baselines, ALiBi-as-bias, the naive L x L prior). Flash kernels get none.
      return_probs: also return the attention probabilities (only 'dense' materializes them;
        evaluations read them through the modules' sown 'intermediates').
      mesh: the mesh the call runs on (default: the mesh in context, read here once): its
        ``context`` axis splits the sequence (:mod:`goat_jax.kernels.context`), and splash runs
        under ``jax.shard_map`` on it.
    Returns:
      [B, T, N, Hv] in v's dtype; zeros for query rows without a visible key. With
      ``return_probs``: ``(out, probs)``, probs [B, N, T, S] float32 (zero rows likewise).
    """
    _check_inputs(q, k, v)
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
    if mask.window is None and ambient_window() is not None:
        mask = mask.replace(window=ambient_window())
    mask = mask.bounded(t, s)  # an offset near 2**31 would wrap in int32 (AttentionMask.bounded)
    mesh = mesh_lib.ambient_mesh() if mesh is None else mesh
    mesh_lib.check_axis_types(mesh)
    caps.check_name(implementation)
    shards = mesh_lib.context_shards(mesh)
    ring_on = choice.ring_active(mesh)
    request = choice.request(q.dtype, q.shape[-1], like=(q,), mesh=mesh, segment_ids=mask.segments is not None,
                             ragged_segments=mask.ragged_segments, bias=bias is not None,
                             traced_offset=not mask.static_offset, window=mask.window is not None,
                             return_probs=return_probs, ring=ring_on)
    refusal = caps.refusal(implementation, request)
    if refusal is not None:
        raise ValueError(refusal)
    if shards > 1:  # the sequence is split over the mesh's context axis
        if return_probs:
            raise ValueError(
                f"return_probs materializes the T x S probabilities, which mesh.context={shards} does "
                "not shard; read them with mesh.context=1.")
        if ring_on:
            return ring.attend(q, k, v, mask=mask, bias=bias, mesh=mesh, balanced=is_balanced(),
                               implementation=implementation, scale=scale)

        def local(q_, k_, v_, mask_, bias_):
            return attend_local(q_, k_, v_, mask_, bias_, implementation=implementation, scale=scale)

        return context_lib.attend(q, k, v, mask=mask, bias=bias, mesh=mesh, balanced=is_balanced(),
                                  implementation=implementation, local=local)
    if return_probs:
        out, probs = dense.attention(q, k, v, scale=scale, mask=mask, bias=bias, return_probs=True)
        visible = mask.rows_with_keys(t, s)
        if visible is not None:
            probs = jnp.where(visible[:, None, :, None], probs, 0.0)
        return _zero_empty_rows(out, visible), probs
    return attend_local(q, k, v, mask, bias, implementation=implementation, scale=scale, mesh=mesh)
