"""The training engine, shared by the language, DNA and ViT experiments.

* :mod:`~goat_jax.train.trainer`    -- ``train_and_evaluate(config, workdir)``: the loop, top to bottom.
* :mod:`~goat_jax.train.tasks`      -- ``config.task`` registry: model, data, loss, schema per task.
* :mod:`~goat_jax.train.sharding`   -- mesh from ``config.mesh``, logical-axis rules, shardings.
* :mod:`~goat_jax.train.optim`      -- AdamW, warmup + cosine, clipping, decay mask, accumulation.
* :mod:`~goat_jax.train.checkpoint` -- orbax checkpoints of state + data iterator, fingerprint.
* :mod:`~goat_jax.train.metrics`    -- metrics.jsonl, TensorBoard, progress bar, tokens/s, MFU.

Submodules are imported on use (``from goat_jax.train import trainer``) so that importing the
package does not pull in orbax or TensorBoard.
"""
