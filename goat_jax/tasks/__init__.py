"""Experiment families, one module each, loaded by name from ``config.task``.

* :mod:`goat_jax.tasks.lm` -- language modelling on text or the synthetic retrieval tasks.

Each module defines ``TASK``, a :class:`goat_jax.train.tasks.Task` (the contract is in that
module's docstring). ``config.task = 'lm'`` loads ``goat_jax.tasks.lm:TASK``; a task defined
elsewhere is named ``'package.module:ATTR'``. Nothing here is imported by the engine except
through :func:`goat_jax.train.tasks.get_task`.
"""
