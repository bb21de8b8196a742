"""The training engine, shared by every experiment family (it names none of their fields).

* :mod:`~goat_jax.train.trainer`    -- ``train_and_evaluate(config, workdir)``: the loop, top to bottom.
* :mod:`~goat_jax.train.tasks`      -- the Task contract; ``config.task`` -> a task module
  (``goat_jax/tasks/<name>.py``), shared losses.
* :mod:`~goat_jax.train.run`        -- the workdir layout, the train state, ``load_run``.
* :mod:`~goat_jax.train.sharding`   -- mesh from ``config.mesh``, logical-axis rules, shardings.
* :mod:`~goat_jax.train.optim`      -- AdamW, warmup + cosine, clipping, decay mask, accumulation.
* :mod:`~goat_jax.train.checkpoint` -- orbax checkpoints of state + data iterator, fingerprint.
* :mod:`~goat_jax.train.metrics`    -- metrics.jsonl, TensorBoard, progress bar, tokens/s, MFU.
* :mod:`~goat_jax.train.profiling`  -- ``config.profile_steps``: a jax.profiler trace of a few steps.
* :mod:`~goat_jax.train.wandb_logger` -- ``config.wandb``: Weights & Biases (the ``[wandb]`` extra).

Submodules are imported on use (``from goat_jax.train import trainer``) so that importing the
package does not pull in orbax or TensorBoard.
"""
