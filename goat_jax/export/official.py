"""A ``qk_layout='lane_aligned'`` GOAT layer in the official package's layout (``goat-attention``
0.1.1), exactly: the lane-aligned layer carves its sink channels from the content dims
(``d_c = head_dim - 2R - c``), the official one keeps ``d_o = head_dim - 2R - 1``. Its ``d_o - d_c``
extra content dims get zero query and key weights (and biases), and the ratio of the two content
scales, ``sqrt(d_o / d_c)``, folds into the query's content rows, so that
``q'_c . k'_c / sqrt(d_o) = q_c . k_c / sqrt(d_c)``. With the query-norm prior gate, whose input
``||q_c||`` the fold scales too, the gate's slope is divided by the same ratio
(``softplus(s') = softplus(s) / sqrt(d_o / d_c)``). Used by :func:`goat_jax.interop.to_official`.

The carve (:func:`carved_sink_channels`) is read in this one place: the layer's ``sink_channels``,
else the layout's own count in every dtype (:func:`goat_jax.prior.packing.packed_sink_channels`).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import numpy as np


def carved_sink_channels(dtype: Any, sink_channels: Optional[int] = None) -> int:
    """The sink channels a lane-aligned layer carves from its content dims (see the module doc):
    the layout's own count in every dtype (:func:`goat_jax.prior.packing.packed_sink_channels`)."""
    from goat_jax.prior.packing import packed_sink_channels  # pylint: disable=g-import-not-at-top
    return packed_sink_channels("lane_aligned", True, sink_channels, dtype)


def content_dims(prior: Any, head_dim: int, dtype: Any, sink_channels: Optional[int] = None) -> Tuple[int, int]:
    """``(d_c, d_o)``: the layer's content dims under its ``prior`` settings (any layout) and the
    official layout's ``head_dim - 2R - [sink]``."""
    spec = prior.for_heads(1, 1)
    d_c = spec.content_dim(head_dim, carved_sink_channels(dtype, sink_channels))
    return d_c, head_dim - spec.prior_dim


def to_official_layout(prior: Any, params: Any, head_dim: int, dtype: Any,
                       sink_channels: Optional[int] = None) -> dict:
    """``params`` of a GOAT layer (Flax names: ``q_proj/kernel`` [E, N, H], ...) rewritten for the
    official layout (see the module doc); a copy, NumPy float32. Unchanged when the layouts agree."""
    d_c, d_o = content_dims(prior, head_dim, dtype, sink_channels)
    p = {k: (dict(v) if isinstance(v, dict) else v) for k, v in params.items()}
    if d_c == d_o:
        return p
    ratio = math.sqrt(d_o / d_c)
    for name in ("q_proj", "k_proj"):
        layer = {k: np.array(v, np.float32) for k, v in p[name].items()}
        for leaf, x in layer.items():  # kernel [E, heads, H], bias [heads, H]
            if name == "q_proj":
                x[..., :d_c] *= ratio
            x[..., d_c:d_o] = 0.0
        p[name] = layer
    if prior.prior_gate == "query_norm":
        prior_params = dict(p["prior"])
        raw = np.asarray(prior_params["prior_gate_scale_raw"], np.float64)
        slope = np.logaddexp(0.0, raw) / ratio  # softplus, then / ratio
        prior_params["prior_gate_scale_raw"] = np.log(np.expm1(slope)).astype(np.float32)
        p["prior"] = prior_params
    return p
