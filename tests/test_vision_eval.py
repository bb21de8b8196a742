"""goat_jax.eval.vision: the 2D log-prior against a float64 NumPy reference, the shift-invariance
measure, top-1 across resolutions, and the figures."""

import math

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax.eval import vision
from goat_jax.reproduce import stats
from goat_jax.models.vit import ViT, ViTConfig

CFG = ViTConfig(image_size=16, patch_size=4, channels=1, num_layers=1, embed_dim=32, num_heads=2, mlp_dim=32,
                num_classes=3, pos_rank=3, abs_rank=2, drop_path_rate=0.0, position_encoding="goat")


def _params(rng, sink=True):
    model = ViT(CFG)
    p = flax.core.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 1))))["params"]
    prior = p["block_0"]["attention"]["prior"]
    for name in ("lambda_sym", "lambda_asym") + (("sink_gain", "sink_bump") if sink else ()):
        prior[name] = jnp.asarray(rng.standard_normal(prior[name].shape), jnp.float32)
    if sink:
        prior["key_bias"] = jax.tree_util.tree_map(
            lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32), prior["key_bias"])
    return model, p


def _reference(prior, grid):
    """Head-mean log-prior over patch pairs, float64, from the formulas in docs/layer.md / the paper."""
    r_total, m = CFG.pos_rank, CFG.abs_rank
    w_rel = 10_000.0 ** (-np.arange(r_total) / max(r_total - 1, 1))
    w_abs = 10_000.0 ** (-np.arange(m) / max(m - 1, 1))
    r_rows = r_total - r_total // 2
    lam_s, lam_a = np.asarray(prior["lambda_sym"], np.float64), np.asarray(prior["lambda_asym"], np.float64)
    kb = {k: {n: np.asarray(v, np.float64) for n, v in d.items()} for k, d in prior["key_bias"].items()}
    gain = np.asarray(prior["sink_gain"], np.float64)
    h, w = grid
    length = h * w + 1
    coords = [(i // w, i % w) for i in range(h * w)]
    heads = lam_s.shape[0]
    out = np.zeros((heads, h * w, h * w))
    for n in range(heads):
        for qi, (qr, qc) in enumerate(coords):
            for ki, (kr, kc) in enumerate(coords):
                kappa = 0.0
                for r in range(r_total):
                    d = (qr - kr) if r < r_rows else (qc - kc)
                    kappa += lam_s[n, r] * math.cos(w_rel[r] * d) + lam_a[n, r] * math.sin(w_rel[r] * d)
                t = ki + 1  # sequence index of the key (CLS is 0)
                # 2D: the sink's Fourier inputs split the M frequencies between row and column too
                m_rows = m - m // 2
                phase = np.concatenate([w_abs[:m_rows] * kr, w_abs[m_rows:] * kc])
                feats = np.concatenate([np.cos(phase), np.sin(phase),
                                        [t / (length - 1), math.log1p(t) / math.log1p(length - 1)]])
                hidden = feats @ kb["fc1"]["kernel"] + kb["fc1"]["bias"]
                hidden = hidden / (1 + np.exp(-hidden))  # SiLU
                u = gain[n] * float(hidden @ kb["fc2"]["kernel"][:, 0] + kb["fc2"]["bias"][0])
                out[n, qi, ki] = kappa + u  # the bump is on key 0 (CLS), dropped here
    return out.mean(axis=0).reshape(h, w, h, w)


def test_patch_log_prior_matches_float64_reference(rng):
    _, p = _params(rng)
    got = vision.patch_log_prior(p, CFG, (3, 4))
    want = _reference(p["block_0"]["attention"]["prior"], (3, 4))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(vision.centre_log_prior(p, CFG, (3, 4)), want[1, 2], atol=1e-4 * np.abs(want).max())


@pytest.mark.slow(reason="builds and evaluates ViT priors on several grids")
def test_shift_invariance_measures_the_sink(rng):
    _, p = _params(rng, sink=False)  # uniform init keeps u = 0: only kappa, exactly relative
    assert vision.shift_invariance_error(p, CFG, (6, 7), shift=(2, 3)) < 1e-5
    _, p = _params(rng, sink=True)
    assert vision.shift_invariance_error(p, CFG, (6, 7), shift=(2, 3)) > 1e-3
    with pytest.raises(ValueError, match="shift"):
        vision.shift_invariance_error(p, CFG, (6, 7), shift=(6, 0))
    with pytest.raises(ValueError, match="GOAT ViT"):
        vision.patch_log_prior(p, ViTConfig(**{**CFG.__dict__, "position_encoding": "ape"}), (2, 2))


@pytest.mark.slow(reason="evaluates a ViT at several resolutions")
def test_evaluate_resolutions_counts_weights(rng, tmp_path):
    model, p = _params(rng)
    p["head"]["bias"] = jnp.asarray([0.0, 50.0, 0.0])  # always predicts class 1

    def make_eval_at(r):
        for labels, weights in (([1, 1, 0, 2], [1, 1, 1, 1]), ([1, 0, 0, 0], [1, 1, 0, 0])):
            yield {"image": rng.standard_normal((4, r, r, 1)).astype(np.float32),
                   "label": np.asarray(labels, np.int32), "weights": np.asarray(weights, np.float32)}

    res = vision.evaluate_resolutions(model, p, make_eval_at, [16, 32], log=lambda s: None)
    for r in (16, 32):
        assert res[r]["images"] == 6 and res[r]["top1"] == pytest.approx(3 / 6)
        assert res[r]["loss"] > 0
    with pytest.raises(ValueError, match=r"\[18\] are not divisible by the model's patch_size=4"):
        vision.evaluate_resolutions(model, p, make_eval_at, [16, 18])
    vision.plot_resolutions({"goat": res, "ape": res}, str(tmp_path / "res.png"), train_resolution=16)
    over_seeds = {r: {"top1": stats.Estimate([0.4, 0.6, 0.5])} for r in (16, 32)}
    vision.plot_resolutions({"goat": over_seeds, "ape": over_seeds}, str(tmp_path / "seeds.png"),
                            train_resolution=16, xlabel="canvas size (px)")
    assert (tmp_path / "seeds.png").stat().st_size > 1000
    vision.plot_log_prior(vision.centre_log_prior(p, CFG, (5, 5)), str(tmp_path / "prior.png"))
    assert (tmp_path / "res.png").stat().st_size > 1000 and (tmp_path / "prior.png").stat().st_size > 1000


def test_dodge_spreads_lines_with_error_bars_around_the_true_x():
    """Six lines over sizes 28..84 px: offsets centred on 0, at most a tenth of the smallest
    gap (14 px) either way, distinct; none without error bars or with a single line."""
    dx = vision.dodge(6, [28, 42, 56, 84], with_bars=True)
    assert len(dx) == 6 and sum(dx) == pytest.approx(0.0) and len(set(dx)) == 6
    assert max(abs(d) for d in dx) == pytest.approx(14 / 10)
    assert vision.dodge(6, [28, 42], with_bars=False) == [0.0] * 6
    assert vision.dodge(1, [28, 42], with_bars=True) == [0.0]
