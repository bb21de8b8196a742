"""Training metrics: ``metrics.jsonl``, TensorBoard events and a tqdm progress bar.

``WORKDIR/metrics.jsonl`` holds one JSON object per line. Training rows have ``step``,
``train_loss``, ``learning_rate``, ``grad_norm``, ``tokens_per_sec``, ``mfu`` (null where the
accelerator's peak FLOP/s is unknown, e.g. on CPU) and ``elapsed_s``; eval rows have ``step`` and
``eval_*`` keys. Non-finite numbers are written as null so every line is strict JSON. On resume
the rows after the restored step are dropped, so the file always reads as one run; the
TensorBoard event files are trimmed the same way (:func:`trim_events`), and a 0-byte event file
(a writer that could not write, e.g. on a full disk) is removed when the writer closes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any, Dict, Optional

import numpy as np

from goat_jax import _extras, files
from goat_jax.targets import chips
from goat_jax.train import run as run_lib


def peak_flops_per_device(device_kind: str, override: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s of one device: ``override`` if positive, else the chip table's dense bf16
    peak (:func:`goat_jax.targets.chips.peak_flops_per_device`, matched by ``device_kind``),
    else None."""
    if override:
        return float(override)
    return chips.peak_flops_per_device(device_kind)


def _clean(value: Any) -> Any:
    """numpy/jax scalars -> Python; non-finite floats -> None (strict JSON)."""
    if isinstance(value, (np.generic, np.ndarray)) or hasattr(value, "item"):
        value = np.asarray(value).item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def describe(metrics: Dict[str, Any]) -> str:
    """One log line's worth of ``metrics``: ``eval_loss 2.3456, eval_ppl 10.44, eval_tokens
    1024`` (counts as integers, the rest to 4 significant digits)."""
    def fmt(key, value):
        if isinstance(value, float) and value.is_integer() and key.endswith(("_tokens", "_examples")):
            return f"{key} {int(value)}"
        return f"{key} {value:.4g}" if isinstance(value, (int, float)) else f"{key} {value}"
    return ", ".join(fmt(k, v) for k, v in metrics.items())


