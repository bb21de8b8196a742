"""experiments.compile checks its flags and --out before any compile (minutes for a real
config), and never mixes two runs' results in one --out. The compiler is a stand-in here
(``aot.compile_train_step`` patched in the child process, and the real batch search driving a
stand-in that never fits): what is tested is what the command does around the compiler;
test_aot.py runs the real TPU compiler."""

import json
import os

import pytest

from tests.config_helpers import run_compile_only
from tests.marks import SLOW_CASE

_SCRIPT = """
import runpy, sys
import goat_jax.aot as aot

def fake_compile(config, target, **_):
    print("COMPILED", flush=True)
    return dict(target=target.name, num_devices=4, per_device_bytes=dict(total=1 << 30), device_memory_bytes=16 << 30,
                fits=True, attention_implementation="splash", compile_seconds=0.1, run="new")

def never_fits(config, target, **_):
    print("COMPILED", flush=True)
    return dict(fits=False, per_device_bytes=None, compiler_used_bytes=1, compile_seconds=0.1)

real_search = aot.largest_batch
aot.compile_train_step = fake_compile
aot.largest_batch = lambda config, target, **kw: real_search(config, target, compile_fn=never_fits, **kw)
aot.markdown = aot.search_markdown = lambda report, *a: "new\\n"
sys.argv = ["compile"] + sys.argv[1:]
runpy.run_module("experiments.compile", run_name="__main__")
"""


def _compile(*args):
    return run_compile_only(["-c", _SCRIPT, "--config", "configs/lm_tiny.py:goat,smoke", "--target", "v5e-4", *args],
                            timeout=120)


def _one_error(proc):
    """The command's single ``error:`` line, after checking it printed no usage text or traceback."""
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "USAGE" not in proc.stderr and "flags:" not in proc.stderr, proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "COMPILED" not in proc.stdout  # refused before any compile
    return errors[0]


def test_an_out_that_is_a_file_is_refused_before_the_compile(tmp_path):
    """Without --search_batch --out was checked only after compiling: a file there failed with
    FileExistsError once the compile (minutes) was done, and its result was lost."""
    out = tmp_path / "out"
    out.write_text("keep me")
    line = _one_error(_compile("--out", str(out)))
    assert f"--out {out} exists and is not a directory" in line  # the check evaluate makes
    assert out.read_text() == "keep me"


def test_an_out_with_results_is_refused_unless_overwrite_which_replaces_all_of_them(tmp_path):
    """A second compile into one --out replaced compile.json/compile.md silently and left an
    earlier search's search.* beside them (a reader then saw another config's "fits, batch 8")."""
    out = tmp_path / "out"
    out.mkdir()
    old = {"compile.json": '{"run": "old"}', "compile.md": "old", "search.json": "{}", "search.md": "old search"}
    for name, text in old.items():
        (out / name).write_text(text)
    (out / "notes.txt").write_text("mine")
    line = _one_error(_compile("--out", str(out)))
    assert f"--out {out} already holds results (compile.json, compile.md, search.json, search.md)" in line
    assert "--overwrite" in line
    assert {n: (out / n).read_text() for n in old} == old  # untouched
    proc = _compile("--out", str(out), "--overwrite")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(os.listdir(out)) == ["compile.json", "compile.md", "notes.txt"]  # no other run's search.*
    assert json.loads((out / "compile.json").read_text())["run"] == "new"
    proc = _compile("--out", str(out), "--overwrite", "--search_batch")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The search found no fitting batch: its files alone, not the single compile's compile.*.
    assert sorted(os.listdir(out)) == ["notes.txt", "search.json", "search.md"]


@pytest.mark.parametrize("flags,words", [
    (["--search_batch", "--search_start=0", "--max_compiles=-1"],
     "--search_start=0 and --max_compiles=-1: must be >= 1"),
    (["--search_batch", "--search_remat=of"], "--search_remat=of: 'of' is neither off nor on"),
    (["--search_start=4"], "--search_start apply to --search_batch only"),
])
def test_bad_search_flags_are_one_line_naming_the_flag(tmp_path, flags, words):
    """The search's bounds were reported with internal names (``largest_batch: start=0 and
    max_compiles=-1``), a bad --search_remat printed the whole help first, and --search_* without
    --search_batch was ignored."""
    line = _one_error(_compile("--out", str(tmp_path / "out"), *flags))
    assert words in line, line
    assert not (tmp_path / "out").exists()


_BLOCKING = """
import ctypes, runpy, sys, time
import goat_jax.aot as aot

class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

def compile_in_cpp(config, target, **_):
    # As XLA's compiler: 20 s in C code that never returns to Python bytecode (a mutex this
    # thread already holds, with a deadline; futex waits retry on a signal), the GIL released.
    libc = ctypes.CDLL(None, use_errno=True)
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_lock(mutex)
    print("COMPILING", flush=True)
    libc.pthread_mutex_timedlock(mutex, ctypes.byref(_Timespec(int(time.time()) + 20, 0)))
    raise SystemExit("the compile ran to its end")

aot.compile_train_step = compile_in_cpp
sys.argv = ["compile"] + sys.argv[1:]
runpy.run_module("experiments.compile", run_name="__main__")
"""


def test_ctrl_c_stops_a_compile_at_once_with_one_line(tmp_path):
    """SIGINT was acted on only when the compile returned (31 s later on a 54 s compile), then
    as a KeyboardInterrupt traceback; SIGTERM ended the process at once. Now both do."""
    import signal
    import subprocess
    import sys
    import time

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", _BLOCKING, "--config", "configs/lm_tiny.py:goat,smoke",
                             "--target", "v5e-4", "--out", str(tmp_path / "out")], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "COMPILING", proc.stderr.read()[-2000:]
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        stderr = proc.communicate(timeout=10)[1]
        took = time.monotonic() - sent
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, stderr[-2000:]
    assert took < 5, took
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == "interrupted (Ctrl-C): stopped the compile", stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["workdir", pytest.param("checkpoints", marks=SLOW_CASE), "below"])
def test_an_out_inside_a_run_workdir_is_refused_as_evaluate_refuses_it(tmp_path, where):
    """--out was accepted inside a run's workdir (and wrote beside its checkpoints); evaluate
    refused such an --out. One check now serves both."""
    run = tmp_path / "run"
    (run / "checkpoints" / "5").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"task": "lm"}))
    out = {"workdir": run, "checkpoints": run / "checkpoints", "below": run / "aot" / "v5e"}[where]
    line = _one_error(_compile("--out", str(out)))
    assert f"--out {out} is inside the run workdir {run}; the compile never writes into a run" in line, line
    assert f"--out {run}_compile" in line
    assert sorted(os.listdir(run)) == ["checkpoints", "config.json"] and not (run / "aot").exists()
