"""What an evaluation has finished so far, kept on disk one length at a time, so that a killed
or preempted evaluation resumes where it stopped instead of from its first length.

An LM row of the tiny report scores eleven lengths, up to 65,536 tokens; its longest lengths take
minutes on an idle machine and up to an hour beside other work. The harness caches a run's
evaluation whole (:func:`goat_jax.reproduce.jobs.evaluate`), which alone would lose every finished
length when a sitting ends mid-evaluation. :class:`LengthProgress` is the file in between: each
length's result is written as soon as it is scored, under a key naming what the numbers depend
on (the suite's evaluation settings and the weights read), and an evaluation of the same key
takes them back. A file made under another key (other settings, a retrained run) is ignored and
replaced, never mixed in. The harness deletes the file once the whole evaluation is cached.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from goat_jax import cli, files


class LengthProgress:
    """The finished lengths of one evaluation, in ``path`` (JSON: ``{"key": ..., "lengths":
    {n: {"result": ..., "cost": ...}}}``).

    ``key``: a JSON-able value naming what the evaluation's numbers depend on; the file is read
    only when it holds the same key. ``name``: the run's name in the log lines (with ``log``,
    what was taken back or why a file was not). Every :meth:`put` rewrites the file whole
    (:func:`goat_jax.files.write_whole`), so a kill mid-write leaves the lengths before it."""

    def __init__(self, path: str, key: Any, name: str = "", log: bool = False):
        self.path = path
        self.key = json.loads(json.dumps(key, default=list))  # as a later read of the file sees it
        self.name = name or path
        self._lengths: dict[int, dict[str, Any]] = {}
        self._earlier: set[int] = set()  # the lengths read from the file (scored by earlier sittings)
        if not os.path.exists(path):
            return
        try:
            held = files.read_json_object(path)
        except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if log:
                cli.log(f"  {self.name}: the finished lengths in {path} are unreadable ({e}); scoring every length")
            return
        if held.get("key") != self.key:
            if log:
                cli.log(f"  {self.name}: the finished lengths in {path} were made with other settings or of "
                        "other weights; scoring every length")
            return
        self._lengths = {int(n): v for n, v in held.get("lengths", {}).items()}
        self._earlier = set(self._lengths)
        if log and self._lengths:
            cli.log(f"  {self.name}: taking back the lengths an earlier sitting finished: "
                    + ", ".join(str(n) for n in sorted(self._lengths)))

    def lengths(self) -> list[int]:
        """The finished lengths, shortest first."""
        return sorted(self._lengths)

    def get(self, length: int) -> Optional[tuple[dict, dict]]:
        """(result, cost) of ``length`` if it is finished, else None."""
        held = self._lengths.get(int(length))
        return (held["result"], held["cost"]) if held is not None else None

    def earlier_seconds(self) -> float:
        """The seconds the lengths read from the file took in the sittings that scored them: with
        this sitting's wall clock, what the whole evaluation cost."""
        return float(sum(float(self._lengths[n]["cost"].get("seconds") or 0.0) for n in self._earlier))

    def put(self, length: int, result: dict, cost: dict) -> None:
        """Records ``length`` as finished with its ``result`` and ``cost`` and rewrites the file."""
        self._lengths[int(length)] = json.loads(json.dumps({"result": result, "cost": cost}, default=float))
        text = json.dumps({"key": self.key, "lengths": {str(n): v for n, v in sorted(self._lengths.items())}})
        files.write_whole(self.path, text)

    def remove(self) -> None:
        """Deletes the file (the evaluation is cached whole now); nothing if there is none."""
        if os.path.exists(self.path):
            os.remove(self.path)


def finished_lengths(path: str, key: Any) -> list[int]:
    """The lengths the file at ``path`` holds under ``key`` (``[]`` when there is no such file,
    it is unreadable, or it holds another key): what ``--status`` shows of an evaluation under way."""
    return LengthProgress(path, key).lengths()
