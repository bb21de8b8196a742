"""The official C4 diagnostics (goat_jax.eval.diagnostics): last-layer attention statistics on
patterns with known answers and against the full-window attention maps, u(j) curves against
the float64 reference, and the evaluate wiring (tables, PNG, argument errors)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax.eval import diagnostics, sinks
from tests import goat_reference as ref
from tests.test_chunked_eval import V, W, random_lm

R = 4  # "last R keys" at these small shapes


def flatten_last_layer(params):
    """Last layer (of 2): content logits 0 (q_proj zero) and a flat prior (no kappa, u = 0, no
    recency): every query attends uniformly to its visible keys, whatever the input."""
    att = params["layer_1"]["attention"]
    att["q_proj"]["kernel"] = jnp.zeros_like(att["q_proj"]["kernel"])
    pr = att["prior"]
    for name in ("lambda_sym", "lambda_asym", "sink_bump"):
        pr[name] = jnp.zeros_like(pr[name])
    pr["key_bias"]["fc2"] = jax.tree_util.tree_map(jnp.zeros_like, pr["key_bias"]["fc2"])
    pr["recency_slope_raw"] = jnp.full_like(pr["recency_slope_raw"], -60.0)  # softplus ~ 1e-26
    return params


def test_last_layer_statistics_known_patterns_and_full_maps(rng):
    model, params = random_lm(rng, position_encoding="goat", training_seq_len=8)
    tokens = rng.integers(0, V, (2, W))
    stats = lambda p: diagnostics.last_layer_attention_stats(model, p, tokens, chunk_size=5, recent=R)

    # A random model: the chunked statistics equal those of the full-window attention maps.
    probs = sinks.attention_maps(model, params, tokens)["probs"][-1][:, :, 1:]  # [B, N, W-1, S]
    i, j = np.arange(1, W)[:, None], np.arange(W)[None, :]
    got = stats(params)
    np.testing.assert_allclose(got["first_mass"], probs[..., 0].mean((0, 2)), rtol=1e-5)
    np.testing.assert_allclose(got["max_weight"], probs.max(-1).mean((0, 2)), rtol=1e-5)
    np.testing.assert_allclose(got["recent_mass"], (probs * (j > i - R)).sum(-1).mean((0, 2)), rtol=1e-5)
    assert got["num_queries"] == 2 * (W - 1)

    # Uniform attention: p(i, j) = 1 / (i + 1) for j <= i.
    flat = flatten_last_layer(jax.tree_util.tree_map(lambda x: x, params))
    got = stats(flat)
    q = np.arange(1, W, dtype=np.float64)
    np.testing.assert_allclose(got["first_mass"], np.mean(1 / (q + 1)), rtol=1e-5)
    np.testing.assert_allclose(got["max_weight"], np.mean(1 / (q + 1)), rtol=1e-5)
    np.testing.assert_allclose(got["recent_mass"], np.mean(np.minimum(R, q + 1) / (q + 1)), rtol=1e-5)

    # A sink at token 0 (u(0) + 40 nats): all mass on token 0, which is among the last R keys
    # only for queries 1..R-1.
    flat["layer_1"]["attention"]["prior"]["sink_bump"] = jnp.full((2,), 40.0)
    got = stats(flat)
    np.testing.assert_allclose(got["first_mass"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(got["max_weight"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(got["recent_mass"], (R - 1) / (W - 1), atol=1e-6)

    with pytest.raises(ValueError, match="recent must be an integer >= 1"):
        diagnostics.last_layer_attention_stats(model, params, tokens, recent=0)
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1"):
        diagnostics.last_layer_attention_stats(model, params, tokens, chunk_size=-1)


def test_sink_curves_equal_the_float64_reference(rng):
    model, params = random_lm(rng, position_encoding="goat", training_seq_len=8, kv_num_heads=1)
    curves = diagnostics.sink_curves(model, params, 40)  # 5x the training length
    no_slope = diagnostics.sink_curves(model, params, 40, recency=False)
    assert curves.shape == no_slope.shape == (2, 2, 40)
    cfg = dict(num_heads=2, kv_num_heads=1, abs_rank=2, training_seq_len=8)
    k = np.arange(40, dtype=np.float64)
    for layer in range(2):
        p = ref.unboxed({"params": params[f"layer_{layer}"]["attention"]["prior"]})
        want = ref.sink_prior(p, cfg, k, k, np.zeros(40, bool), None, True)  # [K, S]
        np.testing.assert_allclose(curves[layer], np.repeat(want, 2, axis=0), rtol=1e-5, atol=1e-5)
        want = ref.sink_prior(p, cfg, k, k, np.zeros(40, bool), None, False)  # no recency slope
        np.testing.assert_allclose(no_slope[layer], np.repeat(want, 2, axis=0), rtol=1e-5, atol=1e-5)
    pos = diagnostics.curve_positions(5000, 64)
    assert pos[0] == 0 and pos[-1] == 4999 and len(pos) <= 64 and np.all(np.diff(pos) > 0)
    np.testing.assert_array_equal(diagnostics.curve_positions(10), np.arange(10))


def test_eval_diagnostics_tables_and_png(tmp_path):
    from configs import lm_tiny
    from goat_jax.eval import runs
    from tests.config_helpers import random_lm_run

    path = tmp_path / "doc.txt"
    path.write_text("Held-out text for the diagnostics, long enough for windows. " * 12)
    config = lm_tiny.get_config("goat,smoke")
    config.seq_len = 16
    config.data.paths, config.data.eval_paths, config.data.doc_split = [str(path)], [str(path)], "files"
    config.data.bos_windows = True
    run = random_lm_run(tmp_path, config)
    res = runs.evaluate_run(run, ["diagnostics"], (1, 4), chunk_size=8,
                            diagnostics_options={"num_windows": 2, "recent": 4})["diagnostics"]
    assert sorted(res["by_length"]) == [16, 64] and res["recent_keys"] == 4
    for row in res["by_length"].values():
        assert row["windows"] == 2 and len(row["first_mass"]) == config.model.num_heads
        assert 0 < row["first_mass_mean"] <= row["recent_mass_mean"] + 1 and 0 < row["max_weight_mean"] <= 1
    assert np.asarray(res["u_curves"]["u"]).shape == (1, config.model.num_heads, 64)
    md = runs.write_outputs({"goat": {"diagnostics": res}}, str(tmp_path / "out"), {"goat": 16})
    assert "mass on token 0" in md and "mass on the last 4 keys" in md
    for name in ("u_curves_goat.png", "u_mlp_curves_goat.png"):
        assert os.path.getsize(tmp_path / "out" / name) > 0


@pytest.mark.parametrize("evals,flag,value,match", [
    ("extrapolation,diagnostics", "--chunk_size", "0", "--chunk_size must be >= 1"),
    ("extrapolation,diagnostics", "--num_windows", "0", "--num_windows must be >= 1"),
    ("diagnostics", "--recent_keys", "-1", "--recent_keys must be >= 1"),
    ("passkey", "--chunk_size", "512", "--chunk_size applies to --evals extrapolation and diagnostics"),
    ("extrapolation", "--recent_keys", "64", "--recent_keys applies to --evals diagnostics only")])
def test_evaluate_refuses_bad_or_unused_arguments(tmp_path, evals, flag, value, match):
    from experiments import evaluate
    with pytest.raises(ValueError, match=match):
        evaluate.main(["--workdir", str(tmp_path), "--evals", evals, flag, value])
