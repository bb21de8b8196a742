"""Failures said in one line (goat_jax/train/failures.py): a full disk during a save or a
metrics write names the step, the last complete checkpoint and the way on, and leaves no 0-byte
TensorBoard file; a dead peer names the dead task. TensorBoard events are not duplicated on
resume (read back from the event files)."""

import errno
import os
import shutil

import orbax.checkpoint as ocp
import pytest

from configs import lm_tiny
from goat_jax.train import failures, metrics, trainer


def _config(steps=4):
    config = lm_tiny.get_config("goat,smoke")
    config.progress_bar, config.num_train_steps = False, steps
    config.checkpoint_every_steps, config.keep_checkpoints, config.eval_every_steps = 2, 5, 0
    return config


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_during_a_save_is_one_line_naming_the_step_and_the_last_checkpoint(tmp_path, monkeypatch):
    original = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if step == 4:
            _enospc()
        return original(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    workdir = tmp_path / "run"
    with pytest.raises(failures.DiskFullError) as info:
        trainer.train_and_evaluate(_config(), str(workdir))
    message = str(info.value)
    assert message.startswith("disk full") and "\n" not in message and isinstance(info.value, OSError)  # the CLI prints it as one line
    assert "disk full (No space left on device) while saving a checkpoint at step 4; the last complete " \
           f"checkpoint on disk is step 2 ({workdir}/checkpoints/2)" in message
    assert "rerun the same command: it resumes from step 2" in message
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert not [f for f in os.listdir(workdir / "tensorboard") if os.path.getsize(workdir / "tensorboard" / f) == 0]


def test_disk_full_while_logging_and_no_empty_events_file(tmp_path, monkeypatch):
    """A metrics row that cannot be written is said as such; a TensorBoard writer that cannot
    flush (the disk is full) leaves no 0-byte file behind."""
    (tmp_path / "w").mkdir()
    (tmp_path / "v").mkdir()
    monkeypatch.setattr(metrics, "_clean", _enospc)
    writer = metrics.MetricsWriter(str(tmp_path / "w"), total_steps=1, progress_bar=False)
    try:
        writer.write(3, {"train_loss": 1.0})
    except OSError as e:
        got = failures.explain(e, step=3, checkpoint_dir=str(tmp_path / "w" / "checkpoints"))
    writer.close()
    assert isinstance(got, failures.DiskFullError) and got.errno == errno.ENOSPC
    assert str(got).startswith("disk full (No space left on device) while writing metrics.jsonl at step 3; "
                               "no checkpoint is on disk yet")
    assert str(got).endswith("rerun the same command: it starts again.")

    from tensorboardX import record_writer  # pylint: disable=g-import-not-at-top
    monkeypatch.setattr(record_writer.RecordWriter, "flush", _enospc)
    writer = metrics.MetricsWriter(str(tmp_path / "v"), total_steps=1, progress_bar=False)
    tb = tmp_path / "v" / "tensorboard"
    assert [os.path.getsize(tb / f) for f in os.listdir(tb)] == [0]  # buffered, nothing on disk
    with pytest.raises(OSError):
        writer.close()
    assert os.listdir(tb) == []


@pytest.mark.parametrize("text,dead", [
    ("DEADLINE_EXCEEDED: Barrier timed out. Id: orbax_checkpoint_save_step_10. Tasks that have not "
     "reached the barrier: /job:jax_worker/replica:0/task:1", [1]),
    ("UNAVAILABLE: Task 2 heartbeat timeout. This indicates that the remote task has failed", [2]),
    ("Gloo all-reduce failed: Connection reset by peer", []),
    # JAX's coordination service, as a killed process 1's peer logs it (a real 2-process run).
    ("UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\nThe tasks "
     "have crashed. Check the task logs for an earlier error", [1]),
])
def test_a_dead_peer_is_named_with_what_is_safe(tmp_path, text, dead):
    (tmp_path / "checkpoints" / "8").mkdir(parents=True)
    (tmp_path / "checkpoints" / "10.orbax-checkpoint-tmp-123").mkdir()  # the interrupted save
    try:
        try:
            raise RuntimeError(text)
        except RuntimeError as inner:
            raise ValueError("checkpoint save failed") from inner
    except ValueError as e:
        got = failures.explain(e, step=10, checkpoint_dir=str(tmp_path / "checkpoints"), process_count=4,
                               process_index=0)
    assert isinstance(got, failures.PeerFailedError) and isinstance(got, OSError) and "\n" not in str(got)
    who = f"process(es) {', '.join(map(str, dead))} of 4" if dead else "another of the 4 processes"
    assert str(got).startswith(f"{who} died or stopped responding at step 10 (this is process 0")
    assert f"the last complete checkpoint on disk is step 8 ({tmp_path}/checkpoints/8)" in str(got)
    assert "restart all 4 processes with the same command: all resume from step 8" in str(got)
    # Single process, or an unrelated error: not explained (the original is raised).
    assert failures.explain(RuntimeError(text), step=1, checkpoint_dir=str(tmp_path)) is None
    assert failures.explain(KeyError("x"), step=1, checkpoint_dir=str(tmp_path), process_count=4) is None


def test_trim_events_drops_later_steps_and_keeps_the_rest(tmp_path):
    """Event files written by tensorboardX, trimmed at step 3, read back: steps 1..3 stay with
    their values, 4..6 are gone; a torn last record (a kill mid-write) is dropped too."""
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top

    writer = SummaryWriter(str(tmp_path))
    for step in range(1, 7):
        writer.add_scalar("train_loss", 10.0 - step, step)
        writer.add_scalar("grad_norm", float(step), step)
    writer.close()
    (name,) = os.listdir(tmp_path)
    with open(tmp_path / name, "ab") as f:
        f.write(b"\x20\x00\x00")  # the start of a record cut short
    assert len(metrics.read_events(str(tmp_path))) == 12
    metrics.trim_events(str(tmp_path), 3)
    got = sorted(metrics.read_events(str(tmp_path)))
    assert got == sorted([(s, "train_loss", 10.0 - s) for s in (1, 2, 3)] +
                         [(s, "grad_norm", float(s)) for s in (1, 2, 3)])
    (tmp_path / "events.out.tfevents.0.empty").write_bytes(b"")
    metrics.trim_events(str(tmp_path), 3)
    assert os.listdir(tmp_path) == [name]  # the empty file is removed, the trimmed one kept


@pytest.mark.slow(reason="trains, kills and resumes a run to read its TensorBoard events")
def test_tensorboard_events_are_not_duplicated_on_resume(tmp_path):
    """A run killed after logging step 4 but before its checkpoint: the resumed run logs 3 and
    4 again, and TensorBoard sees each step once, with the resumed values."""
    workdir = tmp_path / "run"
    trainer.train_and_evaluate(_config(), str(workdir))
    shutil.rmtree(workdir / "checkpoints" / "4")  # as if killed just before this save finished
    first = {(s, t): v for s, t, v in metrics.read_events(str(workdir / "tensorboard"))}
    trainer.train_and_evaluate(_config(), str(workdir))
    events = metrics.read_events(str(workdir / "tensorboard"))
    keys = [(s, t) for s, t, _ in events]
    assert len(keys) == len(set(keys)) and {s for s, _ in keys} == {1, 2, 3, 4}
    loss = {s: v for s, t, v in events if t == "train_loss"}
    assert loss == pytest.approx({s: first[(s, "train_loss")] for s in (1, 2, 3, 4)}, rel=1e-5)
