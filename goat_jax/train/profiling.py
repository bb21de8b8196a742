"""``config.profile_steps``: a ``jax.profiler`` trace of a few training steps.

``config.profile_steps = (first, last)`` (on the command line, repeat the flag:
``--config.profile_steps=10 --config.profile_steps=15``; ``()`` = off) traces steps ``first``
to ``last`` inclusive, numbered as in ``metrics.jsonl`` (step s is the s-th update), into
``WORKDIR/profile/plugins/profile/<timestamp>/<host>.xplane.pb``: the layout TensorBoard's
profile plugin and XProf read (``tensorboard --logdir WORKDIR/profile`` with
``tensorboard-plugin-profile``, or ``xprof --logdir WORKDIR/profile``; docs/ecosystem.md).

Start after the first step so that compilation stays out of the trace (``first >= 2``; step 1
compiles). Each step is annotated (``StepTraceAnnotation('train', step_num=s)``) so the tools
show per-step times. The trace stops once step ``last``'s state is ready, which blocks the
host once. A resumed run traces what is left of the range; every process traces its own host.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Optional, Sequence

import jax

PROFILE_DIR = "profile"


def profile_dir(workdir: str) -> str:
    """``WORKDIR/profile``: where the traces go."""
    return os.path.join(workdir, PROFILE_DIR)


def check_profile_steps(steps: Sequence[int], num_train_steps: int) -> None:
    """Refuses a range that is not ``()`` or ``(first, last)`` with ``1 <= first <= last <=
    num_train_steps`` (one line naming the field and the fix)."""
    steps = tuple(steps)
    if not steps:
        return
    fix = ("set it with --config.profile_steps=FIRST --config.profile_steps=LAST "
           f"(1 <= FIRST <= LAST <= num_train_steps={num_train_steps}), or () for no trace.")
    if len(steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise ValueError(f"profile_steps={steps!r} must be () or two integers (first, last step); {fix}")
    first, last = steps
    if not 1 <= first <= last <= num_train_steps:
        raise ValueError(f"profile_steps={steps!r} is not a range of training steps; {fix}")


class StepProfiler:
    """Starts and stops the trace around the steps of ``profile_steps``.

    Args:
      profile_steps: ``()`` or ``(first, last)`` (checked by :func:`check_profile_steps`).
      workdir: the run directory; the trace goes to ``WORKDIR/profile``.
      start_step: the step the run (re)starts after (0 for a fresh run).
    """

    def __init__(self, profile_steps: Sequence[int], workdir: str, start_step: int = 0):
        steps = tuple(profile_steps or ())
        self.first: Optional[int] = None
        self.last: Optional[int] = None
        if steps and steps[1] > start_step:  # a resumed run traces what is left of the range
            self.first, self.last = max(steps[0], start_step + 1), steps[1]
        self.directory = profile_dir(workdir)
        self._active = False

    def step(self, step: int):
        """A context manager around dispatching step ``step`` (1-based): starts the trace
        before ``first`` and annotates each traced step."""
        if self.first is None or not self.first <= step <= self.last:
            return contextlib.nullcontext()
        if not self._active:
            os.makedirs(self.directory, exist_ok=True)
            logging.info("profiling steps %d-%d into %s", self.first, self.last, self.directory)
            jax.profiler.start_trace(self.directory)
            self._active = True
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after_step(self, step: int, state: Any) -> None:
        """Stops the trace once step ``last`` has run (waits for ``state``)."""
        if self._active and step >= self.last:
            jax.block_until_ready(state)
            self.close()

    def close(self) -> None:
        """Stops a running trace (also on errors and preemption: the steps so far are kept)."""
        if self._active:
            self._active = False
            jax.profiler.stop_trace()
            logging.info("profile written to %s (open with: tensorboard --logdir %s)",
                         self.directory, self.directory)
