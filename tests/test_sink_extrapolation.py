"""PriorSettings.sink_extrapolation='linear': the sink continued linearly past training_seq_len.

The float64-reference checks of the option (xla, flash and dense kernels, GQA with position
offsets; gradients against finite differences, marked slow) live with the rest of the prior's
in tests/test_attention.py; here: what the option promises on top (docs/extrapolation.md).
"""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import lm_tiny
from goat_jax import interop
from goat_jax import prior as prior_lib
from goat_jax.models import lm
from goat_jax.tasks import lm as lm_task
from tests import jitted
from tests.test_attention import E, make_module_and_params

L = 8  # training_seq_len of these tests


def _pair(rng, length, randomize, implementation="xla"):
    """The same parameters under 'official' and 'linear' modules."""
    official, params = make_module_and_params(rng, length, kv_num_heads=2, training_seq_len=L,
                                              implementation=implementation)
    if not randomize:  # the official initialization, as a training run starts
        x = jnp.zeros((1, length, E))
        params = flax.core.meta.unbox(jitted.init(official, jax.random.key(int(rng.integers(1 << 30))), x))
    linear = official.clone(prior=prior_lib.PriorSettings(
        pos_rank=4, abs_rank=4, training_seq_len=L, sink_extrapolation="linear"))
    return official, linear, params


