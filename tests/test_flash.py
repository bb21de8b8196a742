"""The memory-efficient kernel (``goat_jax.kernels.flash``, ``implementation='flash'``): forward and
gradients against the hand-written float64 reference, masking edge cases, dtypes, memory."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernel_calls import flash_attention
from goat_jax import kernels
from tests import goat_reference as ref
from tests.config_helpers import run_on_fake_devices


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def _inputs(rng, b, t, s, n, kh, hqk, hv, dtype=jnp.float32):
    q = rng.normal(size=(b, t, n, hqk))
    k = rng.normal(size=(b, s, kh, hqk))
    v = rng.normal(size=(b, s, kh, hv))
    ct = rng.normal(size=(b, t, n, hv))
    return (q, k, v, ct), tuple(jnp.asarray(x, dtype) for x in (q, k, v, ct))


def _value_and_grads(f, q, k, v, ct):
    """out and (dq, dk, dv) of loss = sum(out * ct), in one jit (one compilation)."""
    def run(q_, k_, v_, ct_):
        out, vjp = jax.vjp(f, q_, k_, v_)
        return out, vjp(ct_.astype(out.dtype))
    return jax.jit(run)(q, k, v, ct)


# name: (B, T, S, N, K, Hqk, Hv, attend kwargs, flash block sizes)
CASES = {
    # Lengths that are not multiples of the blocks, GQA, Hqk != Hv (GOAT's packed channels).
    "causal_gqa_ragged": (2, 37, 37, 4, 2, 12, 8, dict(is_causal=True), dict(block_q=16, block_k=8)),
    # Decode-like: a few queries against a longer cache, causal offset = cache index.
    "decode_mqa_offset": (2, 5, 41, 4, 1, 8, 8, dict(is_causal=True, causal_offset=36), dict(block_q=8, block_k=16)),
    "bidir_padding": (2, 24, 30, 2, 2, 8, 16, dict(is_causal=False, pad=True), dict(block_q=8, block_k=8)),
    "causal_kv_lengths": (2, 20, 20, 4, 2, 8, 8, dict(is_causal=True, lengths=(20, 13)), dict(block_q=8, block_k=8)),
    # Prefill chunk at a cache offset with right padding; backward blocks differ from forward.
    "chunk_offset_padding": (2, 16, 40, 2, 1, 8, 4, dict(is_causal=True, causal_offset=20, pad=True),
                             dict(block_q=16, block_k=16, bwd_block_q=8, bwd_block_k=24)),
    # Default blocks (one block per sequence here).
    "default_blocks": (1, 50, 50, 2, 2, 16, 16, dict(is_causal=True), dict()),
}


def _case(name, rng):
    b, t, s, n, kh, hqk, hv, call, blocks = CASES[name]
    call = dict(call)
    kw = dict(scale=float(hqk) ** -0.5, is_causal=call["is_causal"], causal_offset=call.get("causal_offset", 0))
    if call.get("pad"):
        kpm = np.zeros((b, s), bool)
        kpm[0, -5:] = True  # right padding
        kpm[1, :3] = True  # left padding (bidirectional) / early keys dropped
        kw["key_padding_mask"] = kpm
    if "lengths" in call:
        kw["kv_lengths"] = np.asarray(call["lengths"], np.int32)
    return (b, t, s, n, kh, hqk, hv), kw, blocks


@pytest.mark.parametrize("implementation", ["flash", "xla", "dense"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_value_and_grads_match_float64_reference(name, implementation, rng):
    dims, kw, blocks = _case(name, rng)
    (q, k, v, ct), jx = _inputs(rng, *dims)
    want = ref.attention_and_grads(q, k, v, ct, **kw)
    jkw = {key: (jnp.asarray(val) if isinstance(val, np.ndarray) else val) for key, val in kw.items()}
    if implementation == "flash":
        f = lambda q_, k_, v_: flash_attention(q_, k_, v_, **jkw, **blocks)
    else:
        f = lambda q_, k_, v_: kernels.attend(q_, k_, v_, implementation=implementation, **jkw)
    # Full float32 matmuls: on a GPU, XLA's default precision for float32 is TF32 (~1e-3).
    with jax.default_matmul_precision("highest"):
        out, grads = _value_and_grads(f, *jx)
    assert out.shape == want[0].shape and out.dtype == jnp.float32
    for got, exp, what in zip((out,) + tuple(grads), want, ("out", "dq", "dk", "dv")):
        assert _rel_err(got, exp) <= 1e-5, what


def test_traced_offset_equals_static_and_skips_nothing_visible(rng):
    """A KV-cache index is traced under jit; the (dynamic) block skipping must agree."""
    (q, k, v, ct), jx = _inputs(rng, 1, 6, 64, 2, 2, 8, 8)
    f = jax.jit(lambda q_, k_, v_, off: flash_attention(q_, k_, v_, is_causal=True, causal_offset=off,
                                                              block_q=8, block_k=16))
    for off in (0, 17, 58):
        want = ref.attention_and_grads(q, k, v, ct, is_causal=True, causal_offset=off)[0]
        assert _rel_err(f(*jx[:3], jnp.int32(off)), want) <= 1e-5


def test_rows_with_no_visible_key_are_zero_with_zero_gradient(rng):
    (q, k, v, ct), jx = _inputs(rng, 2, 12, 12, 2, 1, 8, 8)
    kpm = np.zeros((2, 12), bool)
    kpm[1] = True  # example 1: every key is padding
    kw = dict(is_causal=True, causal_offset=-4)  # rows 0-3 of example 0 see no key either
    f = lambda q_, k_, v_: flash_attention(q_, k_, v_, key_padding_mask=jnp.asarray(kpm), block_q=8,
                                                 block_k=8, **kw)
    out, (dq, dk, dv) = _value_and_grads(f, *jx)
    assert np.all(np.asarray(out[1]) == 0) and np.all(np.asarray(out[0, :4]) == 0)
    assert np.all(np.asarray(dq[1]) == 0) and np.all(np.asarray(dq[0, :4]) == 0)
    assert np.all(np.asarray(dk[1]) == 0) and np.all(np.asarray(dv[1]) == 0)
    want = ref.attention_and_grads(q, k, v, ct, key_padding_mask=kpm, **kw)
    for got, exp in zip((out, dq, dk, dv), want):
        assert np.isfinite(np.asarray(got)).all()
        assert _rel_err(got, exp) <= 1e-5


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs(dtype, rng):
    (q, k, v, ct), jx = _inputs(rng, 1, 40, 40, 4, 2, 16, 8, dtype=dtype)
    # The bar is the inputs' rounding: compare with float64 attention on the rounded inputs.
    rounded = [np.asarray(x.astype(jnp.float32), np.float64) for x in jx]
    want = ref.attention_and_grads(*rounded, scale=0.25, is_causal=True)
    f = lambda q_, k_, v_: flash_attention(q_, k_, v_, scale=0.25, is_causal=True, block_q=16, block_k=16)
    out, grads = _value_and_grads(f, *jx)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    for got, exp in zip((out,) + tuple(grads), want):
        assert _rel_err(got.astype(jnp.float32), exp) <= 2e-2


def test_compiled_memory_is_linear_not_quadratic():
    """Forward+backward at L = 2048 (B=1, 4 heads): XLA keeps T x S logits/probabilities, the
    flash kernel only tiles (compiled memory, nothing is run)."""
    length, n, h = 2048, 4, 32
    x = jax.ShapeDtypeStruct((1, length, n, h), jnp.float32)

    def memory(implementation):
        loss = lambda q, k, v: jnp.sum(kernels.attend(q, k, v, implementation=implementation, scale=0.2,
                                                      is_causal=True))
        m = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile().memory_analysis()
        return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes

    logits_bytes = n * length * length * 4
    xla, fl = memory("xla"), memory("flash")
    assert xla >= logits_bytes  # the quadratic buffer is there ...
    assert fl * 8 <= xla  # ... and the flash kernel is far below it
    assert fl <= 16 * 4 * length * n * h * 4  # a few dozen O(L) buffers, nothing quadratic


def test_automatic_choice_uses_flash_above_threshold():
    if jax.default_backend() != "cpu":
        pytest.skip("the threshold rule is checked on CPU")
    small = (1, 8, 512, 512)  # 8 MiB of float32 logits
    large = (1, 8, 1024, 1024)  # 32 MiB
    assert kernels.resolve_implementation(None, jnp.float32, 64, logits_shape=small) == "xla"
    assert kernels.resolve_implementation(None, jnp.float32, 64, logits_shape=large) == "flash"
    assert kernels.resolve_implementation(None, jnp.float32, 64) == "xla"  # shape unknown
    assert kernels.resolve_implementation("flash", jnp.bfloat16, 300) == "flash"


def test_bad_block_size_names_the_argument(rng):
    _, jx = _inputs(rng, 1, 8, 8, 2, 2, 8, 8)
    with pytest.raises(ValueError, match="block sizes must be >= 1"):
        flash_attention(*jx[:3], block_k=0)


_SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from goat_jax import kernels
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.normal(size=(8, 40, 4, 16)), jnp.float32) for _ in range(3))
kpm = jnp.asarray(rng.random((8, 40)) < 0.2)
sh = NamedSharding(mesh, P("data", None, "tensor", None))
loss = lambda a, b, c, m: jnp.sum(kernels.attend(a, b, c, implementation="flash", scale=0.25, is_causal=True,
                                                 key_padding_mask=m) ** 2)
f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
(l1, g1) = f(*(jax.device_put(x, sh) for x in (q, k, v)), jax.device_put(kpm, NamedSharding(mesh, P("data"))))
(l2, g2) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v, kpm)  # one device
assert len(jax.devices()) == 8 and g1[0].sharding.spec == P("data", None, "tensor", None), g1[0].sharding
err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max()) for a, b in zip(g1, g2))
print("RESULT", abs(float(l1) - float(l2)) / abs(float(l2)), err)
"""


def test_flash_under_batch_and_head_sharding():
    """8 fake CPU devices, batch over 'data' and heads over 'tensor': same value and gradients
    as the unsharded kernel, and the gradients keep the inputs' sharding."""
    loss_err, grad_err = map(float, run_on_fake_devices(_SHARDED, timeout=300).split("RESULT ")[-1].split())
    assert loss_err <= 1e-6 and grad_err <= 1e-6
