"""Compiling one KV-cache decode step for a target: will a model's cache of its full window fit?

``python -m experiments.compile --step decode`` (docs/aot.md): the config's LM (language or
genome), its global batch of one new token per row, against a cache of ``seq_len`` slots (the
model's training window), laid out on the config's mesh as the trainer lays out the batch and the
parameters: the cache's rows over ``data x fsdp`` (logical ``batch``), its slots over ``context``
(``length``), its key/value heads over ``tensor`` (``kv_heads``), each where the axis divides the
dimension (the config's ``sharding_rules``). The step is the model's own decode call
(``model.clone(decode=True).apply(..., mutable=['cache'])``, as
:func:`goat_jax.models.sampling.generate` runs it), the cache donated so the new one reuses it.

The report is the train step's (:func:`goat_jax.aot.compile_train_step`: memory per device, fit,
kernels) with ``step: 'decode'``, ``cache_length`` and the keys' and values' bytes:
``kv_cache_bytes_total`` (the whole cache, every layer) and ``kv_cache_bytes_per_chip`` (what one
chip holds under those shardings).

Under a mesh with ``context > 1`` the cache's slots are split over ``context`` (each chip holds
``seq_len / context`` of them) and the layer's decode branch, which sees the mesh's context axis,
scores each shard's slots and merges the partial softmaxes (goat_jax/kernels/decode_merge.py;
docs/training.md, "Decoding with a sharded cache"). The step's activations (one token per row)
are not split over ``context``: the step is traced under :func:`step_rules`, the config's rules
with ``context`` taken out of every mapping, while the cache keeps the config's own (its
``length`` over ``context``), as ``experiments.sample --mesh_context`` runs it. The report's
``attention_implementation`` is then ``'decode_merge'`` (the kernel the layer planned is not what
attends a split cache).
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from goat_jax import kernels
from goat_jax.aot.compiler import FIT_MARGIN, compile_or_out_of_memory, custom_calls, finish, memory
from goat_jax.aot.target import Target, gpu_target, target_devices
from goat_jax.kernels import widths as kernel_widths

KV_LEAVES = ("cached_key", "cached_value")  # the cache's keys and values (the layers' variable names)


def _names(path: tuple, ndim: int, scanned: bool) -> Optional[tuple]:
    """The logical axis names of a cache leaf at ``path`` with ``ndim`` dims: keys and values are
    ``[(layers,) batch, length, kv_heads, head]``; indices (scalars, or one per layer) none."""
    if path and path[-1] in KV_LEAVES:
        names = ("batch", "length", "kv_heads", None)
        return (("layers",) + names) if scanned else names
    return None if ndim == 0 else (None,) * ndim


def step_rules(rules: Sequence[Tuple[str, Any]]) -> Tuple[Tuple[str, Any], ...]:
    """The logical ``rules`` (normalized pairs, :func:`goat_jax.train.sharding.rules_from_config`)
    with the ``context`` mesh axis taken out of every mapping: a decode step's activations hold one
    token per row, which ``context`` cannot split; only the cache's slots are split there
    (:func:`cache_shardings` keeps the config's own rules)."""
    out = []
    for logical, target in rules:
        if isinstance(target, tuple):
            kept = tuple(a for a in target if a != "context")
            target = kept if len(kept) > 1 else (kept[0] if kept else None)
        elif target == "context":
            target = None
        out.append((logical, target))
    return tuple(out)


def cache_shardings(abstract_cache: Any, mesh: Any, rules: Any, scanned: bool) -> Any:
    """NamedShardings of a decode cache (the 'cache' collection's ``eval_shape``) under the
    logical ``rules`` (:func:`goat_jax.train.sharding.logical_shardings`): keys and values by
    :func:`_names`, everything else replicated."""
    from goat_jax.train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top

    boxed = {}
    for path, leaf in traverse_util.flatten_dict(nn.unbox(abstract_cache)).items():
        names = _names(path, leaf.ndim, scanned)
        boxed[path] = nn.LogicallyPartitioned(leaf, names) if names and any(names) else leaf
    return sharding_lib.logical_shardings(traverse_util.unflatten_dict(boxed), mesh, rules)


def cache_bytes(abstract_cache: Any, shardings: Any) -> tuple[int, int]:
    """``(total, per chip)`` bytes of the keys and values of a cache with ``shardings``: the
    global arrays, and what one device holds of them (replicated dims counted whole)."""
    leaves = traverse_util.flatten_dict(nn.unbox(abstract_cache))
    sh = traverse_util.flatten_dict(shardings)
    total = per_chip = 0
    for path, leaf in leaves.items():
        if path[-1] not in KV_LEAVES:
            continue
        size = np.dtype(leaf.dtype).itemsize
        total += int(np.prod(leaf.shape)) * size
        per_chip += int(np.prod(sh[path].shard_shape(leaf.shape))) * size
    return total, per_chip


def compile_decode_step(config: Any, target: Target, devices: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
    """Compiles one decode step of ``config``'s LM for ``target`` (module doc) and returns its
    report (``experiments.compile --step decode`` writes it). Raises ValueError naming the field
    for a config that cannot decode: a task whose model is not the LM (a ViT)."""
    from goat_jax.models.lm import TransformerLM  # pylint: disable=g-import-not-at-top
    from goat_jax.kernels.plan import DEFAULT as DEFAULT_PLAN
    from goat_jax.train import sharding as sharding_lib
    from goat_jax.train import tasks as tasks_lib
    from goat_jax.train import trainer

    # What cannot decode, before the target's devices are built (libtpu or the CUDA plugin).
    task = tasks_lib.get_task(config.get("task"))
    # The model's class does not depend on the plan: the default one serves this check.
    model = task.build_model(tasks_lib.with_field_defaults(config, task), DEFAULT_PLAN)
    if not isinstance(model, TransformerLM):
        raise ValueError(f"--step decode compiles the language model's KV-cache step; config.task="
                         f"{config.task!r} builds a {type(model).__name__}, which does not decode. Use --step train.")
    devices = target_devices(target) if devices is None else list(devices)
    hosts = len({d.process_index for d in devices})
    global_batch, plan = trainer.validate_config(config, len(devices), hosts)  # the compile's one plan
    config = tasks_lib.with_field_defaults(config, task)
    model = task.build_model(config, plan)
    mesh = sharding_lib.make_mesh(config.mesh, devices)
    rules = sharding_lib.rules_from_config(config.sharding_rules)
    slots, scanned = int(config.seq_len), bool(config.model.get("scan_layers", False))
    decoder = model.clone(decode=True)
    rng = jax.random.PRNGKey(0)  # shapes only
    boxed_params = jax.eval_shape(lambda r: model.init(r, jnp.zeros((1, 8), jnp.int32))["params"], rng)
    param_shardings = sharding_lib.logical_shardings(boxed_params, mesh, rules)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # kernel choices for the target's mesh
        abstract_cache = jax.eval_shape(lambda r: decoder.init(r, jnp.zeros((global_batch, slots), jnp.int32))["cache"],
                                        rng)
    shardings = cache_shardings(abstract_cache, mesh, rules, scanned)
    abstract = lambda tree, sh: jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                             nn.unbox(tree), sh)
    rows = sharding_lib.batch_sharding(mesh, 2)
    tokens = jax.ShapeDtypeStruct((global_batch, 1), jnp.int32, sharding=rows)

    def step(params, cache, token):
        logits, state = decoder.apply({"params": params, "cache": cache}, token, mutable=["cache"])
        return logits[:, -1], state["cache"]

    # The cache by the config's rules (slots over context); the one-token step's activations by
    # step_rules (never over context), so the layer's decode branch merges the split cache.
    fn = jax.jit(sharding_lib.with_mesh_and_rules(step, mesh, step_rules(rules)), donate_argnums=1,
                 in_shardings=(param_shardings, shardings, rows), out_shardings=(rows, shardings))
    start = time.perf_counter()
    with gpu_target(target):
        with kernels.record_choices() as choices, kernel_widths.record_layout_warnings() as layout_warnings:
            lowered = fn.lower(abstract(boxed_params, param_shardings), abstract(abstract_cache, shardings), tokens)
    lower_seconds = time.perf_counter() - start
    compiled, error = compile_or_out_of_memory(lowered)
    compile_seconds = time.perf_counter() - start
    total, per_chip = cache_bytes(abstract_cache, shardings)
    per_device = memory(compiled) if compiled is not None else None
    chip = target.chip
    report: Dict[str, Any] = {
        "step": "decode", "target": target.name, "topology": target.topology_name,
        "device_kind": devices[0].device_kind, "num_devices": len(devices), "num_hosts": hosts,
        "mesh": {k: int(v) for k, v in mesh.shape.items()}, "global_batch_size": global_batch,
        "tokens_per_step": global_batch, "cache_length": slots,
        "kv_cache_bytes_total": total, "kv_cache_bytes_per_chip": per_chip,
        "per_device_bytes": per_device, "device_memory_bytes": chip.hbm_bytes, "fit_margin": FIT_MARGIN,
        "parameters": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(boxed_params))),
        "model_flops_per_step": None, "peak_bf16_flops_per_chip": chip.peak_bf16_flops, "peak_source": chip.source,
        "estimated_step_seconds": None, "estimated_tokens_per_second_per_chip": None,
        "estimate_note": "no FLOP estimate for a decode step (it is bound by reading the cache and the "
                         "parameters, not by FLOPs)",
        "attention_implementation": sorted({c["implementation"] for c in choices}) or None,
        "packed_head_dim": sorted({c["qk_dim"] for c in choices}) or None,
        "custom_calls": custom_calls(compiled.as_text()) if compiled is not None else None,
        "layout_warnings": layout_warnings,
        "compile_seconds": round(compile_seconds, 2), "lower_seconds": round(lower_seconds, 2),
    }
    for key in ("attention_implementation", "packed_head_dim"):
        if report[key] is not None and len(report[key]) == 1:
            report[key] = report[key][0]
    if report["mesh"].get("context", 1) > 1:
        # The layer planned its kernel as usual, but a cache split over context is attended by
        # the split-cache merge (pure JAX, no fused kernel), which is what the step runs.
        report["attention_implementation"] = "decode_merge"
    return finish(report, error, per_device, chip.hbm_bytes)
