"""RoPE rescaled for a longer context: dynamic NTK-aware scaling ('ntk') and YaRN ('yarn').

Both are RoPE (``rope.py``: same rotate-half layout, no parameters, every kernel, rotated keys
in the KV cache) whose inverse frequencies are recomputed for a scale factor

    f = max(1, S / training_seq_len)      (dynamic, the default: S = keys attended), or
    f = rope_scaling_factor               (fixed, as Hugging Face's static 'yarn'),

where S is the call's key length, and while decoding the cache length, i.e. the length of the
full forward the decoding reproduces (as 'rope_pi' does; Hugging Face's dynamic NTK instead
recomputes the frequencies at every step, so its cached keys were rotated with older ones).

* 'ntk' (bloc97 2023; the dynamic form of Emozilla / Hugging Face ``rope_type='dynamic'`` with
  its ``factor`` alpha = 1): the base is raised to ``base * f ** (H / (H - 2))``, which leaves
  the highest frequency unchanged and divides the lowest by f.
* 'yarn' (Peng et al. 2023, "YaRN", NTK-by-parts): per frequency pair i with wavelength
  ``2 pi / theta_i``, the number of rotations over the training length ``r_i = L / lambda_i``
  decides: pairs with ``r_i > beta_fast`` keep ``theta_i`` (extrapolate), pairs with
  ``r_i < beta_slow`` use ``theta_i / f`` (interpolate, as RoPE-PI), and a linear ramp over the
  pair index blends the two in between (Hugging Face's ``_compute_yarn_parameters`` with
  ``truncate=True``, reproduced exactly). The attention temperature ``mscale = 0.1 ln f + 1``
  multiplies q and k, i.e. the logits by ``mscale ** 2`` (Hugging Face's ``attention_factor``,
  applied to cos and sin); here it is folded into the kernel's scale.

At f = 1 both are plain 'rope' exactly (the same frequencies and scale). Frequencies are computed
once per call on the host in float64 (f is static: it depends on shapes only).

Shape legend: B batch, T queries, S keys, N heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Mapping, Optional, Tuple

import jax
import numpy as np

from goat_jax.config.fields import Float, borrow, check_section, declare, specs_of
from goat_jax.positional.base import EncodingContext, PositionEncoding
from goat_jax.positional.rope import RopePISettings, RopeSettings, apply_rope

Array = jax.Array


def _check_dim(dim: int, what: str) -> None:
    if dim < 4 or dim % 2:
        raise ValueError(f"position_encoding={what!r} needs an even head dim >= 4 (the NTK exponent is "
                         f"H / (H - 2)), got {dim}.")


@dataclasses.dataclass(frozen=True)
class NtkSettings(RopeSettings):
    """'ntk': the base, the training length and a fixed factor (None: dynamic, which needs the
    training length)."""

    training_seq_len: Optional[int] = borrow(RopePISettings, "training_seq_len")
    rope_scaling_factor: Optional[float] = declare(None, Float(
        min=1.0, optional=True, doc="'ntk'/'yarn' fixed factor; None: dynamic, max(1, keys / training_seq_len)"))

    # The encoding these settings are for, and what reads training_seq_len (for the error).
    _NAME: ClassVar[str] = "ntk"
    _NEEDS: ClassVar[str] = "the dynamic factor"

    def __post_init__(self):
        super().__post_init__()
        if self.training_seq_len is None and (self.rope_scaling_factor is None or self._NAME == "yarn"):
            raise ValueError(f"position_encoding={self._NAME!r} needs training_seq_len (the length the "
                             f"model was trained at: {self._NEEDS} read it).")


@dataclasses.dataclass(frozen=True)
class YarnSettings(NtkSettings):
    """'yarn': the 'ntk' settings (the training length required even with a fixed factor) and the
    rotation counts bounding its interpolation ramp (32 and 1 as the paper)."""

    yarn_beta_fast: float = declare(32.0, Float(min=0.0, min_inclusive=False,
                                                doc="'yarn': rotations above which a pair extrapolates"))
    yarn_beta_slow: float = declare(1.0, Float(min=0.0, min_inclusive=False,
                                               doc="'yarn': rotations below which a pair interpolates"))

    _NAME: ClassVar[str] = "yarn"
    _NEEDS: ClassVar[str] = "the dynamic factor and YaRN's rotation counts"


def check_scaling_factor(value) -> None:
    """ValueError unless ``rope_scaling_factor`` is allowed by its declaration
    (:class:`NtkSettings`: None or a finite number >= 1), for a factor given outside a layer or a
    config (an evaluation flag)."""
    try:
        check_section({"rope_scaling_factor": value}, {"rope_scaling_factor": specs_of(NtkSettings)["rope_scaling_factor"]},
                      None)
    except ValueError:
        raise ValueError(f"rope_scaling_factor must be >= 1 and finite (or None: dynamic, max(1, key "
                         f"length / training_seq_len)), got {value}.") from None


def ntk_frequencies(dim: int, base: float, factor: float) -> np.ndarray:
    """Dynamic NTK-aware inverse frequencies: RoPE's ladder with base ``base * factor **
    (dim / (dim - 2))`` (Hugging Face's dynamic form with alpha = 1); [dim/2] float64."""
    _check_dim(dim, "ntk")
    if not factor >= 1.0:
        raise ValueError(f"the NTK scale factor must be >= 1, got {factor}.")
    scaled = base * factor ** (dim / (dim - 2))
    return scaled ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)


