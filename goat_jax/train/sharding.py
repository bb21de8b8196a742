"""Device mesh and logical-axis sharding (the Flax lm1b / T5X / MaxText scheme).

Parameters carry *logical* axis names (``'embed'``, ``'mlp'``, ``'heads'``, ...) from
``nn.with_logical_partitioning``; a short list of ``(logical, mesh_axis)`` rules in the config
maps them onto the four mesh axes:

* ``data``   -- pure data parallelism: batch split, parameters replicated.
* ``fsdp``   -- batch split *and* parameters/optimizer state split (ZeRO-3 style): weights are
  all-gathered per layer in the forward pass and gradients reduce-scattered.
* ``context`` -- context (sequence) parallelism: activations split over their length,
  parameters replicated; attention all-gathers keys and values (:mod:`goat_jax.kernels.all_gather`).
* ``tensor`` -- Megatron-style tensor parallelism over heads / MLP hidden / vocab.

The axes are laid out in that order, ``tensor`` innermost (on the fastest links), then
``context`` (an all-gather of keys per layer), as MaxText orders them.

Rules follow Flax semantics: for each logical name, the first rule whose mesh axis is not
already used by another dimension of the same array wins; ``None`` means replicated. A mesh
axis that does not divide the dimension is dropped for that array (e.g. the byte vocab of 259
over ``tensor=2``): XLA requires even shards, and replicating one small array is better than
refusing to run. Parameters without logical names (e.g. the tiny GOAT prior tensors) are
replicated.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Any, Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import numpy as np

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "context", "tensor")
# The mesh axes a batch dimension is split over: every replica of the model sees a different
# slice; ``tensor`` shards see the same examples.
BATCH_AXES = ("data", "fsdp")

Rules = Sequence[Tuple[str, Any]]

# Logical axis -> mesh axis, shared by the language configs. Unlisted names ('kv', 'layers') are
# replicated; a mesh axis that does not divide a dimension is dropped for that
# array (e.g. a 259-byte vocabulary over tensor=2).
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),  # activations: batch split over every replica
    ("length", "context"),  # activations: sequence split over the context axis
    ("embed", "fsdp"),  # parameters + Adam moments sharded over fsdp (ZeRO-3)
    ("mlp", "tensor"),  # Megatron: MLP hidden
    ("heads", "tensor"),  # Megatron: query heads
    ("kv_heads", "tensor"),  # Megatron: key/value heads
    ("vocab", "tensor"),  # embedding / logits over the vocabulary
)


# ----------------------------------------------------------------------------------------------
# Mesh
# ----------------------------------------------------------------------------------------------


def mesh_shape(mesh_config: Any, num_devices: int) -> Tuple[int, ...]:
    """Resolves ``mesh.{data,fsdp,context,tensor}`` (at most one may be -1: "the rest"; an
    absent ``context`` is 1) to sizes, in :data:`MESH_AXES` order, whose product is
    ``num_devices``; raises ValueError naming the field otherwise."""
    sizes = {name: int(mesh_config[name]) if name in mesh_config or name != "context" else 1
             for name in MESH_AXES}
    fill = [name for name, size in sizes.items() if size == -1]
    bad = [name for name, size in sizes.items() if size == 0 or size < -1]
    if bad:
        raise ValueError(f"mesh.{bad[0]}={sizes[bad[0]]} must be a positive size or -1 (fill the "
                         "remaining devices).")
    if len(fill) > 1:
        raise ValueError(f"Only one of mesh.{{data,fsdp,context,tensor}} may be -1; got -1 for "
                         f"{', '.join('mesh.' + f for f in fill)}. Set all but one explicitly.")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if num_devices % fixed:
            raise ValueError(
                f"mesh.{fill[0]}=-1 cannot fill {num_devices} devices: the other mesh axes "
                f"multiply to {fixed}, which does not divide {num_devices}. Change "
                f"{', '.join(f'mesh.{n}' for n in MESH_AXES if n != fill[0])}.")
        sizes[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"mesh.data * mesh.fsdp * mesh.context * mesh.tensor = "
            f"{' * '.join(str(sizes[n]) for n in MESH_AXES)} = {fixed}, but there are {num_devices} "
            f"devices. Make the product {num_devices}, or set one of "
            f"{'/'.join('mesh.' + n for n in MESH_AXES)} to -1.")
    return tuple(sizes[name] for name in MESH_AXES)


def make_mesh(mesh_config: Any, devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A ``Mesh`` with axes :data:`MESH_AXES` over ``devices`` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(mesh_config, len(devices))
    try:
        # Topology-aware placement on TPU/GPU (tensor axis on the fastest links).
        from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
        array = mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
        array = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(array, MESH_AXES)


def data_parallel_size(mesh: Mesh) -> int:
    """Number of batch shards (``data * fsdp``)."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def initialize_distributed(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                           process_id: Optional[int] = None) -> None:
    """Joins this process to a multi-process JAX job (once; later calls are no-ops).

    Without arguments ``jax.distributed.initialize`` detects the cluster itself (TPU pod slices,
    SLURM, Open MPI); the arguments override detection, e.g. two CPU processes on one machine:
    ``('localhost:12345', 2, 0)`` and ``('localhost:12345', 2, 1)``. On CPU the cross-process
    collectives use gloo (JAX has no default CPU collectives)."""
    if jax.distributed.is_initialized():
        return
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
             "process_id": process_id}
    kwargs = {k: v for k, v in given.items() if v is not None}
    if kwargs and len(kwargs) != 3:
        missing = sorted(k for k, v in given.items() if v is None)
        raise ValueError(f"distributed: give all of --coordinator_address, --num_processes and "
                         f"--process_id, or none (auto-detection); missing {missing}.")
    # Only the CPU client's collectives (the default there is none, so multi-process CPU jobs
    # could not communicate); accelerator backends keep their own (NCCL, ICI).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)


