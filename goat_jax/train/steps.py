"""The engine's train state and steps: the jitted train and eval steps of a task, sharded over
the mesh (:func:`make_sharded_steps`), their compile with the memory check, and the global batch
a process feeds. :func:`goat_jax.train.trainer.train_and_evaluate` builds them once per run;
``experiments.compile`` (goat_jax/aot/) compiles the same steps for a target it does not run on.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import _extras, platforms
from goat_jax.kernels import balance
from goat_jax.kernels.plan import AttentionPlan
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import ml_collections
    import optax

from goat_jax.train import memory as memory_lib
from goat_jax.train import optim
from goat_jax.train import run as run_lib
from goat_jax.train import sharding as sharding_lib
from goat_jax.train import tasks as tasks_lib

TrainState = run_lib.TrainState

# Folded into key(config.seed) to give the training steps' stream, distinct from the init key.
_TRAIN_STREAM = 1


def step_key(seed: int, step: jax.Array) -> jax.Array:
    """The PRNG key of the update at 0-based ``step``: ``fold_in(fold_in(key(seed), 1), step)``.

    A function of the seed and the step only, so a resumed run draws the same dropout / mixup
    randomness as an uninterrupted one."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), _TRAIN_STREAM), step)


def make_train_step(task: tasks_lib.Task, model: nn.Module, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, grad_accum_steps: int, seed: int = 0):
    """``train_step(state, batch) -> (state, metrics)``: loss normalized by the total weight of
    the whole global batch (exact under gradient accumulation), AdamW update, and the metrics
    ``train_loss``, ``grad_norm`` (before clipping), ``learning_rate`` (of this update).

    The task's loss gets :func:`step_key` ``(seed, state.step)`` folded with the microbatch
    index."""
    def loss_fn(params, batch, rng):
        return task.loss(model.apply, params, batch, rng)

    def train_step(state: TrainState, batch):
        rng = step_key(seed, state.step)
        loss_sum, weight_sum, grads = optim.accumulate_gradients(loss_fn, state.params, batch,
                                                                 grad_accum_steps, rng)
        denom = jnp.where(weight_sum > 0, weight_sum, 1.0)
        grads = jax.tree.map(lambda g: g / denom.astype(g.dtype), grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"train_loss": loss_sum / denom, "grad_norm": optax.global_norm(grads),
                   "learning_rate": schedule(state.step)}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(task: tasks_lib.Task, model: nn.Module, num_microbatches: int):
    """``eval_step(params, batch) -> {'loss', 'weight', **aux}``: the task's loss and aux sums
    (``rng=None``: deterministic) summed over the batch, microbatch by microbatch like training
    so that eval never needs more activation memory than a training microbatch."""
    def eval_step(params, batch):
        def one(_, mb):
            loss, (weight, aux) = task.loss(model.apply, params, mb, None)
            if {"loss", "weight"} & set(aux or {}):
                raise ValueError(f"task {task.name!r}: aux sums may not be named 'loss' or 'weight' "
                                 f"(got {sorted(aux)}); rename them.")
            return None, {**(aux or {}), "loss": loss, "weight": weight}
        micro = jax.tree.map(lambda x: optim.split_microbatches(x, num_microbatches), batch)
        sums = jax.lax.scan(one, None, micro)[1]  # each [num_microbatches]
        return jax.tree.map(lambda x: jnp.sum(x.astype(jnp.float32), axis=0), sums)
    return eval_step


@dataclasses.dataclass(frozen=True)
class ShardedSteps:
    """The jitted, sharded functions of a run (:func:`make_sharded_steps`)."""

    model: nn.Module
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    init: Callable[[jax.Array], TrainState]  # rng -> sharded TrainState at step 0
    train_step: Callable[..., Any]  # (state, batch) -> (state, metrics); donates the state
    eval_step: Callable[..., Any]  # (params, batch) -> {'loss', 'weight', **aux} sums
    abstract_state: TrainState  # shapes/dtypes (jax.ShapeDtypeStruct leaves)
    state_shardings: TrainState
    param_shardings: Any