def yarn_correction_range(dim: int, base: float, original_len: int, beta_fast: float,
                          beta_slow: float) -> Tuple[float, float]:
    """The pair indices ``(low, high)`` between which YaRN ramps from extrapolation to
    interpolation: pair i completes ``beta`` rotations over ``original_len`` tokens at index
    ``dim ln(original_len / (2 pi beta)) / (2 ln base)``; floored/ceiled and clipped to
    ``[0, dim - 1]`` (as Hugging Face with ``truncate=True``)."""
    def index(rotations: float) -> float:
        return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(index(beta_fast)), 0), min(math.ceil(index(beta_slow)), dim - 1)


def yarn_frequencies(dim: int, base: float, factor: float, original_len: int, beta_fast: float = 32.0,
                     beta_slow: float = 1.0) -> Tuple[np.ndarray, float]:
    """YaRN's NTK-by-parts inverse frequencies [dim/2] (float64) and its attention factor
    ``mscale = 0.1 ln(factor) + 1`` (1 at factor 1), for a model trained at ``original_len``."""
    _check_dim(dim, "yarn")
    if not factor >= 1.0:
        raise ValueError(f"the YaRN scale factor must be >= 1, got {factor}.")
    if not beta_fast > beta_slow > 0:
        raise ValueError(f"yarn_beta_fast must exceed yarn_beta_slow > 0, got beta_fast={beta_fast}, "
                         f"beta_slow={beta_slow}.")
    theta = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    low, high = yarn_correction_range(dim, base, original_len, beta_fast, beta_slow)
    if low == high:
        high += 0.001  # Hugging Face's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    # ramp 0: keep theta (fast pairs), ramp 1: theta / factor (slow pairs).
    freqs = theta * (1.0 - ramp) + (theta / factor) * ramp
    return freqs, (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)


def scale_factor(settings: NtkSettings, key_len: int) -> float:
    """f: ``settings.rope_scaling_factor`` if set, else ``max(1, key_len / training_seq_len)``."""
    if settings.rope_scaling_factor is not None:
        return float(settings.rope_scaling_factor)
    return max(1.0, key_len / settings.training_seq_len)


class _ScaledRope(PositionEncoding):
    """RoPE with frequencies (and a logit factor) recomputed per call for the factor f."""

    def frequencies(self, settings: NtkSettings, dim: int, factor: float) -> Tuple[Optional[np.ndarray], float]:
        """``(inverse frequencies or None for plain RoPE's, logit factor)`` at factor f."""
        raise NotImplementedError

    def encode(self, params: Mapping[str, Any], ctx: EncodingContext, q: Array, k: Array):
        settings = ctx.settings
        if (ctx.call.q_segment_ids is not None and settings.rope_scaling_factor is None
                and ctx.key_len > settings.training_seq_len):
            # One frequency ladder per call: a per-document dynamic factor has no exact form here.
            raise ValueError(
                f"position_encoding={self.name!r} with segment_ids: the dynamic factor follows the key "
                f"length, here the packed window's ({ctx.key_len} > training_seq_len="
                f"{settings.training_seq_len}), not each document's. Set rope_scaling_factor (a fixed "
                "factor), or pack windows no longer than training_seq_len.")
        f = scale_factor(settings, ctx.key_len)
        if f == 1.0:  # exactly 'rope'
            freqs, logit_factor = None, 1.0
        else:
            freqs, logit_factor = self.frequencies(settings, ctx.shape.head_dim, f)
        return (apply_rope(q, ctx.q_pos, settings.rope_base, frequencies=freqs),
                apply_rope(k, ctx.k_pos, settings.rope_base, frequencies=freqs), ctx.scale * logit_factor)


class Ntk(_ScaledRope):
    """'ntk': dynamic NTK-aware RoPE (module docstring)."""

    name = "ntk"
    settings_class = NtkSettings

    def frequencies(self, settings, dim, factor):
        return ntk_frequencies(dim, settings.rope_base, factor), 1.0


class Yarn(_ScaledRope):
    """'yarn': YaRN's NTK-by-parts frequencies and attention temperature (module docstring)."""

    name = "yarn"
    settings_class = YarnSettings

    def frequencies(self, settings, dim, factor):
        freqs, mscale = yarn_frequencies(dim, settings.rope_base, factor, settings.training_seq_len,
                                         settings.yarn_beta_fast, settings.yarn_beta_slow)
        return freqs, mscale ** 2  # mscale on q and on k


NTK, YARN = Ntk(), Yarn()

__all__ = ["NTK", "NtkSettings", "YARN", "YarnSettings", "check_scaling_factor", "ntk_frequencies",
           "scale_factor", "yarn_correction_range", "yarn_frequencies"]