# ----------------------------------------------------------------------------------------------
# Logical names -> shardings
# ----------------------------------------------------------------------------------------------


def rules_from_config(rules: Rules) -> Tuple[Tuple[str, Any], ...]:
    """Normalizes config rules (lists from JSON or the command line) to a tuple of pairs, and
    checks they only name mesh axes that exist."""
    out = []
    for i, pair in enumerate(rules):
        if len(pair) != 2:
            raise ValueError(f"sharding_rules[{i}]={pair!r} must be a (logical_name, mesh_axis) pair.")
        logical, target = pair
        if isinstance(target, (list, tuple)):
            target = tuple(target)
            axes = target
        else:
            axes = () if target is None else (target,)
        unknown = [a for a in axes if a not in MESH_AXES]
        if unknown:
            raise ValueError(f"sharding_rules[{i}] maps {logical!r} to unknown mesh axis "
                             f"{unknown[0]!r}; mesh axes are {MESH_AXES}.")
        out.append((str(logical), target))
    return tuple(out)


def _resolve(names: Sequence[Optional[str]], shape: Sequence[int], mesh: Mesh, rules: Rules) -> P:
    """PartitionSpec for one array with logical ``names`` (Flax rule semantics + divisibility)."""
    used, spec = set(), []
    for name, dim in zip(names, shape):
        chosen = None
        for logical, target in rules:
            if logical != name:
                continue
            axes = () if target is None else (tuple(target) if isinstance(target, tuple) else (target,))
            if any(a in used for a in axes):
                continue
            # Keep only the mesh axes (in order) whose product still divides the dimension.
            kept, size = [], 1
            for a in axes:
                if dim % (size * mesh.shape[a]) == 0:
                    kept.append(a)
                    size *= mesh.shape[a]
            if len(kept) < len(axes):
                logging.info("sharding: %s (size %d) not divisible over %s; using %s.", name, dim, axes, kept)
            chosen = tuple(kept)
            break
        if not chosen:
            spec.append(None)
        else:
            used.update(chosen)
            spec.append(chosen[0] if len(chosen) == 1 else chosen)
    return P(*spec)


