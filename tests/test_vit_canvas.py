"""The canvas protocol's evaluation images and the kappa / u split of GOAT's 2D prior
(goat_jax/eval/canvas.py), against plain float64 references."""

import numpy as np
import pytest

from goat_jax.eval import canvas


def test_paste_puts_the_unchanged_image_at_patch_aligned_offsets(rng):
    images = rng.normal(size=(5, 28, 28, 1)).astype(np.float32)
    offsets = canvas.canvas_offsets(5, 28, 56, 7, np.random.default_rng(0))
    assert (offsets % 7 == 0).all() and offsets.min() >= 0 and offsets.max() <= 28
    out = canvas.paste(images, 56, offsets, [-0.5])
    for i, (r, c) in enumerate(offsets):
        ref = np.full((56, 56, 1), -0.5, np.float32)
        ref[r:r + 28, c:c + 28] = images[i]
        np.testing.assert_array_equal(out[i], ref)
    with pytest.raises(ValueError, match="canvas 50 px: needs canvas >= image 28 px"):
        canvas.canvas_offsets(1, 28, 50, 7, np.random.default_rng(0))


def test_canvas_batches_are_the_same_for_every_run():
    batches = [{"image": np.ones((3, 8, 8, 1), np.float32) * i, "label": np.arange(3)} for i in range(2)]
    make = canvas.make_canvas_eval(lambda r: iter(batches), 8, 4, [0.0], seed=3)
    a, b = list(make(16)), list(make(16))
    assert all(np.array_equal(x["image"], y["image"]) for x, y in zip(a, b))
    assert a[1]["image"].shape == (3, 16, 16, 1) and a[1]["image"].sum() == 3 * 64  # the object, intact
    assert canvas.background_fill([0.25], [0.5]) == [-0.5]


def _compose(kappa, u):
    h, w = u.shape
    p = np.empty((h, w, h, w))
    for qi in range(h):
        for qj in range(w):
            for ki in range(h):
                for kj in range(w):
                    p[qi, qj, ki, kj] = kappa[qi - ki + h - 1, qj - kj + w - 1] + u[ki, kj]
    return p


def test_decompose_recovers_kappa_and_u_and_matches_least_squares(rng):
    h, w = 3, 4
    kappa, u = rng.normal(size=(2 * h - 1, 2 * w - 1)), rng.normal(size=(h, w))
    u -= u.mean()
    d = canvas.decompose_prior(_compose(kappa, u), iterations=500)
    np.testing.assert_allclose(d["u"], u, atol=1e-8)
    np.testing.assert_allclose(d["kappa"], kappa, atol=1e-8)
    assert np.abs(d["residual"]).max() < 1e-8
    # With noise: the same fit as a dense least-squares solve of kappa(q - k) + u(k).
    p = _compose(kappa, u) + 0.1 * rng.normal(size=(h, w, h, w))
    rows = []
    for qi, qj, ki, kj in np.ndindex(h, w, h, w):
        x = np.zeros((2 * h - 1) * (2 * w - 1) + h * w)
        x[(qi - ki + h - 1) * (2 * w - 1) + (qj - kj + w - 1)] = 1
        x[(2 * h - 1) * (2 * w - 1) + ki * w + kj] = 1
        rows.append(x)
    coef, *_ = np.linalg.lstsq(np.asarray(rows), p.ravel(), rcond=None)
    fit = np.asarray(rows) @ coef
    d = canvas.decompose_prior(p, iterations=2000)
    np.testing.assert_allclose(p.ravel() - d["residual"].ravel(), fit, atol=1e-6)
    parts = canvas.prior_parts(p)
    assert parts["u_range"] == pytest.approx(np.ptp(d["u"]), rel=1e-6)
