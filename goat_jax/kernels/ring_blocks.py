"""The block kernels of ring attention (goat_jax/kernels/ring.py): what computes one pair of a
query run and a key run, forward with its log-sum-exp and backward driven by the *global*
output and log-sum-exp. One small interface, three implementations:

* ``forward(scale, pair, q, k, v, valid, offset, q_ids, kv_ids) -> (out float32, lse)``: the
  pair's attention and its row log-sum-exp (float32, ``-inf`` for a row that saw no key);
* ``backward(scale, pair, q, k, v, valid, offset, q_ids, kv_ids, out, lse, do) -> (dq, dk, dv)``
  float32: this pair's share of the gradients, with ``out`` / ``lse`` the ring's merged output
  and log-sum-exp (``+inf`` for a row that saw no key anywhere).

Layouts: q [B, K, G, R, Hqk], k [B, K, R, Hqk], v [B, K, R, Hv] (R the run length), ``valid``
[B, R] bool or None (key padding and lengths), ``q_ids`` / ``kv_ids`` [B, R] int32 or None,
``offset`` the pair's traced causal offset (key j visible to query i iff j <= i + offset).
``pair`` (:class:`Pair`) holds the static facts: whether the ring is causal, its base offset,
the run length, and the pair's kind when it is known before the run (load balancing makes two
of the four chunk pairs of a step always full or always empty).

* :class:`FlashBlocks` (defined in :mod:`goat_jax.kernels.flash`, beside the block loops it
  runs): the flash kernel's loops, which take the traced offset as loop bounds; any backend,
  any mask.
* :class:`SplashBlocks`: Pallas splash kernels built with ``save_residuals=True`` (the forward
  returns the log-sum-exp) and splash's own backward kernels
  (``splash_attention_kernel._splash_attention_bwd``) fed with the global output and
  log-sum-exp: splash forms ``sum(o * do)`` from the output it is given, so each block returns
  its exact dq, dk, dv. Splash builds masks statically, so a pair whose kind depends on the
  device and the step runs ``lax.switch`` over the static kinds (empty, full, causal at each
  offset a pair can have; the ring hands it pairs of one known kind where it can, since the
  switches cost memory: goat_jax/kernels/ring.py); segment ids and key padding go through
  splash's segment ids.
* :class:`CudnnBlocks`: jax's private cuDNN call with ``return_residual=True`` (float32 stats
  [B, N, T]) and its backward primitive bound with the global stats and output; the causal
  kinds it takes are cuDNN's own (top-left causal on the diagonal, none below, empty above).
  The two calls are one argument (:class:`CudnnCalls`), so a pure-JAX model with the same
  signature and statistics runs the same block arithmetic on CPU (tests/cudnn_stand_in.py).

Every class is a frozen dataclass: the ring's static configuration holds one, so it must hash.
Which blocks a ring runs is the kernel row's ``ring_blocks``
(:class:`goat_jax.kernels.capabilities.RingBlocks`): 'flash' and 'xla' name flash's loops,
'splash' / 'splash_interpret' :class:`SplashBlocks` (the splash row builds them after widening
jax's cache of processed splash masks), 'cudnn' :class:`CudnnBlocks`; 'dense' has none.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from goat_jax.kernels.flash import FlashBlocks  # noqa: F401  (re-exported; defined beside the loops it runs)

Array = jax.Array
_EMPTY_BELOW = -1e30  # a splash log-sum-exp below this saw only masked keys (its mask value, ~-2.4e38)


class Pair(NamedTuple):
    """Static facts of one (query run, key run) pair of the ring."""

    causal: bool  # the ring's mask is causal
    base: int  # the ring's static causal offset (0 for self-attention)
    run: int  # tokens per run
    # What is known statically of the pair's kind: 'full', 'empty', 'diagonal' (the ring's own
    # causal mask at the base offset: a run against itself), 'off_diagonal' (full or empty,
    # never partly masked: a run against another of a ring at offset 0), or None.
    known: Optional[str] = None


# A pair's kind: ('empty',), ('full',) or ('causal', offset).
Kind = Tuple[Any, ...]


def kinds(pair: Pair) -> Tuple[Kind, ...]:
    """The kinds a pair can take at run time, static: offsets differ from the base by whole
    runs, and only those within a run of the diagonal need a causal mask."""
    if not pair.causal or pair.known == "full":
        return (("full",),)
    if pair.known == "empty":
        return (("empty",),)
    if pair.known == "diagonal":
        return (("causal", pair.base),)
    if pair.known == "off_diagonal":
        return (("empty",), ("full",))
    n = pair.run
    partial = tuple(("causal", d) for d in (pair.base % n - n, pair.base % n) if -n < d < n - 1)
    return (("empty",), ("full",)) + partial


def kind_index(pair: Pair, offset: Array) -> Array:
    """Index into :func:`kinds` of the pair whose traced causal offset is ``offset``."""
    options = kinds(pair)
    if len(options) == 1:
        return jnp.int32(0)
    index = jnp.where(offset >= pair.run - 1, 1, 0)
    for i, kind in enumerate(options[2:], start=2):
        index = jnp.where(offset == kind[1], i, index)
    return index.astype(jnp.int32)


def _splash_block(run: int) -> int:
    """Splash's tile: the largest multiple of 128 up to 512 that divides the run."""
    for size in (512, 384, 256, 128):
        if run % size == 0:
            return size
    raise ValueError(f"splash ring blocks need runs of whole 128-token blocks; got {run} tokens per run "
                     "(the capability table checks the sequence length first).")


