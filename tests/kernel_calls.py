"""The keyword form of the mask (``is_causal=``, ``key_padding_mask=``, ...) for tests that call
the flash kernel module directly, whose functions take one :class:`goat_jax.kernels.AttentionMask`."""

from goat_jax.kernels import AttentionMask, flash


def flash_attention(q, k, v, *, is_causal=False, causal_offset=0, key_padding_mask=None, kv_lengths=None,
                    q_segment_ids=None, kv_segment_ids=None, **kwargs):
    """:func:`goat_jax.kernels.flash.flash_attention` with the mask given as keywords."""
    mask = AttentionMask(is_causal, causal_offset, key_padding_mask, kv_lengths, q_segment_ids, kv_segment_ids)
    return flash.flash_attention(q, k, v, mask=mask, **kwargs)
