"""cuDNN's packed layout for segment ids (goat_jax/kernels/cudnn_packed.py), tested on CPU: the
offsets and lengths made from segment ids, read back through a pure-JAX model of what the layout
means, equal the segment-id mask on random document layouts (single-token documents, a row that
is one document, rows with the most documents allowed, padding at the end, odd lengths); the
bound on documents per row; and the automatic choice (Hopper and newer only, packed
self-attention only). cuDNN itself runs in the prepared GPU check (scripts/device_check.sh)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax import kernels
from goat_jax.data import packing
from goat_jax.kernels import cudnn_packed

PAD = packing.PAD_SEGMENT_ID


def _reference(ids: np.ndarray, causal: bool) -> np.ndarray:
    """[B, T, T]: query i sees key j iff same id (and j <= i): the kernels' masking contract."""
    t = ids.shape[1]
    seen = ids[:, :, None] == ids[:, None, :]
    if causal:
        seen &= np.tril(np.ones((t, t), bool))[None]
    return seen


def _layouts(rng, t: int, max_docs: int):
    """Rows of the shapes the issue names, plus random ones."""
    one = np.ones(t, np.int32)
    singles = np.arange(t, dtype=np.int32)[:t]  # t one-token documents
    rows = {"one_document": one, "single_tokens": singles}
    cuts = np.sort(rng.choice(np.arange(1, t), max_docs - 1, replace=False))
    rows["most_documents"] = np.repeat(np.arange(1, max_docs + 1, dtype=np.int32), np.diff(np.r_[0, cuts, t]))
    padded = rows["most_documents"].copy()
    padded[-5:] = PAD  # trailing padding: a run of its own (replaces the last document's tail)
    rows["padding_at_end"] = padded
    for r in range(4):
        n = int(rng.integers(1, max_docs + 1))
        cuts = np.sort(rng.choice(np.arange(1, t), n - 1, replace=False))
        row = np.repeat(rng.permutation(1000)[:n].astype(np.int32), np.diff(np.r_[0, cuts, t]))
        rows[f"random_{r}"] = row
    return rows


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t", [24, 23])
def test_packed_layout_means_the_segment_mask(causal, t):
    rng = np.random.default_rng(t)
    rows = _layouts(rng, t, max_docs=8)
    ids = np.stack(list(rows.values()))
    max_docs = max(t, 8)  # single_tokens holds t documents
    offsets, lengths = cudnn_packed.packed_layout(jnp.asarray(ids), max_docs)
    assert offsets.shape == (len(rows), max_docs + 1) and lengths.shape == (len(rows), max_docs)
    got = cudnn_packed.layout_visibility(offsets, lengths, offsets, lengths, t, t, causal)
    want = _reference(ids, causal)
    for name, g, w in zip(rows, np.asarray(got), want):
        np.testing.assert_array_equal(g, w, err_msg=name)
    # Every query row lies in exactly one document: no row is left to uninitialized output.
    starts, lens = np.asarray(offsets)[:, :-1], np.asarray(lengths)
    np.testing.assert_array_equal(np.where(lens > 0, lens, 0).sum(1), t)
    assert (np.asarray(offsets)[:, -1] == -1).all()


def test_odd_length_padding_is_a_document_of_its_own():
    """An odd row gets one token whose id differs from the last (even PAD_SEGMENT_ID's), so the
    real rows see exactly the keys they saw before."""
    ids = jnp.asarray([[1, 1, 2, 2, PAD], [5, 5, 5, 5, 5]], jnp.int32)
    x = jnp.zeros((2, 5, 1, 8))
    _, _, _, padded = cudnn_packed._odd_pad(x, x, x, ids)  # pylint: disable=protected-access
    assert padded.shape == (2, 6) and int(padded[0, -1]) != PAD and int(padded[1, -1]) != 5
    offsets, lengths = cudnn_packed.packed_layout(padded, 4)
    seen = np.asarray(cudnn_packed.layout_visibility(offsets, lengths, offsets, lengths, 6, 6, False))
    np.testing.assert_array_equal(seen[:, :5, :5], _reference(np.asarray(ids), False))
    assert not seen[:, :5, 5].any() and seen[:, 5, 5].all()


