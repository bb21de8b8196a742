"""Segment ids on the attention kernels (document-aware packing): every CPU kernel against the
float64 reference and against running each document alone (outputs and gradients), rows
without a key of their segment, flash tile skipping, and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernel_calls import flash_attention
from goat_jax import kernels
from tests import goat_reference as ref
from tests.marks import SLOW_CASE

CPU_KERNELS = ["xla", "flash", "dense", "splash_interpret"]
PAD = np.iinfo(np.int32).max  # the data packer's padding id (goat_jax.data.packing)
FLASH_BLOCKS = dict(block_q=32, block_k=32, bwd_block_q=32, bwd_block_k=16)
T = 128  # one whole splash block (other lengths are padded: tests/test_attention.py)


def _packed_ids(rng, b, t, pad_tail):
    """[B, T] non-decreasing ids of random documents (ids need not start at 0 or be dense),
    the last ``pad_tail`` positions of row 0 padding (PAD)."""
    ids = np.zeros((b, t), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t - pad_tail), size=4, replace=False))
        ids[row] = np.repeat(np.arange(5) * 3 + 7 * row, np.diff([0, *cuts, t]))
    ids[0, t - pad_tail:] = PAD
    return ids


def _run(implementation, q, k, v, ct, **kw):
    """(out, dq, dk, dv) of loss = sum(out * ct) on one kernel, as float64 numpy."""
    arrays = {key: jnp.asarray(val) for key, val in kw.items() if isinstance(val, np.ndarray)}
    static = tuple(sorted((key, val) for key, val in kw.items() if key not in arrays))
    fn = _compiled(implementation, static, tuple(sorted(arrays)))
    args = (jnp.asarray(x, jnp.float32) for x in (q, k, v, ct))
    return [np.asarray(x, np.float64) for x in fn(*args, arrays)]


@functools.lru_cache(maxsize=None)
def _compiled(implementation, static, array_keys):
    """One jitted value-and-gradients function per kernel and static arguments, so calls that
    differ only in array values (inputs, ids, masks) share a compilation."""
    del array_keys  # part of the cache key only: the traced dict's structure

    def value_and_grads(a, c, d, e, arrays):
        kw = {**dict(static), **arrays}
        if implementation == "flash":
            seg = kw.pop("segment_ids", None)
            if seg is not None:
                kw.update(q_segment_ids=seg, kv_segment_ids=seg)
            f = lambda a_, c_, d_: flash_attention(a_, c_, d_, **kw, **FLASH_BLOCKS)
        else:
            f = lambda a_, c_, d_: kernels.attend(a_, c_, d_, implementation=implementation, **kw)
        out, vjp = jax.vjp(f, a, c, d)
        return (out, *vjp(e))

    return jax.jit(value_and_grads)


def _close(got, want, tol=1e-5, what=""):
    """Max error relative to the largest reference entry (at least 1: a one-token document's
    dq is exactly 0 in float64 and ~1e-7 in float32)."""
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = np.abs(a - b).max() / max(np.abs(b).max(), 1.0)
        assert err < tol, f"{what}{name}: relative error {err:.2e}"


def _slow_unless(condition):
    return [] if condition else [SLOW_CASE]


@pytest.mark.parametrize("implementation, is_causal", [
    pytest.param(impl, causal, marks=_slow_unless(causal))
    for impl in CPU_KERNELS for causal in (True, False)])
def test_packed_rows_equal_reference_and_documents_alone(implementation, is_causal, rng):
    # GQA (4 query heads on 2 kv heads), packed documents, trailing padding with its own id,
    # and a padded key inside a document (key_padding_mask still applies).
    b, n, kh, h = 2, 4, 2, 8
    q, k, v = rng.normal(size=(b, T, n, h)), rng.normal(size=(b, T, kh, h)), rng.normal(size=(b, T, kh, h))
    ct = rng.normal(size=(b, T, n, h))
    ids = _packed_ids(rng, b, T, pad_tail=9)
    kpm = np.zeros((b, T), bool)
    kpm[1, 40] = True
    kw = dict(scale=h ** -0.5, is_causal=is_causal, key_padding_mask=kpm)
    got = _run(implementation, q, k, v, ct, segment_ids=ids, **kw)
    _close(got, ref.attention_and_grads(q, k, v, ct, q_segment_ids=ids, kv_segment_ids=ids, **kw))

    # Each document alone, without segment ids: the float64 reference, and for 'flash' (the
    # kernel that skips tiles) the kernel itself on row 0's longest document.
    longest = max(np.unique(ids[0][ids[0] != PAD]), key=lambda d: np.sum(ids[0] == d))
    for row in range(b):
        for doc in np.unique(ids[row]):
            at = np.flatnonzero(ids[row] == doc)
            sl = (slice(row, row + 1), slice(at[0], at[-1] + 1))
            alone = dict(scale=h ** -0.5, is_causal=is_causal, key_padding_mask=kpm[sl])
            piece = ref.attention_and_grads(q[sl], k[sl], v[sl], ct[sl], **alone)
            _close([x[sl] for x in got], piece, what=f"row {row} document {doc} ")
            if implementation == "flash" and row == 0 and doc == longest:
                _close(_run("flash", q[sl], k[sl], v[sl], ct[sl], **alone), piece,
                       what=f"flash alone, document {doc} ")


@pytest.mark.parametrize("implementation", [
    pytest.param(impl, marks=_slow_unless(impl != "splash_interpret")) for impl in CPU_KERNELS])
def test_cross_segments_rows_without_their_segment_are_zero(implementation, rng):
    # Decoding-like: queries against a longer key sequence with a causal offset; some query ids
    # appear among no key, and some keys are padded: those rows are zeros with zero gradient.
    b, n, kh, h, s = 2, 2, 1, 8, 2 * T
    if implementation.startswith("splash"):
        offset = 0  # splash's causal offset must be static; 0 keeps its native mask
    else:
        offset = s - T
    q, k, v = rng.normal(size=(b, T, n, h)), rng.normal(size=(b, s, kh, h)), rng.normal(size=(b, s, kh, h))
    ct = rng.normal(size=(b, T, n, h))
    q_ids = np.repeat(np.array([[3, 4, 9, 5], [1, 1, 2, 8]], np.int32), T // 4, axis=1)
    kv_ids = np.repeat(np.array([[3, 3, 4, 4], [2, 1, 2, 1]], np.int32), s // 4, axis=1)
    kpm = np.zeros((b, s), bool)
    kpm[1, : s // 4] = True
    kw = dict(scale=h ** -0.5, is_causal=True, causal_offset=offset, key_padding_mask=kpm)
    seg = dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    got = _run(implementation, q, k, v, ct, **seg, **kw)
    want = ref.attention_and_grads(q, k, v, ct, **seg, **kw)
    _close(got, want)
    empty = ~np.isin(q_ids[0], kv_ids[0])
    assert empty.any() and np.all(got[0][0, empty] == 0) and np.all(got[1][0, empty] == 0)


def test_flash_skips_tiles_whose_segments_cannot_meet(rng):
    # On this single-device process each example skips its own tiles (per_example default).
    assert jax.device_count() == 1
    # Row 0: documents aligned to 32-blocks; row 1: one document (it needs every tile). NaN
    # values in row 0's document 2 poison any forward tile of a document-1 query block that
    # visits a document-2 key block (0 * NaN); NaN queries in row 0's document 1 poison, in the
    # backward pass, document 2's key gradients through any such tile. Finite = skipped.
    b, n, h = 2, 2, 8
    ids = np.repeat(np.array([[1, 1, 2, 2], [1, 1, 1, 1]], np.int32), 32, axis=1)
    q, k, v = rng.normal(size=(b, T, n, h)), rng.normal(size=(b, T, n, h)), rng.normal(size=(b, T, n, h))
    ones = np.ones((b, T, n, h))
    v_nan = v.copy()
    v_nan[0, 64:] = np.nan
    out = _run("flash", q, k, v_nan, ones, segment_ids=ids, is_causal=False)[0]
    assert np.isfinite(out[0, :64]).all() and np.isnan(out[0, 64:]).all()
    assert np.isfinite(out[1]).all()
    q_nan = q.copy()
    q_nan[0, :64] = np.nan
    _, _, dk, dv = _run("flash", q_nan, k, v, ones, segment_ids=ids, is_causal=False)
    assert np.isfinite(dk[0, 64:]).all() and np.isfinite(dv[0, 64:]).all()
    assert np.isnan(dk[0, :64]).all() and np.isfinite(dk[1]).all()
    # Control: with per_example=False (the default with several devices) the batch visits the
    # union of the rows' tiles, which row 1 makes all of them: the NaNs reach document 1.
    out = _run("flash", q, k, v_nan, ones, segment_ids=ids, is_causal=False, per_example=False)[0]
    assert np.isnan(out[0]).all()


# per_example=True (the default) is covered by the packed-rows test; the union path here.
@pytest.mark.parametrize("per_example", [pytest.param(True, marks=SLOW_CASE), False])
def test_flash_non_contiguous_ids_are_exact(per_example, rng):
    # Ids that repeat non-contiguously (A B A), rows packed differently: no tile may be skipped
    # wrongly, whether each example skips its own tiles or the batch visits their union.
    b, n, h = 2, 2, 8
    ids = np.tile(np.repeat(np.array([5, 6, 5, 7], np.int32), 10), (b, 1))
    ids[1] = ids[1][::-1]
    q, k, v, ct = (rng.normal(size=(b, 40, n, h)) for _ in range(4))
    kw = dict(scale=h ** -0.5, is_causal=True)
    _close(_run("flash", q, k, v, ct, segment_ids=ids, per_example=per_example, **kw),
           ref.attention_and_grads(q, k, v, ct, q_segment_ids=ids, kv_segment_ids=ids, **kw))


@pytest.mark.parametrize("kwargs, match", [
    (dict(segment_ids=np.zeros((2, 16), np.float32)), "segment_ids must be integer ids"),
    (dict(segment_ids=np.zeros((2, 15), np.int32)), r"q_segment_ids must have shape \(2, 16\)"),
    (dict(q_segment_ids=np.zeros((2, 16), np.int32)), "kv_segment_ids is missing"),
    (dict(segment_ids=np.zeros((2, 16), np.int32), kv_segment_ids=np.zeros((2, 16), np.int32)),
     "not both"),
])
def test_bad_segment_ids_name_the_argument(kwargs, match):
    q = jnp.zeros((2, 16, 2, 8))
    kwargs = {key: jnp.asarray(val) for key, val in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        kernels.attend(q, q, q, implementation="xla", **kwargs)


def test_segment_ids_need_equal_lengths_and_cudnn_refuses():
    q, k = jnp.zeros((1, 8, 2, 8)), jnp.zeros((1, 12, 2, 8))
    with pytest.raises(ValueError, match="q_segment_ids .B, T. and kv_segment_ids"):
        kernels.attend(q, k, k, implementation="xla", segment_ids=jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="'cudnn' needs a GPU"):  # the decisive reason on this host
        kernels.attend(q, q, q, implementation="cudnn", segment_ids=jnp.zeros((1, 8), jnp.int32))
    on_gpu = kernels.Request.of(("gpu", "a test"), jnp.bfloat16, 8, segment_ids=True)
    assert "'cudnn' cannot take segment ids" in kernels.refusal("cudnn", on_gpu)


_SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tests.kernel_calls import flash_attention
sh = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
q = jax.device_put(jnp.ones((8, 64, 2, 8)), sh)
ids = jax.device_put(jnp.zeros((8, 64), jnp.int32), sh)
loss = lambda q_, s_: jnp.sum(flash_attention(q_, q_, q_, q_segment_ids=s_, kv_segment_ids=s_,
                                              block_q=16, block_k=16, bwd_block_q=16, bwd_block_k=16))
print("ALLGATHERS", jax.jit(jax.grad(loss)).lower(q, ids).compile().as_text().count("all-gather"))
"""


@pytest.mark.slow(reason="compiles the flash kernel sharded over 8 fake devices")
def test_flash_segments_keep_a_sharded_batch_local():
    # With several devices the default runs the examples together: a loop over a batch sharded
    # over 'data' would make XLA all-gather it (every device computing every example).
    from tests.config_helpers import run_on_fake_devices

    assert run_on_fake_devices(_SHARDED, timeout=300).split("ALLGATHERS ")[-1].strip() == "0"