def _splash_ids(q_ids, kv_ids, valid):
    """Splash's segment ids for a pair ([B, R] each, or None): padding folded into the key ids
    as an id no query of the row has (splash masks through segment ids only)."""
    if q_ids is None and valid is None:
        return None
    if q_ids is None:
        b, r = valid.shape[0], valid.shape[1]
        return jnp.zeros((b, r), jnp.int32), jnp.where(valid, 0, 1).astype(jnp.int32)
    if valid is None:
        return q_ids, kv_ids
    low = jnp.min(q_ids, axis=-1, keepdims=True)
    high = jnp.max(q_ids, axis=-1, keepdims=True)
    never = jnp.where(low > jnp.iinfo(jnp.int32).min, low - 1, high + 1)
    return q_ids, jnp.where(valid, kv_ids, never)


@dataclasses.dataclass(frozen=True)
class SplashBlocks:
    """Splash kernels as ring blocks (module doc); ``interpret``: Pallas interpret mode (CPU
    tests, 'splash_interpret')."""

    interpret: bool = False
    static_masks = True  # masks built before the run (a switch per kind), not from the traced offset
    lane_dense_sums = True  # the ring keeps its gradient sums dense over TPU lanes (ring._lanes)

    def _kernel(self, kind: Kind, heads: int, run: int):
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

        b = _splash_block(run)
        sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                              block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
        base = sm.CausalMask((run, run), offset=kind[1]) if kind[0] == "causal" else sm.FullMask((run, run))
        return sk.make_splash_mha_single_device(sm.MultiHeadMask([base] * heads), block_sizes=sizes,
                                                save_residuals=True, interpret=self.interpret)

    def forward(self, scale, pair: Pair, q, k, v, valid, offset, q_ids, kv_ids):
        """The pair's (out float32, lse with -inf for rows that saw no key) (module doc)."""
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

        b, kh, g, r, _ = q.shape
        ids = _splash_ids(q_ids, kv_ids, valid)
        # Splash does not scale q. Its MHA kernel takes K key heads for K * G query heads (query
        # head n reads key head n // G, the ring's grouping), so [B, K, G, R, H] is only reshaped.
        qs = (q * jnp.asarray(scale, q.dtype)).reshape(b, kh * g, r, -1)

        def branch(kind):
            def run_kind(qs, k, v, ids):
                if kind[0] == "empty":
                    return (jnp.zeros(q.shape[:-1] + v.shape[-1:], jnp.float32),
                            jnp.full(q.shape[:-1], -jnp.inf, jnp.float32))
                kernel = self._kernel(kind, kh * g, r)

                def one(qh, kh_, vh, seg):
                    seg = None if seg is None else sk.SegmentIds(q=seg[0], kv=seg[1])
                    out, (lse,) = kernel(qh, kh_, vh, segment_ids=seg)
                    return out.astype(jnp.float32), lse

                out, lse = jax.vmap(one)(qs, k, v, ids)
                return out.reshape(b, kh, g, r, -1), lse.reshape(b, kh, g, r)
            return run_kind

        options = kinds(pair)
        args = (qs, k, v, ids)
        if len(options) == 1:
            out, lse = branch(options[0])(*args)
        else:
            out, lse = lax.switch(kind_index(pair, offset), [branch(kd) for kd in options], *args)
        seen = lse > _EMPTY_BELOW  # splash's masked logits are finite: a row of them is "nothing seen"
        return jnp.where(seen[..., None], out, 0.0), jnp.where(seen, lse, -jnp.inf)

    def backward(self, scale, pair: Pair, q, k, v, valid, offset, q_ids, kv_ids, out, lse, do):
        """The pair's float32 (dq, dk, dv) from splash's dq / dkv kernels fed with the global
        ``out`` and ``lse`` (module doc)."""
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

        b, kh, g, r, _ = q.shape
        ids = _splash_ids(q_ids, kv_ids, valid)
        heads = lambda x: x.reshape((b, kh * g) + x.shape[3:])  # [B, K, G, R, ...] -> [B, N, R, ...]
        qs = heads(q * jnp.asarray(scale, q.dtype))
        out, lse, do = heads(out.astype(v.dtype)), heads(lse), heads(do.astype(v.dtype))

        def branch(kind):
            def run_kind(qs, k, v, out, lse, do, ids):
                if kind[0] == "empty":
                    return (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
                            jnp.zeros(v.shape, jnp.float32))
                kernel = self._kernel(kind, kh * g, r)
                kw = kernel.kwargs

                def one(qh, kh_, vh, oh, lh, doh, seg):
                    seg = None if seg is None else sk.SegmentIds(q=seg[0], kv=seg[1])
                    res = (qh, kh_, vh, seg, None, oh, lh, kernel.dq_mask_info, kernel.dkv_mask_info)
                    grads = sk._splash_attention_bwd(  # pylint: disable=protected-access
                        False, kw["mask_value"], False, kw["block_sizes"], None, kw["mask_function"],
                        kw["attn_logits_soft_cap"], self.interpret, res, doh)
                    dq, dk, dv = grads[3:6]
                    return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)

                dq, dk, dv = jax.vmap(one)(qs, k, v, out, lse, do, ids)
                return dq.reshape(q.shape), dk, dv
            return run_kind

        options = kinds(pair)
        args = (qs, k, v, out, lse, do, ids)
        if len(options) == 1:
            dq, dk, dv = branch(options[0])(*args)
        else:
            dq, dk, dv = lax.switch(kind_index(pair, offset), [branch(kd) for kd in options], *args)
        return dq * scale, dk, dv