@pytest.mark.parametrize("randomize", [pytest.param(False, marks=pytest.mark.slow(reason="the randomized parameters include the init case")), True])
def test_training_length_outputs_are_identical(randomize, rng):
    """Up to training_seq_len keys the option is the official prior, bit for bit: at init and
    after any training; past it the outputs differ (causal rows, so the first L agree)."""
    official, linear, params = _pair(rng, 2 * L, randomize)
    x = jnp.asarray(rng.normal(size=(2, 2 * L, E)), jnp.float32)
    for length in (L // 2, L):
        np.testing.assert_array_equal(linear.apply(params, x[:, :length], is_causal=True),
                                      official.apply(params, x[:, :length], is_causal=True))
    a = np.asarray(official.apply(params, x, is_causal=True))
    b = np.asarray(linear.apply(params, x, is_causal=True))
    np.testing.assert_array_equal(b[:, :L], a[:, :L])
    if randomize:  # at init the sink MLP is ~1e-6 and both continuations agree to rounding
        assert np.abs(b[:, L:] - a[:, L:]).max() > 1e-3


@pytest.mark.slow(reason="decodes token by token across the window end (~20 s of an idle core); the KV cache equals the full forward in tests/test_lm.py and tests/test_sampling.py")
def test_kv_cache_decoding_across_the_window_end(rng):
    """A prefill inside the window, then a chunk that crosses ``training_seq_len``: the cached
    keys and the new ones get the same continued sink as the full forward."""
    _, linear, params = _pair(rng, 2 * L, randomize=True)
    x = jnp.asarray(rng.normal(size=(2, 2 * L, E)), jnp.float32)
    full = linear.apply(params, x, is_causal=True)
    dec = linear.clone(decode=True)
    cache = dec.init(jax.random.key(0), x, is_causal=True)["cache"]
    outs = []
    for start, stop in [(0, L - 2), (L - 2, 2 * L)]:
        out, mutated = dec.apply({**params, "cache": cache}, x[:, start:stop], is_causal=True, mutable=["cache"])
        cache = mutated["cache"]
        outs.append(out)
    got = np.asarray(jnp.concatenate(outs, axis=1), np.float64)
    assert np.abs(got - np.asarray(full)).max() <= 1e-5 * np.abs(np.asarray(full)).max()


def test_log_prior_is_translation_invariant_past_the_window(rng):
    """With a linear u, shifting a query and all its keys past the window by d only adds a row
    constant to the log-prior (what softmax ignores), so the prior a query sees far away is the
    one it sees just past the window; the official sink MLP gives no such guarantee."""
    _, params = make_module_and_params(rng, 4, kv_num_heads=2, training_seq_len=L)
    prior = jax.tree.map(np.asarray, params["params"]["prior"])
    for mode, invariant in (("linear", True), ("official", False)):
        spec = prior_lib.PriorSpec(num_heads=4, kv_num_heads=2, pos_rank=4, abs_rank=4,
                                   training_seq_len=L, sink_extrapolation=mode)

        def rows(shift):  # one query at L + 5 + shift over its 6 nearest keys, all past e = L - 1
            lp = prior_lib.log_prior(spec, prior, prior_lib.positions_1d(1, L + 5 + shift),
                                     prior_lib.positions_1d(6, L + shift), is_causal=True)
            return np.asarray(lp, np.float64)[0, :, 0, :]  # [N, 6]

        diff = rows(0) - rows(37)  # [N, 6]
        spread = np.abs(diff - diff[:, :1]).max()
        assert (spread <= 1e-4) == invariant, (mode, spread)


def test_sink_mlp_values_follow_the_secant(rng):
    """Written-out values: inside the window the official MLP, past it the line through the
    MLP's values at e - L // 2 and e (e = L - 1), including explicit non-contiguous positions."""
    _, params = make_module_and_params(rng, 4, training_seq_len=L)
    mlp = jax.tree.map(np.asarray, params["params"]["prior"]["key_bias"])
    lin = prior_lib.PriorSpec(num_heads=4, kv_num_heads=4, pos_rank=4, abs_rank=4, training_seq_len=L,
                              sink_extrapolation="linear")
    off = prior_lib.PriorSpec(num_heads=4, kv_num_heads=4, pos_rank=4, abs_rank=4, training_seq_len=L)
    t = np.array([0, 3, L - 1, L, L + 1, 5 * L, 300])
    pos = prior_lib.positions_1d(len(t), positions=t)
    got = np.asarray(prior_lib.sink_mlp_values(lin, mlp, pos), np.float64)
    official = np.asarray(prior_lib.sink_mlp_values(off, mlp, pos), np.float64)
    anchors = np.asarray(prior_lib.sink_mlp_values(
        off, mlp, prior_lib.positions_1d(2, positions=np.array([L - 1 - L // 2, L - 1]))), np.float64)
    slope = (anchors[1] - anchors[0]) / (L // 2)
    want = np.where(t > L - 1, anchors[1] + slope * (t - (L - 1)), official)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[:3], official[:3])


def test_errors_name_the_fix(rng):
    with pytest.raises(ValueError, match="needs training_seq_len >= 2"):
        prior_lib.PriorSettings(sink_extrapolation="linear")
    with pytest.raises(ValueError, match=r"PriorSettings.sink_extrapolation='clamp' is not allowed: allowed is one of \['official', 'linear'\]"):
        prior_lib.PriorSettings(sink_extrapolation="clamp", training_seq_len=8)
    spec = prior_lib.PriorSpec(num_heads=2, kv_num_heads=2, pos_rank=2, abs_rank=2,
                               training_seq_len=8, sink_extrapolation="linear")
    with pytest.raises(ValueError, match="defined for 1D positions"):
        prior_lib.sink_mlp_values(spec, {}, prior_lib.positions_2d((2, 3), has_cls=False))
    with pytest.raises(ValueError, match="'linear_sink' is an option of GOAT's sink"):
        lm_tiny.get_config("rope,linear_sink")
    _, linear, params = _pair(rng, 4, randomize=False)
    with pytest.raises(ValueError, match="no counterpart in the official package"):
        interop.to_official(linear, params)


def test_lm_tiny_config_argument_turns_it_on():
    """``configs/lm_tiny.py:goat,linear_sink`` (the tiny suite's ablation row) sets the option and
    nothing else; the model reads it through PriorSettings."""
    on, off = lm_tiny.get_config("goat,linear_sink"), lm_tiny.get_config("goat")
    assert on.model.sink_extrapolation == "linear" and off.model.sink_extrapolation == "official"
    on.model.sink_extrapolation = "official"
    assert on.to_dict() == off.to_dict()
    model_cfg = lm_task.model_config(lm_tiny.get_config("goat,linear_sink"))
    assert model_cfg.prior.sink_extrapolation == "linear" and model_cfg.prior.training_seq_len == 128
