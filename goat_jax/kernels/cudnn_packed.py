"""Packed documents on cuDNN's fused attention: segment ids through cuDNN's packed (THD-like)
layout, on Hopper or newer GPUs (H100, H200, B200), which the public
``jax.nn.dot_product_attention`` does not expose (it passes only per-example lengths).

jax 0.10.2 has the layout privately: ``jax._src.cudnn.fused_attention_stablehlo.
dot_product_attention(q, k, v, q_seqlen=, kv_seqlen=, q_offsets=, kv_offsets=, mask_type=)``,
with ``q_offsets`` / ``kv_offsets`` int32 [B, M + 1] (the start of each document in its row,
-1 after the last) and ``q_seqlen`` / ``kv_seqlen`` int32 [B, M] (each document's length, -1
unused), M a static maximum number of documents per row. :func:`packed_layout` computes them from
segment ids (documents are the runs of equal ids along a row, the trailing padding run counting
as one), and :func:`layout_visibility` is a pure-JAX model of what the layout means (which query
sees which key), so the conversion is tested on CPU although cuDNN cannot run there.

Choices, and why:

* **Grouped-query attention: K/V heads are repeated to the query heads** before the call. jax
  0.10.2 turns the offsets into element strides with the *query* head count and head dim
  (``_fix_seqlen_offsets``: ``kv_offsets * N * H``), which is wrong for K/V with fewer heads
  (fixed upstream later). With K/V repeated and all widths equal the stride is right in every
  jax version. Cost: K/V and their gradients G times larger inside the call (G = N / K), a
  transient of ``2 * (G - 1) * B * S * K * H`` elements per layer; the parameters, the KV
  cache and everything outside attention keep K heads.
* **GOAT's packed q/k wider than v: v is zero-padded to the q/k width.** cuDNN's "different
  head dims" path needs cuDNN >= 9.10 on Hopper and, in the packed layout, K and V share one
  offset tensor whose element stride jax computes from the query's width, so a narrower V
  would be read at the wrong places. Padding v costs ``(Hqk - Hv) / Hv`` more V memory (66 -> 72
  vs 64: 12.5% for GOAT's usual widths) inside the call only.
* **Causal within each document** is ``MaskType.PADDING_CAUSAL``: cuDNN aligns each query
  document with the key document of the same index, top-left, which is the global causal mask
  restricted to equal ids when queries and keys are the same sequence (self-attention, offset 0;
  the capability table sends anything else to another kernel).
* **Odd lengths**: jax's cuDNN training rule needs even lengths; an odd row gets one extra
  token whose id differs from its neighbour's (a one-token document of its own, so it is seen
  by no real query), dropped from the output.
* **A row with more documents than M** cannot be expressed: concrete ids (eager calls) raise
  naming ``max_documents_per_row``; under ``jit`` the rows of such an example are NaN (the
  training data path checks every packed row on the host before, naming the same field:
  :func:`goat_jax.data.packing.check_documents_per_row`). The saved softmax statistics are
  ``(B * M, N, T)`` float32, so M costs memory: keep it near the data's real maximum.
* **Documents are ids, not runs** (the mask's contract, goat_jax/kernels/mask.py): a row
  where an id forms several runs (``1 1 2 2 1 1``) cannot be laid out as one document per
  offset, so eager calls raise naming ``segment_ids`` and under ``jit`` the row is NaN
  (:meth:`AttentionMask.split_documents`), never the runs' answer that differs from every
  other kernel's.
* Under a mesh the call runs under ``jax.shard_map`` over the batch (and head) axes
  (:func:`goat_jax.kernels.mesh.partition`), each device on its own rows: jax's partitioning
  of the packed layout refuses sequence sharding, and the offsets are per row anyway.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from goat_jax.kernels import mesh as mesh_lib
from goat_jax.kernels.plan import DEFAULT
from goat_jax.prior.segments import run_starts
from goat_jax.kernels.mask import AttentionMask
from goat_jax.kernels.padding import pad_head_dims

Array = jax.Array

FIELD = "max_documents_per_row"  # the layer / model field that sets M


def documents_per_row(ids: Array) -> Array:
    """[B] int32: the number of documents (runs of equal ids) in each row."""
    return jnp.sum(run_starts(ids), axis=1).astype(jnp.int32)


def packed_layout(ids: Array, max_documents: int) -> Tuple[Array, Array]:
    """``(offsets [B, M + 1], lengths [B, M])`` int32 of the packed layout for segment ids
    ``ids`` [B, T] with ``M = max_documents``: each row's document starts in order, then -1;
    each document's length, then -1. A row of more than M documents keeps the first M starts, so
    the M-th document's length runs to the row's end: every later document is merged into it
    (attending across documents); the caller poisons such rows (NaN, module doc)."""
    b, t = ids.shape
    starts = run_starts(ids)
    offsets = jax.vmap(lambda row: jnp.nonzero(row, size=max_documents, fill_value=-1)[0])(starts)
    offsets = offsets.astype(jnp.int32)
    following = jnp.concatenate([offsets[:, 1:], jnp.full((b, 1), -1, jnp.int32)], axis=1)
    ends = jnp.where(following < 0, t, following)
    lengths = jnp.where(offsets >= 0, ends - offsets, -1).astype(jnp.int32)
    return jnp.concatenate([offsets, jnp.full((b, 1), -1, jnp.int32)], axis=1), lengths


def layout_visibility(q_offsets: Array, q_lengths: Array, kv_offsets: Array, kv_lengths: Array,
                      t: int, s: int, causal: bool) -> Array:
    """[B, T, S] bool: which query sees which key under the packed layout, as cuDNN defines
    it: query ``i`` sees key ``j`` iff for some document ``m`` of the row, ``i`` lies in query
    document ``m``, ``j`` in key document ``m``, and (causal) ``j - kv_start <= i - q_start``.
    A pure-JAX model for tests; quadratic."""
    i = jnp.arange(t)[None, :, None]  # [1, T, 1]
    j = jnp.arange(s)[None, :, None]  # [1, S, 1]
    q0, ql = q_offsets[:, None, :-1], q_lengths[:, None, :]  # [B, 1, M]
    k0, kl = kv_offsets[:, None, :-1], kv_lengths[:, None, :]
    in_q = (q0 >= 0) & (i >= q0) & (i < q0 + ql)  # [B, T, M]
    in_k = (k0 >= 0) & (j >= k0) & (j < k0 + kl)  # [B, S, M]
    seen = in_q[:, :, None, :] & in_k[:, None, :, :]  # [B, T, S, M]
    if causal:
        rel_q = (i - q0)[:, :, None, :]
        rel_k = (j - k0)[:, None, :, :]
        seen = seen & (rel_k <= rel_q)
    return jnp.any(seen, axis=-1)


def check_concrete(ids: Any, max_documents: int) -> None:
    """Raises ValueError naming ``max_documents_per_row`` when concrete ``ids`` hold a row of
    more documents than ``max_documents``; traced ids are checked at run time (NaN rows)."""
    if isinstance(ids, jax.core.Tracer):
        return
    counts = np.asarray(documents_per_row(jnp.asarray(ids)))
    if counts.size and int(counts.max()) > max_documents:
        raise ValueError(
            f"A row holds {int(counts.max())} documents (runs of equal segment ids, padding counting "
            f"as one), more than {FIELD}={max_documents}, the static bound of cuDNN's packed layout. "
            f"Raise {FIELD} (the layer's field; model.{FIELD} in the configs) or use implementation='flash'.")


def _odd_pad(q: Array, k: Array, v: Array, ids: Array) -> Tuple[Array, Array, Array, Array]:
    """One extra token when the length is odd (module doc), a document of its own."""
    t = q.shape[1]
    if t % 2 == 0:
        return q, k, v, ids
    pad = lambda x: jnp.pad(x, [(0, 0), (0, 1), (0, 0), (0, 0)])
    ids = jnp.concatenate([ids, ids[:, -1:] ^ 1], axis=1)  # differs from the last id: its own run
    return pad(q), pad(k), pad(v), ids


def check_split(split: Optional[Array]) -> None:
    """Raises ValueError naming ``segment_ids`` when concrete ``split`` ([B] bool,
    :meth:`AttentionMask.split_documents`) marks a row; traced rows are NaN at run time."""
    if split is None or isinstance(split, jax.core.Tracer):
        return
    rows = np.flatnonzero(np.asarray(split))
    if rows.size:
        raise ValueError(
            f"segment_ids row {int(rows[0])} has an id in several runs (a document split by another); "
            "cuDNN's packed layout takes each document as one run, while every kernel's document is all "
            "tokens of one id. Give each document one run of its own id, or use implementation='flash'.")


def _call(q: Array, k: Array, v: Array, ids: Array, split: Array, scale: float, causal: bool,
          max_documents: int) -> Array:
    """The packed cuDNN call on one device's rows: q [b, T, N, Hqk], k/v [b, T, K, H*]."""
    from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top

    t_real, hv = q.shape[1], v.shape[-1]
    g = q.shape[2] // k.shape[2]
    if g > 1:  # GQA/MQA: K/V repeated to the query heads (module doc)
        k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    q, k, v = pad_head_dims(q, k, v, 8)  # one width, a multiple of 8 (module doc)
    q, k, v, ids = _odd_pad(q, k, v, ids)
    extra = int(q.shape[1] != t_real)  # the odd-length token is one more document
    offsets, lengths = packed_layout(ids, max_documents + extra)
    mask_type = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    out = fa.dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                                   kv_offsets=offsets, scale=scale, mask_type=mask_type, qkv_layout="BTNH")
    overflow = (documents_per_row(ids) > max_documents + extra) | split  # [b]: rows it cannot lay out
    out = jnp.where(overflow[:, None, None, None], jnp.asarray(jnp.nan, out.dtype), out)
    return out[:, :t_real, :, :hv]