def make_sharded_steps(task: tasks_lib.Task, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh,
                       rules: sharding_lib.Rules, batch_shardings: Dict[str, Any], *,
                       plan: AttentionPlan) -> ShardedSteps:
    """Builds the model and optimizer and jits init, train and eval steps for ``mesh``; the
    model's attention and the engine's balancing run under ``plan`` (the run's, built once by the
    entry point with :meth:`goat_jax.kernels.plan.AttentionPlan.from_config`).

    Parameter and optimizer-state shardings come from the parameters' logical names
    (:func:`~goat_jax.train.sharding.logical_shardings`) and are imposed by jit's
    in/out_shardings; activations follow the model's ``nn.with_logical_constraint`` names, which
    take effect because every function is traced under the mesh and the rules
    (:func:`~goat_jax.train.sharding.with_mesh_and_rules`).
    """
    model = task.build_model(config, plan)
    tx, schedule = run_lib.make_optimizer(task, config)
    init_params, init_state = run_lib.make_init_fns(task, model, tx, config,
                                                    sharding_lib.data_parallel_size(mesh))
    rng = jax.random.PRNGKey(0)  # shapes only
    param_shardings = sharding_lib.logical_shardings(jax.eval_shape(init_params, rng), mesh, rules)
    abstract_state = jax.eval_shape(init_state, rng)
    replicated = sharding_lib.replicated(mesh)
    state_shardings = TrainState(
        step=replicated, params=param_shardings,
        opt_state=sharding_lib.optimizer_shardings(tx, abstract_state.opt_state, param_shardings, mesh))

    def under_mesh(fn):  # load balancing (kernels/balance.py) under the plan the model has
        return sharding_lib.with_mesh_and_rules(balance.context_step(fn, config, mesh, plan), mesh, rules)

    accum, opts = config.grad_accum_steps, platforms.gpu_compiler_options(config.get("gpu_xla_flags"), mesh.devices.flat[0].platform)
    return ShardedSteps(
        model=model, tx=tx, schedule=schedule,
        init=jax.jit(sharding_lib.with_mesh_and_rules(init_state, mesh, rules), out_shardings=state_shardings),
        train_step=jax.jit(under_mesh(make_train_step(task, model, tx, schedule, accum, config.seed)),
                           in_shardings=(state_shardings, batch_shardings), compiler_options=opts,
                           out_shardings=(state_shardings, replicated), donate_argnums=0),
        eval_step=jax.jit(under_mesh(make_eval_step(task, model, accum)), compiler_options=opts,
                          in_shardings=(param_shardings, batch_shardings), out_shardings=replicated),
        abstract_state=abstract_state, state_shardings=state_shardings, param_shardings=param_shardings)


def global_abstract_batch(local: Dict[str, Any], batch_shardings: Dict[str, Any],
                          groups: int) -> Dict[str, jax.ShapeDtypeStruct]:
    """The global batch as ``jax.ShapeDtypeStruct`` s with their shardings, from one host's
    numpy batch ``local`` (its rows; the global batch has ``groups`` times as many: the
    processes' distinct row blocks, :func:`goat_jax.train.sharding.batch_groups`, the process
    count unless a context or tensor group spans hosts): what a train step is lowered with, here
    and ahead of time (:mod:`goat_jax.aot`)."""
    return {k: jax.ShapeDtypeStruct((np.shape(v)[0] * groups,) + tuple(np.shape(v)[1:]),
                                    jax.dtypes.canonicalize_dtype(np.asarray(v).dtype), sharding=batch_shardings[k])
            for k, v in local.items()}


def compile_and_check_memory(steps: ShardedSteps, abstract_state, dummy: Dict[str, Any],
                              batch_shardings: Dict[str, Any], groups: int):
    """``(compiled train step or None, abstract batch)``; raises ValueError (with the estimate)
    when XLA's memory plan of one step exceeds the machine's memory (:mod:`memory_lib`).
    ``dummy``: one process's rows, of ``groups`` blocks (:func:`sharding_lib.batch_groups`)."""
    abstract_batch = global_abstract_batch(dummy, batch_shardings, groups)
    try:
        compiled = steps.train_step.lower(abstract_state, abstract_batch).compile()
    except (TypeError, ValueError, NotImplementedError) as e:  # e.g. a task's batch the dummy misses
        logging.info("no ahead-of-time compile of the train step (%s); no memory check", e)
        return None, abstract_batch
    memory_lib.check_fits(memory_lib.step_bytes(compiled), jax.local_devices()[0],
                          jax.local_device_count())
    return compiled, abstract_batch