class CudnnCalls(NamedTuple):
    """The two cuDNN entry points a ring block uses, swappable as one argument:

    * ``forward(q, k, v, *, scale, mask_type, qkv_layout, return_residual)``: the signature of
      ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``; returns (out, stats
      float32 [B, N, T], the natural-log log-sum-exp);
    * ``backward(q, k, v, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_table_k,
      page_table_v, stats, out, do, *, scale, seed, dropout_rate, variadic_args, mask_type,
      layout, sliding_window_length)``: the signature of the backward primitive's ``bind``;
      returns (dq, dk, dv).
    """

    forward: Callable[..., Any]
    backward: Callable[..., Any]
    mask_types: Any  # the MaskType enum the calls take (NO_MASK, CAUSAL)
    layout: int  # the BTNH layout's value


def jax_cudnn_calls() -> CudnnCalls:
    """jax 0.10.2's private cuDNN attention forward and its backward primitive (GPU only)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top

    return CudnnCalls(fa.dot_product_attention, fa._dot_product_attention_bwd_p_wrapper.bind,  # pylint: disable=protected-access
                      fa.MaskType, fa.AttentionLayout.BTNH.value)


@dataclasses.dataclass(frozen=True)
class CudnnBlocks:
    """cuDNN's fused attention as ring blocks (module doc). ``calls``: None for jax's private
    cuDNN calls (:func:`jax_cudnn_calls`), or a stand-in of the same signatures (CPU tests).
    ``narrow_values``: v keeps its own width (Hopper, cuDNN >= 9.10); otherwise it is
    zero-padded to the q/k width inside the call."""

    calls: Optional[Callable[[], CudnnCalls]] = None
    narrow_values: bool = True
    static_masks = True  # masks built before the run (a switch per kind), not from the traced offset
    lane_dense_sums = False  # the ring keeps its gradient sums dense over TPU lanes (ring._lanes)

    def _calls(self) -> CudnnCalls:
        return jax_cudnn_calls() if self.calls is None else self.calls()

    def _widths(self, hqk: int, hv: int) -> Tuple[int, int]:
        up = lambda n: -(-n // 8) * 8
        return up(hqk), (up(hv) if self.narrow_values else up(max(hqk, hv)))

    @staticmethod
    def _btnh(q, k, v, wqk, wv):
        """Ring layouts to cuDNN's BTNH, widths zero-padded (zeros change no logit)."""
        b, kh, g, r, _ = q.shape
        pad = lambda x, w: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, w - x.shape[-1])])
        qt = jnp.moveaxis(pad(q, wqk), 3, 1).reshape(b, r, kh * g, wqk)  # head n = kv head n // G
        return qt, jnp.moveaxis(pad(k, wqk), 2, 1), jnp.moveaxis(pad(v, wv), 2, 1)

    def _check(self, pair: Pair, valid, q_ids):
        if valid is not None or q_ids is not None:
            raise ValueError("cuDNN ring blocks take no key padding or segment ids (the capability table sends "
                             "them to 'flash'); this call should not have reached them.")
        if pair.causal and pair.base != 0:
            raise ValueError(f"cuDNN ring blocks express causal pairs at offset 0 only; got offset {pair.base}.")

    def _prepare(self, pair: Pair, valid, q_ids, q, k, v):
        """What the forward and the backward both start from: the pair checked, the calls, the
        shapes (b, kh, g, r, hqk, hv), the widths cuDNN runs (q/k, v) and q/k/v in its BTNH layout."""
        self._check(pair, valid, q_ids)
        b, kh, g, r, hqk = q.shape
        hv = v.shape[-1]
        wqk, wv = self._widths(hqk, hv)
        return self._calls(), (b, kh, g, r, hqk, hv), (wqk, wv), self._btnh(q, k, v, wqk, wv)

    def forward(self, scale, pair: Pair, q, k, v, valid, offset, q_ids, kv_ids):
        """The pair's (out float32, lse with -inf for rows that saw no key) (module doc)."""
        del kv_ids
        calls, (b, kh, g, r, hqk, hv), (wqk, wv), (qt, kt, vt) = self._prepare(pair, valid, q_ids, q, k, v)

        def branch(kind):
            def run_kind(qt, kt, vt):
                if kind[0] == "empty":
                    return (jnp.zeros((b, kh, g, r, hv), jnp.float32), jnp.full((b, kh, g, r), -jnp.inf, jnp.float32))
                mask_type = calls.mask_types.CAUSAL if kind[0] == "causal" else calls.mask_types.NO_MASK
                out, stats = calls.forward(qt, kt, vt, scale=scale, mask_type=mask_type, qkv_layout="BTNH",
                                           return_residual=True)
                out = jnp.moveaxis(out[..., :hv].reshape(b, r, kh, g, hv), 1, 3).astype(jnp.float32)
                return out, stats.astype(jnp.float32).reshape(b, kh, g, r)
            return run_kind

        options = _cudnn_kinds(pair)
        if len(options) == 1:
            return branch(options[0])(qt, kt, vt)
        return lax.switch(kind_index(pair, offset), [branch(kd) for kd in options], qt, kt, vt)

    def backward(self, scale, pair: Pair, q, k, v, valid, offset, q_ids, kv_ids, out, lse, do):
        """The pair's float32 (dq, dk, dv) from cuDNN's backward bound with the global ``out``
        and ``lse`` as its forward output and stats (module doc)."""
        del kv_ids
        calls, (b, kh, g, r, hqk, hv), (wqk, wv), (qt, kt, vt) = self._prepare(pair, valid, q_ids, q, k, v)
        pad_v = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, wv - hv)])
        to_btnh = lambda x: jnp.moveaxis(pad_v(x), 3, 1).reshape(b, r, kh * g, wv).astype(v.dtype)
        ot, dot = to_btnh(out), to_btnh(do)
        stats = lse.astype(jnp.float32).reshape(b, kh * g, r)
        unused = jnp.zeros(0, q.dtype)

        def branch(kind):
            def run_kind(qt, kt, vt, ot, dot, stats):
                if kind[0] == "empty":
                    return (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
                            jnp.zeros(v.shape, jnp.float32))
                mask_type = calls.mask_types.CAUSAL if kind[0] == "causal" else calls.mask_types.NO_MASK
                dq, dk, dv = calls.backward(qt, kt, vt, unused, unused, unused, unused, unused, unused, unused,
                                            stats, ot, dot, scale=scale, seed=42, dropout_rate=0.0,
                                            variadic_args=(False, False), mask_type=mask_type,
                                            layout=calls.layout, sliding_window_length=None)[:3]
                dq = jnp.moveaxis(dq.reshape(b, r, kh, g, wqk), 1, 3)[..., :hqk]
                return (dq.astype(jnp.float32), jnp.moveaxis(dk, 1, 2)[..., :hqk].astype(jnp.float32),
                        jnp.moveaxis(dv, 1, 2)[..., :hv].astype(jnp.float32))
            return run_kind

        options = _cudnn_kinds(pair)
        args = (qt, kt, vt, ot, dot, stats)
        if len(options) == 1:
            return branch(options[0])(*args)
        return lax.switch(kind_index(pair, offset), [branch(kd) for kd in options], *args)


def _cudnn_kinds(pair: Pair) -> Tuple[Kind, ...]:
    """:func:`kinds` for cuDNN, whose only causal kind is offset 0 (top-left, equal lengths)."""
    options = kinds(pair)
    for kind in options:
        if kind[0] == "causal" and kind[1] != 0:
            raise ValueError(f"cuDNN ring blocks express causal pairs at offset 0 only; got offset {kind[1]}.")
    return options