def attention(q: Array, k: Array, v: Array, *, scale: float, mask: AttentionMask, bias: Optional[Array] = None,
              mesh: Any = None, max_documents: int = DEFAULT.max_documents_per_row) -> Array:
    """cuDNN's packed layout for ``mask``'s segment ids (self-attention: the capability table
    sends padding, lengths, offsets and cross-attention elsewhere), sized for ``max_documents``
    documents per row (the plan's ``max_documents_per_row``); under ``jax.shard_map`` over the
    batch (and heads) on a ``mesh`` of several devices. Returns [B, T, N, Hv]."""
    del bias  # refused by the capability table
    ids = mask.q_segment_ids
    check_concrete(ids, max_documents)
    split = mask.split_documents()  # [B]
    check_split(split)
    b, _, n, _ = q.shape
    kh = k.shape[2]

    def run(q_, k_, v_, ids_, split_):
        return _call(q_, k_, v_, ids_, split_, scale, mask.causal, max_documents)

    layout = mesh_lib.partition(mesh, b, n, kh)
    if layout is None:
        return run(q, k, v, ids, split)
    specs = layout.specs()
    return jax.shard_map(run, mesh=layout.mesh, in_specs=(specs.q, specs.kv, specs.kv, specs.rows, specs.batch),
                         out_specs=specs.q, check_vma=False)(q, k, v, ids, split)
