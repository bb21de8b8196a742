"""Image transforms of the ViT recipes: per-example PIL/NumPy ops driven by an explicit RNG.

Every random transform takes a ``np.random.Generator``; the pipeline (``goat_jax.data.images``)
hands each example and each batch its own generator derived from the seed and its index
(grain's ``random_map``), so the augmented stream is deterministic and resumes exactly.
Geometric and colour ops are Pillow's; what is written here is only the sampling (which box,
which op, which magnitude), following torchvision/timm, the source of the official recipe:

* :func:`random_resized_crop` -- torchvision ``RandomResizedCrop`` (scale 0.08-1, ratio 3/4-4/3,
  10 tries then a centre crop), bicubic resize.
* :func:`rand_augment` -- torchvision ``RandAugment(num_ops=2, magnitude=9)``: 14 ops, 31
  magnitude bins, signed ops negated with probability 1/2, Pillow ops (timm's
  ``auto_augment`` forms: shear/translate about the top-left corner), fill 128 (grey).
* :func:`random_erasing` -- timm ``RandomErasing(p, mode='pixel')`` on the normalized image
  (DeiT: p 0.25, one box, area 2-33%, log-uniform aspect 0.3-3.3, N(0, 1) noise).
* :func:`mixup_cutmix` -- timm ``Mixup`` in batch mode (pair each example with the batch
  reversed): CutMix (Beta(1, 1), box area corrected lambda) or Mixup (Beta(0.8, 0.8)), switch
  probability 0.5, smoothed one-hot targets.
* :func:`eval_resize_crop` -- resize the shorter side to ``r / crop_fraction`` (r * 256/224),
  centre crop ``r x r``, for any evaluation resolution r.

Shape legend: B batch, R x C pixels, Ch channels, K classes.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Sequence, Tuple

import numpy as np

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    from PIL import Image, ImageEnhance, ImageOps

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_FILL = 128  # RandAugment fill for pixels moved in from outside (mid grey)


def random_resized_crop(img: Image.Image, size: int, rng: np.random.Generator,
                        scale: Tuple[float, float] = (0.08, 1.0),
                        ratio: Tuple[float, float] = (3 / 4, 4 / 3)) -> Image.Image:
    """torchvision ``RandomResizedCrop``: a box of area ``scale`` x the image and log-uniform
    aspect ``ratio`` (10 tries; then the largest centred box with a ratio in range), resized
    bicubically to ``size x size``."""
    w, h = img.size
    area = w * h
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
            return img.resize((size, size), Image.BICUBIC, box=(left, top, left + cw, top + ch))
    in_ratio = w / h  # fallback: centre crop clamped to the ratio range
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    top, left = (h - ch) // 2, (w - cw) // 2
    return img.resize((size, size), Image.BICUBIC, box=(left, top, left + cw, top + ch))


def random_flip(img: Image.Image, rng: np.random.Generator, p: float = 0.5) -> Image.Image:
    """Horizontal flip with probability ``p``."""
    return img.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < p else img


# --- RandAugment ---------------------------------------------------------------------------------


def _affine(img: Image.Image, matrix: Tuple[float, ...]) -> Image.Image:
    fill = _FILL if img.mode == "L" else (_FILL,) * len(img.getbands())
    return img.transform(img.size, Image.AFFINE, matrix, resample=Image.BILINEAR, fillcolor=fill)


def _rotate(img: Image.Image, degrees: float) -> Image.Image:
    fill = _FILL if img.mode == "L" else (_FILL,) * len(img.getbands())
    return img.rotate(degrees, resample=Image.BILINEAR, fillcolor=fill)


# name -> (magnitudes over the bins as a function of (bins, width, height), signed, op(img, m)).
# Magnitude ranges are torchvision's RandAugment._augmentation_space.
RAND_AUGMENT_OPS: Dict[str, Tuple[Callable, bool, Callable]] = {
    "Identity": (lambda n, w, h: np.zeros(n), False, lambda img, m: img),
    "ShearX": (lambda n, w, h: np.linspace(0.0, 0.3, n), True, lambda img, m: _affine(img, (1, m, 0, 0, 1, 0))),
    "ShearY": (lambda n, w, h: np.linspace(0.0, 0.3, n), True, lambda img, m: _affine(img, (1, 0, 0, m, 1, 0))),
    "TranslateX": (lambda n, w, h: np.linspace(0.0, 150.0 / 331.0 * w, n), True,
                   lambda img, m: _affine(img, (1, 0, m, 0, 1, 0))),
    "TranslateY": (lambda n, w, h: np.linspace(0.0, 150.0 / 331.0 * h, n), True,
                   lambda img, m: _affine(img, (1, 0, 0, 0, 1, m))),
    "Rotate": (lambda n, w, h: np.linspace(0.0, 30.0, n), True, _rotate),
    "Brightness": (lambda n, w, h: np.linspace(0.0, 0.9, n), True,
                   lambda img, m: ImageEnhance.Brightness(img).enhance(1.0 + m)),
    "Color": (lambda n, w, h: np.linspace(0.0, 0.9, n), True, lambda img, m: ImageEnhance.Color(img).enhance(1.0 + m)),
    "Contrast": (lambda n, w, h: np.linspace(0.0, 0.9, n), True,
                 lambda img, m: ImageEnhance.Contrast(img).enhance(1.0 + m)),
    "Sharpness": (lambda n, w, h: np.linspace(0.0, 0.9, n), True,
                  lambda img, m: ImageEnhance.Sharpness(img).enhance(1.0 + m)),
    "Posterize": (lambda n, w, h: 8 - np.round(np.arange(n) / ((n - 1) / 4)).astype(int), False,
                  lambda img, m: ImageOps.posterize(img, int(m))),
    "Solarize": (lambda n, w, h: np.linspace(255.0, 0.0, n), False, lambda img, m: ImageOps.solarize(img, m)),
    "AutoContrast": (lambda n, w, h: np.zeros(n), False, lambda img, m: ImageOps.autocontrast(img)),
    "Equalize": (lambda n, w, h: np.zeros(n), False, lambda img, m: ImageOps.equalize(img)),
}


def rand_augment(img: Image.Image, rng: np.random.Generator, num_ops: int = 2, magnitude: int = 9,
                 num_bins: int = 31) -> Image.Image:
    """torchvision ``RandAugment``: ``num_ops`` ops drawn uniformly (with replacement) from
    :data:`RAND_AUGMENT_OPS`, each at bin ``magnitude`` of ``num_bins``, signed ones negated with
    probability 1/2. Works on 'RGB' and 'L' images."""
    if not 0 <= magnitude < num_bins:
        raise ValueError(f"RandAugment magnitude={magnitude} must be in [0, num_bins={num_bins}).")
    names = list(RAND_AUGMENT_OPS)
    w, h = img.size
    for _ in range(num_ops):
        name = names[int(rng.integers(len(names)))]
        magnitudes, signed, op = RAND_AUGMENT_OPS[name]
        m = float(magnitudes(num_bins, w, h)[magnitude])
        if signed and rng.random() < 0.5:
            m = -m
        img = op(img, m)
    return img


# --- on arrays -------------------------------------------------------------------------------------


def to_normalized_array(img: Image.Image, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """PIL image -> float32 ``[R, C, Ch]``, ``(pixel / 255 - mean) / std`` per channel."""
    x = np.asarray(img, np.float32) / 255.0
    if x.ndim == 2:
        x = x[..., None]
    return (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


def random_erasing(x: np.ndarray, rng: np.random.Generator, p: float = 0.25,
                   area: Tuple[float, float] = (0.02, 1 / 3), ratio: Tuple[float, float] = (0.3, 3.3)) -> np.ndarray:
    """timm ``RandomErasing(mode='pixel', max_count=1)`` on a normalized ``[R, C, Ch]`` image:
    with probability ``p`` one box (10 tries) is replaced by N(0, 1) noise per pixel/channel."""
    if rng.random() >= p:
        return x
    r, c = x.shape[:2]
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = r * c * rng.uniform(*area)
        aspect = math.exp(rng.uniform(*log_ratio))
        bh, bw = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < bh < r and 0 < bw < c:
            top, left = int(rng.integers(0, r - bh + 1)), int(rng.integers(0, c - bw + 1))
            x = x.copy()
            x[top:top + bh, left:left + bw] = rng.standard_normal((bh, bw, x.shape[2])).astype(x.dtype)
            return x
    return x


def smooth_one_hot(labels: np.ndarray, num_classes: int, smoothing: float) -> np.ndarray:
    """[B] int -> [B, K] float32: ``1 - smoothing + smoothing/K`` on the label, ``smoothing/K``
    elsewhere (timm's convention)."""
    off = smoothing / num_classes
    out = np.full((labels.shape[0], num_classes), off, np.float32)
    out[np.arange(labels.shape[0]), labels] = 1.0 - smoothing + off
    return out


def mixup_cutmix(images: np.ndarray, labels: np.ndarray, rng: np.random.Generator, *, num_classes: int,
                 mixup_alpha: float = 0.8, cutmix_alpha: float = 1.0, switch_prob: float = 0.5,
                 smoothing: float = 0.1) -> Tuple[np.ndarray, np.ndarray]:
    """timm ``Mixup`` (mode 'batch', prob 1): mixes each example with the batch reversed.

    CutMix with probability ``switch_prob`` (lambda ~ Beta(cutmix_alpha, cutmix_alpha), a box
    of area ``1 - lambda`` pasted, lambda then corrected to the box actually pasted after
    clipping), else Mixup (lambda ~ Beta(mixup_alpha, mixup_alpha)). An alpha of 0 disables that
    branch; both 0 gives only the smoothed one-hot targets.

    Args:
      images: [B, R, C, Ch] float32; labels: [B] int.
    Returns:
      (images [B, R, C, Ch] float32, targets [B, K] float32 rows summing to 1).
    """
    targets = smooth_one_hot(labels, num_classes, smoothing)
    use_cutmix = cutmix_alpha > 0 and (mixup_alpha <= 0 or rng.random() < switch_prob)
    if not use_cutmix and mixup_alpha <= 0:
        return images, targets
    flipped = images[::-1]
    if use_cutmix:
        lam = float(rng.beta(cutmix_alpha, cutmix_alpha))
        r, c = images.shape[1:3]
        cut = math.sqrt(1.0 - lam)
        ch, cw = int(r * cut), int(c * cut)
        cy, cx = int(rng.integers(0, r)), int(rng.integers(0, c))
        top, bottom = np.clip(cy - ch // 2, 0, r), np.clip(cy + ch // 2, 0, r)
        left, right = np.clip(cx - cw // 2, 0, c), np.clip(cx + cw // 2, 0, c)
        images = images.copy()
        images[:, top:bottom, left:right] = flipped[:, top:bottom, left:right]
        lam = 1.0 - (bottom - top) * (right - left) / float(r * c)
    else:
        lam = float(rng.beta(mixup_alpha, mixup_alpha))
        images = (lam * images + (1.0 - lam) * flipped).astype(np.float32)
    return images, (lam * targets + (1.0 - lam) * targets[::-1]).astype(np.float32)


def eval_resize_crop(img: Image.Image, resolution: int, crop_fraction: float = 224 / 256) -> Image.Image:
    """Evaluation view at ``resolution``: shorter side resized (bicubic) to
    ``int(resolution / crop_fraction)`` (e.g. 256 for 224), then the centre ``r x r`` crop."""
    if not 0.0 < crop_fraction <= 1.0:
        raise ValueError(f"crop_fraction={crop_fraction} must be in (0, 1].")
    short = int(math.floor(resolution / crop_fraction + 1e-6))
    w, h = img.size
    if w <= h:
        nw, nh = short, max(short, int(round(h * short / w)))
    else:
        nw, nh = max(short, int(round(w * short / h))), short
    img = img.resize((nw, nh), Image.BICUBIC)
    left, top = int(round((nw - resolution) / 2.0)), int(round((nh - resolution) / 2.0))
    return img.crop((left, top, left + resolution, top + resolution))
