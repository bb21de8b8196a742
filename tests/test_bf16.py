"""bfloat16 at long context: the packed sink keeps the log-prior accurate at any position.

The official package rounds ``u(j)`` (which holds the causal recency term ``slope * j``) to one
bf16 channel; at j ~ 16k that is off by up to 16 logits. goat_jax splits it exactly over three
bf16 channels. The test runs a seeded-init causal layer over 16384 positions (queries in
chunks, keys all 16384) and checks the mean relative output error vs float32 over every window
of 100 consecutive query positions; the same layer with a single sink channel must fail it,
so the test can tell the two apart. The default suite scores three of the eight query chunks
(the first, one in the middle and the last, where the sink term is largest); the slow case all
of them.
"""

import jax
import pytest
import jax.numpy as jnp
import numpy as np

from tests import goat_reference, jitted
from tests.marks import SLOW_CASE

LENGTH, CHUNK, E = 16384, 2048, 128


ALL_CHUNKS = tuple(range(0, LENGTH, CHUNK))
SAMPLED_CHUNKS = (0, LENGTH // 2, LENGTH - CHUNK)  # first, middle, last (largest j)


def _outputs(module, params, x, dtype, chunks):
    """[len(chunks) * CHUNK, E] float64 outputs of the query chunks starting at ``chunks``."""
    f = jax.jit(lambda xq, xk, off: module.apply(
        params, xq, xk, xk, is_causal=True, position_offset_q=off, position_offset_k=0))
    outs = [f(x[:, c:c + CHUNK].astype(dtype), x.astype(dtype), c) for c in chunks]
    return np.asarray(jnp.concatenate(outs, axis=1).astype(jnp.float32), np.float64)[0]


def _window_errors(out, ref):
    """Mean relative error over every 100 consecutive query positions of each chunk (windows
    never straddle two sampled chunks)."""
    err = np.linalg.norm(out - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    return np.concatenate([np.convolve(e, np.ones(100) / 100, mode="valid")
                           for e in err.reshape(-1, CHUNK)])


@pytest.mark.parametrize("chunks", [SAMPLED_CHUNKS, pytest.param(ALL_CHUNKS, marks=SLOW_CASE)],
                         ids=["sampled", "all"])
def test_bf16_mean_relative_error_below_one_percent_up_to_16k(rng, chunks):
    module = goat_reference.goat_module(num_heads=2, pos_rank=4, abs_rank=4, training_seq_len=1024,
                                        prior_init="seeded", implementation="xla")
    x = jnp.asarray(rng.normal(size=(1, LENGTH, E)), jnp.float32)
    params = jitted.init(module, jax.random.key(int(rng.integers(1 << 30))), x[:, :16], is_causal=True)
    ref = _outputs(module, params, x, jnp.float32, chunks)
    ours = _window_errors(_outputs(module.clone(dtype=jnp.bfloat16), params, x, jnp.bfloat16, chunks), ref)
    assert ours.max() <= 0.01, (ours.max(), int(ours.argmax()))
    single = _window_errors(_outputs(module.clone(dtype=jnp.bfloat16, sink_channels=1), params, x,
                                     jnp.bfloat16, chunks), ref)
    assert single[-1000:].mean() > 0.05  # the official one-channel packing breaks down
