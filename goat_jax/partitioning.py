"""Logically partitioned Flax parameters that work from Linen and from Flax NNX alike: what the
attention layers' projections and the position encodings' own parameters are boxed with.
"""

from __future__ import annotations

from typing import Optional, Tuple

import flax
import flax.linen as nn


class LogicallyPartitioned(nn.LogicallyPartitioned):
    """``nn.LogicallyPartitioned`` that also works from Flax NNX without a mesh.

    ``flax.nnx.bridge.ToNNX`` turns each box into an ``nnx.Variable``, which by default shards
    its value eagerly to the box's names and raises without a mesh ("An auto mesh context or
    metadata is required ..."). Without a mesh there is nothing to shard to, so the box asks for
    no eager sharding then; under a mesh it behaves exactly as Flax's own box.
    """

    def to_nnx_metadata(self) -> dict:
        """The ``nnx.Variable`` metadata; ``eager_sharding=False`` when no mesh is defined."""
        metadata = super().to_nnx_metadata()
        if self.mesh is None and not flax.core.meta.global_mesh_defined():
            metadata["eager_sharding"] = False
        return metadata


def with_logical_partitioning(fn, names: Tuple[Optional[str], ...]):
    """``nn.with_logical_partitioning`` with the NNX-friendly :class:`LogicallyPartitioned`."""
    def init(*args, **kwargs):
        return LogicallyPartitioned(fn(*args, **kwargs), names)
    return init