def test_rows_with_too_many_documents_name_the_field():
    ids = jnp.asarray([[1, 2, 3, 4, 5, 5]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(cudnn_packed.documents_per_row(ids)), [5])
    cudnn_packed.check_concrete(ids, 5)
    with pytest.raises(ValueError, match=r"A row holds 5 documents .* more than max_documents_per_row=4"):
        cudnn_packed.check_concrete(ids, 4)
    example = {"segment_ids": np.asarray([1, 1, 2, 3, PAD, PAD], np.int32)}
    assert packing.check_documents_per_row(example, 4) is example
    with pytest.raises(ValueError, match=r"holds 4 documents .* model\.max_documents_per_row=3"):
        packing.check_documents_per_row(example, 3)


class _Device:
    platform = "gpu"

    def __init__(self, kind):
        self.device_kind = kind


@pytest.mark.parametrize("kind,segments_on_cudnn", [("NVIDIA H200", True), ("NVIDIA H100 80GB HBM3", True),
                                                    ("NVIDIA A100-SXM4-80GB", False)])
def test_automatic_choice_takes_cudnn_for_packed_documents_on_hopper_only(monkeypatch, kind, segments_on_cudnn):
    monkeypatch.setattr(kernels.choice, "target", lambda *a, **kw: ("gpu", "this test", _Device(kind)))
    shape = (1, 8, 2048, 2048)
    with kernels.record_choices() as found:
        got = kernels.resolve_implementation(None, jnp.bfloat16, 72, shape, segments=True)
    assert (got == "cudnn") == segments_on_cudnn, got
    assert found[0]["implementation"] == got
    # Without segment ids every GPU generation here runs cuDNN; with padding or cross-attention
    # added to the segment ids, none does (the packed layout cannot express it).
    assert kernels.resolve_implementation(None, jnp.bfloat16, 72, shape) == "cudnn"
    assert kernels.resolve_implementation(None, jnp.bfloat16, 72, shape, segments=True,
                                          ragged_segments=True) == "flash"
    if not segments_on_cudnn:
        with pytest.raises(ValueError, match=r"needs a Hopper or newer GPU .*compute capability: 8\.0"):
            kernels.resolve_implementation("cudnn", jnp.bfloat16, 72, shape, segments=True)
    else:
        with pytest.raises(ValueError, match="packed self-attention only"):
            kernels.resolve_implementation("cudnn", jnp.bfloat16, 72, shape, segments=True, ragged_segments=True)


def test_compute_capability_of_devices():
    assert kernels.choice.compute_capability(_Device("NVIDIA GH200 480GB")) == (9, 0)
    assert kernels.choice.compute_capability(_Device("NVIDIA B200")) == (10, 0)
    assert kernels.choice.compute_capability(_Device("TPU v5 lite")) is None

    class Real:
        compute_capability = "8.9"
        device_kind = "NVIDIA H100"  # its own report wins
    assert kernels.choice.compute_capability(Real()) == (8, 9)


def test_the_mask_says_what_the_packed_layout_cannot_express():
    ids = jnp.zeros((1, 8), jnp.int32)
    self_attention = kernels.AttentionMask.build(1, 8, 8, is_causal=True, segment_ids=ids)
    assert self_attention.q_segment_ids is self_attention.kv_segment_ids and not self_attention.ragged_segments
    padded = kernels.AttentionMask.build(1, 8, 8, is_causal=True, segment_ids=ids,
                                         key_padding_mask=jnp.zeros((1, 8), bool))
    assert padded.ragged_segments
    assert kernels.AttentionMask.build(1, 8, 8, is_causal=True, causal_offset=2, segment_ids=ids).ragged_segments
    cross = kernels.AttentionMask.build(1, 8, 8, q_segment_ids=ids, kv_segment_ids=ids + 0)
    assert cross.ragged_segments


def _packed_model(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type, qkv_layout):
    """cuDNN's packed fused attention as the pure-JAX model of the layout (layout_visibility):
    what the private call computes, so cudnn_packed.attention runs on CPU."""
    from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top
    assert qkv_layout == "BTNH"
    causal = mask_type == fa.MaskType.PADDING_CAUSAL
    seen = cudnn_packed.layout_visibility(q_offsets, q_seqlen, kv_offsets, kv_seqlen, q.shape[1], k.shape[1], causal)
    logits = scale * jnp.einsum("btnh,bsnh->bnts", q, k)
    p = jax.nn.softmax(jnp.where(seen[:, None], logits, -jnp.inf), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p, v)


def test_split_documents_mean_one_document_on_every_kernel(monkeypatch):
    """Issue #53, item 10: one meaning of segment ids on every kernel (goat_jax/kernels/mask.py):
    a document is all tokens of one id. Under jit, ids ``1 1 1 2 2 2 1 1 1 2 2 2`` give the
    float64 equality reference on 'xla', 'flash' and 'dense'; cuDNN's packed layout (run through
    the pure-JAX model of its private call) takes documents as runs, so there that row is NaN,
    never its different answer (1.35 off before), and eagerly it is refused naming segment_ids;
    the contiguous row is the same everywhere."""
    from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top
    monkeypatch.setattr(fa, "dot_product_attention", _packed_model)
    rng = np.random.default_rng(10)
    ids = np.asarray([[1, 1, 1, 2, 2, 2, 1, 1, 1, 2, 2, 2], [4, 4, 4, 4, 7, 7, 7, 7, 7, 7, 9, 9]], np.int32)
    q, k, v = (rng.normal(size=(2, 12, 2, 8)).astype(np.float32) for _ in range(3))
    mask = kernels.AttentionMask.build(2, 12, 12, is_causal=True, segment_ids=jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(mask.split_documents()), [True, False])
    seen = _reference(ids, True)
    logits = 0.5 * np.einsum("btnh,bsnh->bnts", q.astype(np.float64), k.astype(np.float64))
    logits = np.where(seen[:, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v.astype(np.float64))
    for implementation in ("xla", "flash", "dense"):
        got = jax.jit(lambda q, k, v, i: kernels.attend(q, k, v, implementation=implementation, scale=0.5,
                                                         is_causal=True, segment_ids=i))(q, k, v, ids)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=implementation)
    cudnn = jax.jit(lambda q, k, v, i: cudnn_packed.attention(
        q, k, v, scale=0.5, mask=kernels.AttentionMask.build(2, 12, 12, is_causal=True, segment_ids=i)))
    got = np.asarray(cudnn(q, k, v, ids))
    assert np.isnan(got[0]).all()
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"^segment_ids row 0 has an id in several runs.*implementation='flash'"):
        cudnn_packed.attention(q, k, v, scale=0.5, mask=mask)
    np.testing.assert_allclose(np.asarray(cudnn_packed.attention(q[1:], k[1:], v[1:], scale=0.5, mask=kernels.AttentionMask.build(
        1, 12, 12, is_causal=True, segment_ids=jnp.asarray(ids[1:])))), want[1:], rtol=1e-5, atol=1e-5)


def test_a_row_past_the_bound_merges_its_last_documents():
    """What packed_layout's docstring says (issue #53, item 21): past M documents, the M-th
    document's length runs to the row's end, merging every later document into it; the caller
    poisons such rows."""
    offsets, lengths = cudnn_packed.packed_layout(jnp.asarray([[1, 1, 2, 3, 3, 4]], jnp.int32), 2)
    np.testing.assert_array_equal(np.asarray(offsets), [[0, 2, -1]])
    np.testing.assert_array_equal(np.asarray(lengths), [[2, 4]])  # documents 2, 3 and 4 as one
