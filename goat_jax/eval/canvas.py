"""The canvas protocol of the tiny vision experiments (docs/protocols.md, "Tiny vision protocol:
objects on a larger canvas"), and the split of GOAT's learned 2D prior into its two parts.

* Canvas: each evaluation image, at the training resolution, is pasted unchanged onto a larger
  canvas of background pixels at a random offset that is a multiple of the patch size. Every
  patch that covers the object then holds exactly a patch seen in training, so what changes
  with the canvas size is the number of patches and where the object sits: position, not patch
  content. Offsets are drawn from the batch index and a seed, so every run sees the same
  placements.
* Prior parts: GOAT's head-mean log-prior between patches is ``kappa(q - k) + u(k)`` (a
  function of the offset, shift-invariant by construction, plus a key-only term). Given the
  log-prior on a grid, :func:`decompose_prior` recovers both by least squares (alternating
  means), so the report can give kappa's range, u's range on the training grid and on a larger
  one, and the residual (how far the prior is from that form), separately.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Dict

import numpy as np


def canvas_offsets(num: int, image_size: int, canvas: int, patch: int, rng: np.random.Generator) -> np.ndarray:
    """``num`` (row, col) offsets of an ``image_size`` image on a ``canvas``-pixel canvas, each
    a multiple of ``patch`` (so patches align with the training grid): int [num, 2]."""
    if canvas < image_size or (canvas - image_size) % patch or image_size % patch:
        raise ValueError(f"canvas {canvas} px: needs canvas >= image {image_size} px with (canvas - image) "
                         f"and the image divisible by the patch size {patch}.")
    slots = (canvas - image_size) // patch + 1
    return rng.integers(0, slots, size=(num, 2)) * patch


def paste(images: np.ndarray, canvas: int, offsets: np.ndarray, fill: Sequence[float]) -> np.ndarray:
    """``images`` [B, H, W, C] pasted at ``offsets`` [B, 2] onto ``canvas`` x ``canvas``
    canvases filled with ``fill`` (per channel: the normalized background value)."""
    b, h, w, c = images.shape
    out = np.empty((b, canvas, canvas, c), images.dtype)
    out[...] = np.asarray(fill, images.dtype).reshape(1, 1, 1, c)
    for i, (r, col) in enumerate(np.asarray(offsets)):
        out[i, r:r + h, col:col + w] = images[i]
    return out


def background_fill(mean: Sequence[float], std: Sequence[float]) -> list[float]:
    """The normalized value of a black pixel, per channel: Fashion-MNIST's background is 0."""
    return [(0.0 - m) / s for m, s in zip(mean, std)]


def make_canvas_eval(make_eval_at: Callable[[int], Iterator[Dict[str, np.ndarray]]], image_size: int,
                     patch: int, fill: Sequence[float], seed: int = 0
                     ) -> Callable[[int], Iterator[Dict[str, np.ndarray]]]:
    """``canvas -> eval batches``: the eval batches at ``image_size`` pasted onto ``canvas``
    pixels (:func:`paste`), offsets drawn per batch from ``seed`` (the same for every run)."""

    def at(canvas: int) -> Iterator[Dict[str, np.ndarray]]:
        for i, batch in enumerate(make_eval_at(image_size)):
            rng = np.random.default_rng([seed, canvas, i])
            offsets = canvas_offsets(len(batch["image"]), image_size, canvas, patch, rng)
            yield {**batch, "image": paste(np.asarray(batch["image"]), canvas, offsets, fill)}

    return at


def decompose_prior(log_prior: np.ndarray, iterations: int = 200) -> Dict[str, np.ndarray]:
    """``log_prior`` [h, w, h, w] (query row, col, key row, col) -> the least-squares
    ``kappa`` [2h-1, 2w-1] (indexed by offset q - k + (h-1, w-1)) and ``u`` [h, w] with
    ``log_prior ~ kappa(q - k) + u(k)`` (u has mean 0), and the ``residual`` [h, w, h, w].
    Alternating exact means converge to the least-squares fit (block coordinate descent on a
    convex quadratic)."""
    p = np.asarray(log_prior, np.float64)
    h, w = p.shape[:2]
    qi, qj, ki, kj = np.meshgrid(np.arange(h), np.arange(w), np.arange(h), np.arange(w), indexing="ij")
    off = ((qi - ki + h - 1) * (2 * w - 1) + (qj - kj + w - 1)).ravel()
    key = (ki * w + kj).ravel()
    flat = p.ravel()
    n_off = (2 * h - 1) * (2 * w - 1)
    count_off = np.bincount(off, minlength=n_off)
    u = np.zeros(h * w)
    kappa = np.zeros(n_off)
    for _ in range(iterations):
        kappa = np.bincount(off, flat - u[key], n_off) / np.maximum(count_off, 1)
        u = np.bincount(key, flat - kappa[off], h * w) / (h * w)
        shift = u.mean()  # u's level is not identified: put it into kappa
        u, kappa = u - shift, kappa + shift
    residual = flat - kappa[off] - u[key]
    return {"kappa": kappa.reshape(2 * h - 1, 2 * w - 1), "u": u.reshape(h, w),
            "residual": residual.reshape(p.shape)}


def prior_parts(log_prior: np.ndarray) -> Dict[str, float]:
    """Ranges (max - min, nats) of the prior, of its kappa and u parts, and the largest
    residual of the split (:func:`decompose_prior`) on one grid."""
    d = decompose_prior(log_prior)
    return {"prior_range": float(np.ptp(log_prior)), "kappa_range": float(np.ptp(d["kappa"])),
            "u_range": float(np.ptp(d["u"])), "residual_max": float(np.abs(d["residual"]).max())}
