"""'cudnn': cuDNN's fused flash attention (GPU, bfloat16/float16; its row in
:mod:`goat_jax.kernels.capabilities` says what it takes), and for segment ids cuDNN's packed
layout on Hopper (:mod:`goat_jax.kernels.cudnn_packed`).

cuDNN wants head dims that are multiples of 8 (GOAT's packed q/k, e.g. 66, are zero-padded to
72) and, under differentiation in jax 0.10.2, even lengths
(:func:`goat_jax.kernels.padding.pad_lengths`). ``jax.nn.dot_product_attention`` needs v as wide
as q/k, so v would be zero-padded to the q/k width too: GOAT's few extra q/k channels would then
cost a whole padded v (64 -> 72, 12.5% more V and output memory). cuDNN itself takes q/k wider
than v on Hopper from cuDNN 9.10 ("different head dims"); there v keeps its own width and the
call goes to jax's cuDNN attention directly (:func:`fused`, the arguments
``jax.nn.dot_product_attention`` would pass), elsewhere through the public function.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp

from goat_jax.kernels import cudnn_packed
from goat_jax.kernels import capabilities as caps
from goat_jax.kernels import ring_blocks
from goat_jax.kernels.mask import AttentionMask
from goat_jax.kernels.padding import pad_head_dims, pad_lengths, pad_width
from goat_jax.kernels.xla import dot_product_attention
from goat_jax.kernels.plan import DEFAULT

Array = jax.Array
HEAD_DIM_MULTIPLE, LENGTH_MULTIPLE = 8, 2  # what cuDNN pads q/k/v widths and lengths to
MLA_CUDNN = 91000  # cuDNN 9.10: q/k wider than v on Hopper
HOPPER_BUCKETS = (64, 128, 256)  # cuDNN's native Hopper head widths (goat_jax/kernels/widths.py)


def narrow_values_supported() -> bool:
    """Whether the GPU being compiled for takes v narrower than q/k: Hopper or newer with cuDNN
    >= 9.10, as jax's own cuDNN checks answer (for a compile-only target, goat_jax/aot.py makes
    them answer for the target)."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top
        return bool(fa.check_compute_capability("9.0")) and int(fa.check_cudnn_version()) >= MLA_CUDNN
    except Exception:  # pylint: disable=broad-except  # no CUDA backend or libraries: the padded path
        return False


def fused(q: Array, k: Array, v: Array, scale: float, mask: AttentionMask) -> Array:
    """jax's cuDNN attention on q [B, T, N, Hqk], k [B, S, K, Hqk], v [B, S, K, Hv] with Hv <=
    Hqk allowed: the mask as ``jax.nn.dot_product_attention`` hands it over (native causal mode,
    lengths as padding, anything else as an explicit mask)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top

    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    native = mask.native_causal
    explicit = mask.replace(causal=mask.causal and not native).explicit(t, s, lengths=False, full=True)
    q_len = kv_len = None
    if mask.kv_lengths is not None:
        q_len, kv_len = jnp.full((b,), t, jnp.int32), mask.kv_lengths.astype(jnp.int32)
    if kv_len is not None:
        mask_type = fa.MaskType.PADDING_CAUSAL if native else fa.MaskType.PADDING
    else:
        mask_type = fa.MaskType.CAUSAL if native else fa.MaskType.NO_MASK
    return fa.dot_product_attention(q, k, v, None, explicit, q_len, kv_len, scale=scale, mask_type=mask_type)


def attention(q: Array, k: Array, v: Array, *, scale: float, mask: AttentionMask, bias: Optional[Array] = None,
              mesh: Any = None, max_documents: int = DEFAULT.max_documents_per_row) -> Array:
    """The 'cudnn' kernel (module doc) on q [B, T, N, Hqk], k [B, S, K, Hqk], v [B, S, K, Hv].
    Segment ids go to cuDNN's packed layout (:mod:`goat_jax.kernels.cudnn_packed`, under
    ``jax.shard_map`` on ``mesh``, sized for ``max_documents`` per row: the plan's
    ``max_documents_per_row``); otherwise jax's partitioning rule shards the call over the
    batch, so ``mesh`` is unused."""
    if mask.segments is not None:
        return cudnn_packed.attention(q, k, v, scale=scale, mask=mask, bias=bias, mesh=mesh,
                                      max_documents=max_documents)
    t_real, hv = q.shape[1], v.shape[-1]
    q, k, v, mask = pad_lengths(q, k, v, mask, LENGTH_MULTIPLE)
    if bias is None and hv < q.shape[-1] and narrow_values_supported():
        q, k, _ = pad_head_dims(q, k, v, HEAD_DIM_MULTIPLE, equal=False)
        v = pad_width(v, -(-hv // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE)
        return fused(q, k, v, scale, mask)[:, :t_real, :, :hv]
    out = dot_product_attention(q, k, v, scale, mask, bias, "cudnn", HEAD_DIM_MULTIPLE, full_mask=True)
    return out[:, :t_real]


def hopper_width(compute_capability: Optional[Tuple[int, int]], width: int) -> Optional[int]:
    """The q/k width cuDNN runs a ``width``-wide head at on a GPU of ``compute_capability``: on
    Hopper (9.x) the smallest of :data:`HOPPER_BUCKETS` holding ``width`` rounded up to a
    multiple of 8 (that rounding beyond 256); None elsewhere, where no rule is known
    (goat_jax/kernels/widths.py)."""
    if compute_capability is None or compute_capability[0] != 9:
        return None
    padded = -(-width // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE
    return next((b for b in HOPPER_BUCKETS if padded <= b), padded)


def _ring_blocks(block: int, precision: Any) -> ring_blocks.CudnnBlocks:
    """cuDNN's fused calls as a ring's blocks (``block`` and ``precision`` are flash's), v kept
    narrower than q/k where this GPU takes it (:func:`narrow_values_supported`)."""
    del block, precision
    return ring_blocks.CudnnBlocks(None, narrow_values_supported())


ROW = caps.Capability(
    name="cudnn", platforms=("gpu",), dtypes=caps.HALF, max_head_dim=256, head_dim_multiple=HEAD_DIM_MULTIPLE,
    length_multiple=LENGTH_MULTIPLE, features=("segment_ids", "traced_offset"),
    why_not={"segment_ids": caps.CUDNN_SEGMENTS_WHY, "ragged_segments": caps.CUDNN_RAGGED_WHY,
             "bias": "an additive bias is not wired to cuDNN here (it needs even lengths when training); use 'xla'",
             "window": caps.NO_WINDOW, "return_probs": caps.NO_PROBS},
    summary="cuDNN fused flash attention (GPU, bf16/fp16): jax.nn.dot_product_attention, or cuDNN's packed "
            "layout for segment ids on Hopper (goat_jax/kernels/cudnn_packed.py)",
    needs_capability={"segment_ids": caps.HOPPER}, attention=attention, preferred_on=("gpu",),
    detours={"gathered_causal": caps.CUDNN_GATHERED_CAUSAL_WHY}, bounds_documents=True,
    ring_blocks=caps.RingBlocks(math="cudnn", make=_ring_blocks, no_key_masks=caps.CUDNN_RING_MASKS_WHY),
    fast_widths=caps.FastWidths(
        width=hopper_width, where="a Hopper GPU's cuDNN",
        cost="measured 1.24-1.50x plain cuDNN's time at 66 wide on an H200: benchmarks/gpu.md"))
