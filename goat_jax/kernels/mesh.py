"""Where the kernels run: the device mesh, read once per attention call and passed down.

:func:`ambient_mesh` is the one place the kernel layer reads the mesh in context (``jax.set_mesh``,
``jax.sharding.use_abstract_mesh``, the trainer's ``with_mesh_and_rules``); the front door
(:func:`goat_jax.kernels.attend`) and the automatic choice call it, and everything below them
(context parallelism, splash under ``jax.shard_map``) takes the mesh as an argument.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

import jax
from jax.sharding import PartitionSpec as P

from goat_jax.kernels.plan import DEFAULT

CONTEXT_AXIS = DEFAULT.context_axis  # the mesh axis a sequence is split over (AttentionPlan.context_axis)


def ambient_mesh() -> Any:
    """The abstract mesh in context (empty outside one)."""
    return jax.sharding.get_abstract_mesh()


def _manual(mesh: Any) -> set:
    return set(getattr(mesh, "manual_axes", ()))


def context_shards(mesh: Any, axis: str = CONTEXT_AXIS) -> int:
    """The size of ``mesh``'s context axis ``axis``, 1 when there is none (no mesh, no such axis,
    or the axis already manual: inside a shard_map every device holds its shard)."""
    if mesh is None or mesh.empty or axis not in mesh.axis_names or axis in _manual(mesh):
        return 1
    return int(mesh.shape[axis])


def check_axis_types(mesh: Any) -> None:
    """Raises a one-line ValueError naming ``axis_types`` when ``mesh`` (more than one device)
    has Explicit axes (``jax.make_mesh``'s default in jax 0.10.2). On such a mesh an array's
    sharding is part of its type and nothing reshards implicitly: the shard_maps of context
    parallelism, splash and cuDNN's packed layout take only inputs already sharded as their
    in_specs say, GOAT's packing concatenates sharded content channels with replicated position
    channels (a ShardingTypeError), and NNX's parameter constraints assert; each failed with a
    raw JAX error (Linen, NNX, decoding, generation). Auto axes (this package's meshes, from
    :func:`goat_jax.train.sharding.make_mesh`) let XLA place the data."""
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    if mesh is None or mesh.empty or explicit is None or int(np.prod(list(mesh.shape.values()))) <= 1:
        return
    types = tuple(getattr(mesh, "axis_types", ()) or ())
    if any(t == explicit for t in types):
        raise ValueError(
            f"The mesh in context has axis_types={tuple(str(t).split('.')[-1] for t in types)}; goat_jax's "
            "attention runs on Auto axes only: build the mesh with axis_types=(jax.sharding.AxisType.Auto,) * "
            "len(axis_names) (as goat_jax.train.sharding.make_mesh does).")


class Layout(NamedTuple):
    """How a kernel that XLA cannot partition (splash; context parallelism's shard_map) splits
    its work over a mesh: the batch over ``batch_axes``, the query heads over ``head_axes``, the
    key/value heads with them when ``shard_kv``."""

    mesh: Any
    batch_axes: Tuple[str, ...]
    head_axes: Tuple[str, ...]
    shard_kv: bool

    def specs(self, heads_at: int = 2, length: Optional[str] = None) -> "Specs":
        """The partition specs of a ``shard_map`` on this layout, written once for every kernel and
        strategy: ``q`` / ``kv`` for rank-4 arrays with the batch first, the heads at ``heads_at``
        (2: [B, T, N, H]; 1: [B, N, T, H]) and the length axis split over ``length`` (a context
        axis, or None: whole); ``rows`` for [B, T] arrays (masks, segment ids); ``batch`` for [B]."""
        bx, hx = spec_axes(self.batch_axes), spec_axes(self.head_axes)

        def rank4(heads):
            dims = [bx, None, None, None]
            dims[heads_at], dims[3 - heads_at] = heads, length
            return P(*dims)
        return Specs(rank4(hx), rank4(hx if self.shard_kv else None), P(bx, length), P(bx))


class Specs(NamedTuple):
    """Partition specs of one layout (:meth:`Layout.specs`)."""

    q: Any
    kv: Any
    rows: Any
    batch: Any


def partition(mesh: Any, b: int, n: int, kh: int, context_axis: str = CONTEXT_AXIS) -> Optional[Layout]:
    """The :class:`Layout` of a call with ``b`` examples, ``n`` query and ``kh`` key/value heads
    on ``mesh``, or None outside a mesh of more than one device. The ``context`` axis splits
    neither the batch nor the heads (:mod:`goat_jax.kernels.all_gather` splits the sequence over it).

    Mosaic kernels cannot be partitioned by XLA, so on a mesh splash runs under
    ``jax.shard_map``, each device on its own examples (and heads). The batch dim is split over
    the mesh axes the logical rules in context give ``'batch'`` (Flax's
    ``nn.logical_axis_rules``, as the trainer sets them; without rules the axes named
    ``data``/``fsdp``, else every axis but ``tensor``/``model``), the query heads over those of
    ``'heads'`` (without rules: ``tensor``); an axis is kept only while the product still divides
    the dimension. The key/value heads are split with the query heads when their number divides
    too (each device keeps its query heads' KV heads: GQA groups are contiguous), kept whole for
    one KV head (MQA), and otherwise the heads are not split (every device of those axes repeats
    the heads' work: correct, only redundant). Axes that are already manual (the layer called
    inside the caller's own ``shard_map``) are left alone; with none other of size > 1: None."""
    if mesh is None or mesh.empty:
        return None
    manual = _manual(mesh)
    names = tuple(a for a in mesh.axis_names if a not in manual)
    if np.prod([mesh.shape[a] for a in names], dtype=int) <= 1:
        return None
    names = tuple(a for a in names if a != context_axis)

    def from_rules(logical: str) -> Optional[Tuple[str, ...]]:
        try:
            import flax.linen as nn  # pylint: disable=g-import-not-at-top
            if not nn.get_logical_axis_rules():
                return None
            spec = nn.logical_to_mesh_axes((logical,))
        except Exception:  # pylint: disable=broad-except  # rules naming axes of another mesh
            return None
        if spec is None or not len(spec) or spec[0] is None:
            return ()
        axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
        return tuple(a for a in axes if a in names)

    def dividing(axes, dim, used=()):
        kept, size = [], 1
        for a in axes:
            if a not in used and dim % (size * mesh.shape[a]) == 0:
                kept.append(a)
                size *= mesh.shape[a]
        return tuple(kept), size

    batch = from_rules("batch")
    if batch is None:
        batch = tuple(a for a in ("data", "fsdp") if a in names) or tuple(
            a for a in names if a not in ("tensor", "model"))
    batch, _ = dividing(batch, b)
    heads = from_rules("heads")
    if heads is None:
        heads = tuple(a for a in ("tensor", "model") if a in names)
    heads, m = dividing(heads, n, used=batch)
    shard_kv = bool(heads) and kh % m == 0
    if heads and not shard_kv and kh != 1:
        heads = ()
    return Layout(mesh, batch, heads, shard_kv)


def spec_axes(axes: Tuple[str, ...]) -> Any:
    """A PartitionSpec entry for ``axes``: None, one name, or a tuple of names."""
    return None if not axes else (axes[0] if len(axes) == 1 else axes)
