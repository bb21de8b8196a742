"""The sections of the prepared one-GPU check (``scripts/device_check.sh`` ->
``experiments/device_check.py``, which only parses flags and runs the sections listed in its
``SECTIONS``): each is a :class:`Section`, a key for ``--sections`` and a function of the
:class:`Check` that writes its own part of the report.

* :mod:`~goat_jax.device_check.kernel_sections` -- 1 kernels vs the float64 reference, 2 attention
  timing, 2b/2c packed documents on cuDNN's packed layout, 4 the GPU-only pytest tests.
* :mod:`~goat_jax.device_check.train_step` -- 3 the 125M LM train step (and the step measurement
  the levers share).
* :mod:`~goat_jax.device_check.widths` -- 5 the q/k width sweep on cuDNN (where Hopper's cliff is).
* :mod:`~goat_jax.device_check.levers` -- 6 / 6b the 125M step's throughput levers, GOAT beside RoPE.
* :mod:`~goat_jax.device_check.ring` -- ring attention's per-step work on one device.
* :mod:`~goat_jax.device_check.ulysses` -- one device's attention per layer under Ulysses against
  the ring's blocks, packed documents.

Nothing here imports tensorflow, grain or ml_collections (absent from the GPU image; the
dry run makes them unimportable to prove it), nor the tests: the float64 reference
(``tests/goat_reference.py``) and, on CPU, the cuDNN stand-in (``tests/cudnn_stand_in.py``) are
handed in by the command as :attr:`Check.reference` and :attr:`Check.stand_in`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, List, Optional

from goat_jax.device_check.report import Report


@dataclasses.dataclass
class Check:
    """What every section reads: the flags' meaning and the shared report and clock."""

    report: Report
    dry_run: bool  # CPU, tiny sizes
    gpu: bool  # JAX's backend is a GPU (cuDNN rows run)
    lengths: List[int]  # section 2's sequence lengths
    repeats: int  # timed rounds per variant
    start: float  # time.time() at the start
    budget_s: float  # skip what would start after start + budget_s
    wheel_dir: Optional[str] = None
    reference: Any = None  # tests/goat_reference.py (the float64 reference), from the command
    stand_in: Any = None  # off a GPU: tests/cudnn_stand_in.py's calls (the ring section's cuDNN stand-in)

    @property
    def deadline(self) -> float:
        """``start + budget_s``: rows that would begin later are reported as skipped."""
        return self.start + self.budget_s

    def section_deadline(self, seconds: float) -> float:
        """The earlier of the check's deadline and ``seconds`` from now (one section's share)."""
        return min(self.deadline, time.time() + seconds)

    @property
    def skip_note(self) -> List[str]:
        """The line that says cuDNN rows were skipped (on CPU), or none."""
        return [] if self.gpu else ["cuDNN rows skipped: no GPU (JAX backend 'cpu')."]


@dataclasses.dataclass(frozen=True)
class Section:
    """One part of the check: ``key`` (what ``--sections`` names), ``title`` (for an error) and
    ``run(check)``, which writes its own report section(s)."""

    key: str
    title: str
    run: Callable[[Check], None]