def logical_shardings(abstract_tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for a tree that may hold ``nn.LogicallyPartitioned`` boxes (e.g. the
    ``jax.eval_shape`` of ``model.init``). Unboxed leaves are replicated. The result has the
    *unboxed* tree structure."""
    def one(leaf):
        if isinstance(leaf, nn.LogicallyPartitioned):
            names = tuple(leaf.names)
            shape = leaf.value.shape
            return NamedSharding(mesh, _resolve(names, shape, mesh, rules))
        return NamedSharding(mesh, P())
    return jax.tree.map(one, abstract_tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def with_mesh_and_rules(fn: Callable[..., Any], mesh: Mesh, rules: Rules) -> Callable[..., Any]:
    """``fn`` traced under ``mesh`` and the logical ``rules``, so that every
    ``nn.with_logical_constraint`` in the model becomes a real sharding constraint on that
    activation (outside such a context Flax makes them no-ops). Wrap the function given to
    ``jax.jit``; the context is entered while tracing, whoever calls it."""
    flax_rules = tuple((name, tuple(t) if isinstance(t, list) else t) for name, t in rules)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            stack.enter_context(jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
            stack.enter_context(nn.logical_axis_rules(flax_rules))
            return fn(*args, **kwargs)
    return wrapped


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated sharding on ``mesh``."""
    return NamedSharding(mesh, P())


def optimizer_shardings(tx: optax.GradientTransformation, abstract_opt_state: Any,
                        param_shardings: Any, mesh: Mesh) -> Any:
    """Shardings for an optimizer state: every params-shaped subtree (Adam's mu, nu, ...) gets
    the parameters' shardings; everything else (counts, schedule state) is replicated."""
    return optax.tree_map_params(
        tx, lambda _, sharding: sharding, abstract_opt_state, param_shardings,
        transform_non_params=lambda _: replicated(mesh))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a ``[batch, ...]`` array: batch over ``data x fsdp``, the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def batch_groups(mesh: Mesh, global_rows: int, process_index: Optional[int] = None) -> Tuple[int, int]:
    """``(group, groups)``: which of the batch's row sets process ``process_index`` (default
    this one) feeds, and how many distinct sets the processes feed.

    Processes whose devices hold the same rows of a ``[batch, ...]`` array (:func:`batch_sharding`)
    form one group and must load the same examples: a ``context`` or ``tensor`` group of devices
    that spans hosts splits a sequence or its heads, not the batch. Without such groups every
    process is its own group (``group = process_index``, ``groups = process_count``). The data
    pipeline is built with ``(group, groups)`` in place of ``(process_index, process_count)``,
    and ``jax.make_array_from_process_local_data`` places a process's rows on its devices' row
    slices, contiguous or not (a topology-aware mesh may interleave the hosts' devices). Raises
    ValueError when the groups' row sets do not split the batch into equal disjoint parts."""
    index_map = batch_sharding(mesh, 1).devices_indices_map((global_rows,))
    per_process: dict = {}
    for device, index in index_map.items():
        rows = index[0]
        start = 0 if rows.start is None else rows.start
        stop = global_rows if rows.stop is None else rows.stop
        per_process.setdefault(device.process_index, set()).add((start, stop))
    rows_of = {p: frozenset(r for a, b in slices for r in range(a, b)) for p, slices in per_process.items()}
    distinct = sorted(set(rows_of.values()), key=min)
    covered = sorted(r for rows in distinct for r in rows)
    if len({len(rows) for rows in distinct}) != 1 or covered != list(range(global_rows)):
        raise ValueError(f"the processes hold rows {[sorted(r) for r in distinct]} of a batch of {global_rows}: "
                         "they must split it into equal disjoint parts. Change the mesh or the global batch.")
    me = jax.process_index() if process_index is None else process_index
    return distinct.index(rows_of[me]), len(distinct)