def truncate_jsonl(path: str, last_step: int) -> None:
    """Drops rows with ``step > last_step`` from ``path`` (atomically); the rows a resumed run
    is about to log again."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    kept, unreadable = [], []
    for number, line in enumerate(lines, 1):
        try:
            if json.loads(line).get("step", 0) <= last_step:
                kept.append(line)
        except (json.JSONDecodeError, AttributeError):
            unreadable.append(number)  # a line torn by a kill mid-write (the last), or damaged
    if unreadable:  # dropped, and said: never a row lost without a word
        logging.warning("%s: dropped %d unreadable line(s) (line %s of %d%s) while trimming it to step %d",
                        path, len(unreadable), ", ".join(map(str, unreadable[:5])), len(lines),
                        "; the last line is what a kill mid-write tears" if unreadable == [len(lines)] else "",
                        last_step)
    files.write_whole(path, "".join(kept))


# TensorBoard event files: TFRecords (little-endian u64 length, masked CRC32C of it, the Event
# proto, its masked CRC32C), one file per writer, ``events.out.tfevents.*``.
_EVENTS_PREFIX = "events.out.tfevents."


def _event_records(path: str) -> list:
    """The raw records of an event file, up to the first torn one (a kill mid-write)."""
    import struct  # pylint: disable=g-import-not-at-top

    with open(path, "rb") as f:
        data = f.read()
    out, pos = [], 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        end = pos + 12 + length + 4
        if end > len(data):
            break
        out.append(data[pos + 12:pos + 12 + length])
        pos = end
    return out


def read_events(directory: str) -> list:
    """``[(step, tag, value)]`` of every scalar in the event files of ``directory``, file by
    file in name order (what TensorBoard would plot)."""
    from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top

    out = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if name.startswith(_EVENTS_PREFIX):
            for record in _event_records(os.path.join(directory, name)):
                event = event_pb2.Event.FromString(record)
                out += [(int(event.step), v.tag, float(v.simple_value)) for v in event.summary.value]
    return out


def trim_events(directory: str, last_step: int) -> None:
    """Drops the events with ``step > last_step`` from the event files in ``directory``
    (rewritten whole, then renamed), as :func:`truncate_jsonl` does for ``metrics.jsonl``: a
    resumed run logs those steps again, and TensorBoard would plot both. Empty files (a writer
    that died before its first record, e.g. on a full disk) are removed."""
    import struct  # pylint: disable=g-import-not-at-top

    from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
    from tensorboardX.record_writer import masked_crc32c  # pylint: disable=g-import-not-at-top

    if not os.path.isdir(directory):
        return
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.startswith(_EVENTS_PREFIX) or not os.path.isfile(path):
            continue
        if os.path.getsize(path) == 0:
            os.remove(path)
            continue
        records = _event_records(path)
        kept = [r for r in records if event_pb2.Event.FromString(r).step <= last_step]
        if len(kept) == len(records) and sum(len(r) + 16 for r in records) == os.path.getsize(path):
            continue  # nothing to drop, nothing torn
        framed = []
        for r in kept:
            header = struct.pack("<Q", len(r))
            framed.append(header + struct.pack("<I", masked_crc32c(header)) + r + struct.pack("<I", masked_crc32c(r)))
        files.write_whole(path, b"".join(framed))


def remove_empty_events(directory: str) -> None:
    """Removes 0-byte event files (a TensorBoard writer that could not write, e.g. a full disk)."""
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith(_EVENTS_PREFIX) and os.path.isfile(path) and os.path.getsize(path) == 0:
            os.remove(path)


class Throughput:
    """Tokens/s and MFU between consecutive :meth:`update` calls.

    Args:
      tokens_per_step: tokens in one global batch.
      flops_per_token: training FLOPs per token (forward + backward), or None.
      peak_flops: summed peak FLOP/s of all devices, or None (then ``mfu`` is None).
    """

    def __init__(self, tokens_per_step: int, flops_per_token: Optional[float], peak_flops: Optional[float]):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._last: Optional[tuple] = None

    def reset(self, step: int) -> None:
        """Starts timing at ``step`` (e.g. after compilation, or after an eval pause)."""
        self._last = (step, time.perf_counter())

    def update(self, step: int) -> Dict[str, Optional[float]]:
        """``{'tokens_per_sec', 'mfu'}`` since the previous call (None for the first)."""
        now = time.perf_counter()
        out = {"tokens_per_sec": None, "mfu": None}
        if self._last is not None and step > self._last[0] and now > self._last[1]:
            tok_s = (step - self._last[0]) * self.tokens_per_step / (now - self._last[1])
            out["tokens_per_sec"] = tok_s
            if self.flops_per_token and self.peak_flops:
                out["mfu"] = tok_s * self.flops_per_token / self.peak_flops
        self._last = (step, now)
        return out


class MetricsWriter:
    """Writes rows to ``metrics.jsonl`` and TensorBoard, and drives the progress bar.

    Only the primary host should create one with ``enabled=True``; others get no-ops.

    Args:
      workdir: run directory.
      total_steps, initial_step: progress-bar range.
      enabled: write anything at all (False on non-primary hosts).
      progress_bar: show a tqdm bar (stderr).
      sinks: more ``row -> None`` receivers of every written row (e.g. W&B).
    """

    def __init__(self, workdir: str, *, total_steps: int, initial_step: int = 0, enabled: bool = True,
                 progress_bar: bool = True, sinks=()):
        self.enabled = enabled
        self.path = run_lib.metrics_path(workdir)
        self._start = time.perf_counter()
        self._file = self._tb = self._bar = None
        self._sinks = [s for s in sinks if s is not None]
        if not enabled:
            return
        with _extras.imports(__name__):  # a missing extra: one line naming it, before any write
            from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
        truncate_jsonl(self.path, initial_step)
        self._tb_dir = run_lib.tensorboard_dir(workdir)
        trim_events(self._tb_dir, initial_step)  # a resumed run logs the later steps again
        self._file = open(self.path, "a")
        try:
            # The pid in the name: tensorboardX names files by the second, and a run resumed
            # within the same second would otherwise truncate the previous file.
            self._tb = SummaryWriter(self._tb_dir, filename_suffix=f".{os.getpid()}")
        except OSError:
            self._file.close()
            remove_empty_events(self._tb_dir)
            raise
        if progress_bar:
            with _extras.imports(__name__):
                from tqdm import tqdm  # pylint: disable=g-import-not-at-top
            self._bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True,
                             smoothing=0.1)
        self._bar_step = initial_step

    def write(self, step: int, metrics: Dict[str, Any]) -> Dict[str, Any]:
        """Appends ``{'step': step, **metrics, 'elapsed_s'}`` (flushed: a killed run keeps it)
        and logs the numeric values to TensorBoard. Returns the cleaned row."""
        row = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()},
               "elapsed_s": round(time.perf_counter() - self._start, 4)}
        if not self.enabled:
            return row
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(key, value, step)
        for sink in self._sinks:
            sink(row)
        return row

    def progress(self, step: int, loss: Optional[float] = None, lr: Optional[float] = None,
                 tokens_per_sec: Optional[float] = None) -> None:
        """Moves the bar to ``step``; updates its loss / lr / tok/s readout when given."""
        if self._bar is None:
            return
        if loss is not None:
            post = {"loss": f"{loss:.4f}"}
            if lr is not None:
                post["lr"] = f"{lr:.2e}"
            if tokens_per_sec:
                post["tok/s"] = f"{tokens_per_sec:,.0f}"
            self._bar.set_postfix(post, refresh=False)
        self._bar.update(step - self._bar_step)
        self._bar_step = step

    def close(self) -> None:
        """Flushes and closes the file, the TensorBoard writer and the bar."""
        try:
            if self._bar is not None:
                self._bar.close()
            if self._tb is not None:
                self._tb.close()
            if self._file is not None:
                self._file.close()
        finally:
            self._file = self._tb = self._bar = None
            if self.enabled:
                remove_empty_events(self._tb_dir)  # never leave a 0-byte events file behind
