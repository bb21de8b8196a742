"""The fast path of a fused attention kernel by q/k width, and the one warning when GOAT's packed
layout falls off it (docs/layer.md, "Packed width").

Fused attention kernels do not run every head width at its own cost: they are built for a few
widths and run a wider head as the next one up.

* **Hopper GPUs (compute capability 9.x), cuDNN**: head widths are padded to a multiple of 8 and
  the kernels come in buckets with a cliff above 64: FlashAttention-3 rounds 65-96 up to its 96
  kernel, other Hopper builds pad to 128, and cuDNN's release notes name native paths for 64,
  128 and 256. So a q/k 66 wide (GOAT's official layout in bf16 for a 64 head) runs in a bucket
  above plain attention's 64; the first GPU check measured GOAT at 1.24-1.50x plain cuDNN's
  time on one H200 (benchmarks/gpu.md), what a 72-wide q/k run as 96 or 128 predicts.
* **TPUs, splash**: the last dim is tiled in 128 lanes, so 64 and 66 share one tile and 130 (a
  128 head + 2) takes two (benchmarks/packed_head_dim.md).

:func:`kernel_width` states the rule: the width the kernel runs a ``width``-wide q/k at. Each
fused kernel states its own rule on its row (``fast_widths``,
:class:`goat_jax.kernels.capabilities.FastWidths`: :func:`goat_jax.kernels.cudnn.hopper_width`,
:func:`goat_jax.kernels.splash.lane_width`), which this module reads. GOAT falls off the fast
path when its packed width runs wider than the plain head would
(:func:`layout_warning`); ``qk_layout='lane_aligned'`` keeps q/k exactly ``head_dim`` wide and
never does. The GOAT layer calls :func:`check_layout` after its kernel is chosen (automatic or
explicit), so a training run and the compile tool (``experiments.compile``, which also lists
the warnings in its report, :func:`record_layout_warnings`) each say it once per process.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Tuple

from goat_jax.kernels import capabilities as caps
from goat_jax.kernels import choice

_warned: set = set()
_recorders = choice.Recorders(unique=True)


class LayoutWarning(UserWarning):
    """GOAT's packed q/k width runs in a wider kernel than the plain head would."""


def _fast_row(platform: str) -> Optional[caps.Capability]:
    """The row of ``platform``'s fused kernel: the first (by name) that runs on ``platform`` and
    states its fast path by width (``fast_widths``), or None."""
    return next((row for row in caps.CAPABILITIES.values()
                 if row.fast_widths is not None and platform in row.platforms), None)


def kernel_width(platform: str, compute_capability: Optional[Tuple[int, int]], width: int) -> Optional[int]:
    """The q/k width the fast kernel of ``platform`` runs a ``width``-wide head at, by its row's
    rule: on a Hopper GPU (compute capability 9.x) cuDNN's, the smallest of 64, 128, 256 holding
    ``width`` rounded up to a multiple of 8 (that rounding beyond 256); on a TPU splash's,
    ``width`` rounded up to 128 lanes. None where the rule is not known (other GPUs, CPUs)."""
    row = _fast_row(platform)
    return None if row is None else row.fast_widths.width(compute_capability, width)


def layout_warning(platform: str, compute_capability: Optional[Tuple[int, int]], dtype: Any, implementation: str,
                   head_dim: int, qk_dim: int) -> Optional[str]:
    """The warning for a ``dtype`` run of ``implementation`` whose GOAT q/k are ``qk_dim`` wide
    for a ``head_dim``-wide head, or None when the packed width costs nothing: not the
    platform's fused kernel (cuDNN on GPU, splash on TPU: the row with the platform's
    ``fast_widths``), a platform without a known rule, or the packed width running at the plain
    head's kernel width. Decided by the widths alone, in any dtype: the official layout is
    ``head_dim + 2`` wide in bf16, ``+ 1`` in float16 (which used to pass unwarned, though a
    65-wide q/k runs in Hopper's 128 bucket) and ``head_dim`` in float32; ``dtype`` is named in
    the message."""
    import numpy as np  # pylint: disable=g-import-not-at-top

    row = _fast_row(platform)
    if row is None or row.name != implementation:
        return None
    rule = row.fast_widths.width
    packed, plain = rule(compute_capability, qk_dim), rule(compute_capability, head_dim)
    if packed is None or packed <= plain:
        return None
    where, cost = row.fast_widths.where, row.fast_widths.cost
    return (f"goat_jax: GOAT's packed q/k are {qk_dim} wide for {head_dim}-wide heads in {np.dtype(dtype).name}, "
            f"which {where} runs as "
            f"{packed} wide against {plain} for plain attention ({cost}). qk_layout='lane_aligned' keeps q/k "
            f"{head_dim} wide (a different function from the official layout; docs/layer.md, Packed width).")


def record_layout_warnings():
    """Collects the layout warnings raised inside the ``with`` (each once), even those already
    shown earlier in the process: what the compile tool reports for one compile."""
    return _recorders.record()


def check_layout(implementation: str, dtype: Any, head_dim: int, qk_dim: int, *, like: Tuple[Any, ...] = (),
                 mesh: Any = None) -> Optional[str]:
    """Warns (:class:`LayoutWarning`, once per message in this process) when GOAT's packed
    width falls off the fast path of the devices the computation is traced for
    (:func:`goat_jax.kernels.choice.target`); returns the message or None."""
    platform, _, device = choice.target(*like, mesh=mesh)
    cc = choice.compute_capability(device) if platform == "gpu" else None
    message = layout_warning(platform, cc, dtype, implementation, head_dim, qk_dim)
    if message is None:
        return None
    _recorders.add(message)
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, LayoutWarning, stacklevel=3)
    return message
