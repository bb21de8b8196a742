"""Benchmarks the training step; writes benchmarks/train_step.md.

    python -m experiments.bench_train_step [--out benchmarks/train_step.md] [--repeats 3]

1. Engine overhead: steady-state seconds (wall and CPU) per step of ``trainer.train_and_evaluate``
   on the tiny config (real data pipeline, metrics.jsonl + TensorBoard + progress bar, async
   checkpoints) against a bare loop of the same jitted step on one fixed device batch. Runs
   alternate and the median of ``--repeats`` is reported, since the machine may be shared.
2. Position encodings: GOAT vs RoPE vs NoPE train-step time and XLA's compiled memory
   (``memory_analysis()``: arguments = params + Adam state + batch, temporaries = activations and
   workspace) for the tiny and the 125M shapes.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import tempfile
import time

import jax
import numpy as np
from goat_jax import _extras
with _extras.imports(__name__):  # the 'train' extra: one line naming it if absent
    from absl import app
    from absl import flags

from goat_jax.config.files import load_config
from goat_jax.train import run as run_lib
from goat_jax.train import sharding as sharding_lib
from goat_jax.train import tasks
from goat_jax.train import trainer
from goat_jax.kernels.plan import AttentionPlan

_OUT = flags.DEFINE_string("out", "benchmarks/train_step.md", "Markdown file to write.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Alternating repeats of engine / bare runs.")
_STEPS = flags.DEFINE_integer("steps", 200, "Measured steps per engine / bare run.")
_SEQ_125M = flags.DEFINE_integer("seq_125m", 256, "Sequence length for the 125M shape on CPU.")
_BATCH_125M = flags.DEFINE_integer("batch_125m", 2, "Global batch for the 125M shape on CPU.")
_SKIP_125M = flags.DEFINE_bool("skip_125m", False, "Skip the 125M shape.")

WARMUP = 20  # steps before the measured ones (compilation, allocator warm-up)
ENCODINGS = ("goat", "rope", "nope")


def _bare_step(config, real_data: bool = True):
    """The engine's jitted train step for ``config``, its initial state and one device batch:
    the first batch of the task's data, or random tokens (``real_data=False``: no dataset needed,
    e.g. C4 for the 125M shape)."""
    task = tasks.get_task(config.task)
    mesh = sharding_lib.make_mesh(config.mesh)
    plan = AttentionPlan.from_config(config)  # the benchmark's one plan
    model = task.build_model(config, plan)
    tx, schedule = run_lib.make_optimizer(task, config)
    dummy = task.dummy_batch(config, config.global_batch_size)
    batch_sh = {k: sharding_lib.batch_sharding(mesh, v.ndim) for k, v in dummy.items()}
    _, init_state = run_lib.make_init_fns(task, model, tx, config, config.global_batch_size)
    state = jax.jit(init_state)(jax.random.PRNGKey(0))
    step = jax.jit(trainer.make_train_step(task, model, tx, schedule, config.grad_accum_steps),
                   donate_argnums=0)
    if real_data:
        host_batch = next(task.make_datasets(config, config.global_batch_size, 0, 1, plan=plan).train)
    else:
        tokens = np.random.default_rng(0).integers(3, config.model.vocab_size, dummy["inputs"].shape)
        host_batch = {**dummy, "inputs": tokens.astype(np.int32), "targets": tokens.astype(np.int32)}
    batch = {k: jax.device_put(v, batch_sh[k]) for k, v in host_batch.items()}
    return step, state, batch


def _clocks():
    return time.perf_counter(), time.process_time()


def _time_bare(step, state, batch, steps):
    """(wall, cpu) seconds per step of ``steps`` back-to-back steps after a warm-up."""
    for _ in range(WARMUP):
        state, metrics = step(state, batch)
    jax.block_until_ready(state)
    wall, cpu = _clocks()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    wall2, cpu2 = _clocks()
    return (wall2 - wall) / steps, (cpu2 - cpu) / steps, state


def _run_engine(config, steps):
    """Process CPU seconds of a whole run, and its metrics.jsonl ``{step: elapsed_s}``."""
    config.num_train_steps = steps
    cpu = time.process_time()
    with tempfile.TemporaryDirectory() as workdir:
        trainer.train_and_evaluate(config, workdir)
        with open(run_lib.metrics_path(workdir)) as f:
            elapsed = {r["step"]: r["elapsed_s"] for r in map(json.loads, f) if "train_loss" in r}
    return time.process_time() - cpu, elapsed


def _time_engine(config, steps):
    """(wall, cpu) seconds per step in steady state. Wall: between the rows of steps ``WARMUP``
    and ``WARMUP + steps`` of metrics.jsonl. CPU: the difference between a ``WARMUP + steps`` and
    a ``WARMUP``-step run, which cancels startup, compilation and the final checkpoint and keeps
    all a step costs (data, transfers, logging, periodic async checkpoints)."""
    cpu_short, _ = _run_engine(config, WARMUP)
    cpu_long, elapsed = _run_engine(config, WARMUP + steps)
    return (elapsed[WARMUP + steps] - elapsed[WARMUP]) / steps, (cpu_long - cpu_short) / steps


def engine_overhead(repeats: int, steps: int):
    """Per-repeat ``(wall, cpu)`` seconds per step: (engine runs, bare runs), alternating which
    goes first because the machine's load drifts."""
    config = load_config("configs/lm_tiny.py")
    config.log_every_steps = 10
    config.checkpoint_every_steps = 50  # async checkpoints inside the measured steps
    config.eval_every_steps = 0
    step, state, batch = _bare_step(config)
    engine, bare = [], []
    for i in range(repeats):
        if i % 2 == 0:
            engine.append(_time_engine(config, steps))
        wall, cpu, state = _time_bare(step, state, batch, steps)
        bare.append((wall, cpu))
        if i % 2 == 1:
            engine.append(_time_engine(config, steps))
    return engine, bare


def encoding_row(config, shape_name: str, encoding: str, timed_steps: int):
    """Step time and compiled memory of the bare step for one encoding."""
    config.model.position_encoding = encoding
    step, state, batch = _bare_step(config, real_data=False)
    compiled = step.lower(state, batch).compile()
    mem = compiled.memory_analysis()
    for _ in range(2):
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(timed_steps):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    seconds = (time.perf_counter() - start) / timed_steps
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    return {"shape": shape_name, "encoding": encoding, "params": n_params, "step_s": seconds,
            "tokens_per_s": config.global_batch_size * config.seq_len / seconds,
            "argument_mib": mem.argument_size_in_bytes / 2**20, "temp_mib": mem.temp_size_in_bytes / 2**20}


def main(argv):
    """Runs both benchmarks and writes the markdown table."""
    del argv
    engine_runs, bare_runs = engine_overhead(_REPEATS.value, _STEPS.value)
    med = lambda runs, i: float(np.median([r[i] for r in runs]))  # pylint: disable=unnecessary-lambda-assignment
    rows = []
    tiny = load_config("configs/lm_tiny.py")
    for enc in ENCODINGS:
        rows.append(encoding_row(load_config(f"configs/lm_tiny.py:{enc}"), f"tiny (seq {tiny.seq_len}, batch {tiny.global_batch_size})", enc, 50))
    if not _SKIP_125M.value:
        for enc in ENCODINGS:
            config = load_config(f"configs/lm_c4_125m.py:{enc},llama")  # the 32k Llama-style shape of the table
            config.seq_len = _SEQ_125M.value  # training_seq_len follows (FieldReference)
            config.global_batch_size = _BATCH_125M.value
            config.model.dtype = "float32"  # CPU has no fast bfloat16 matmul
            rows.append(encoding_row(config, f"125M (seq {config.seq_len}, batch {config.global_batch_size}, f32)", enc, 3))

    cpu = platform.processor() or platform.machine()
    lines = [
        "# Training-step benchmark",
        "",
        f"Made by `python -m experiments.bench_train_step` on {datetime.date.today()}: "
        f"{jax.device_count()} x {jax.devices()[0].device_kind} ({cpu}, {os.cpu_count()} cores, "
        f"shared with other jobs), jax {jax.__version__}. CPU numbers: they show relative costs, not "
        "accelerator throughput.",
        "",
        "## Engine overhead (tiny config, float32)",
        "",
        "Steady-state seconds per training step. *Engine*: `trainer.train_and_evaluate` with the real "
        "Jargon-File pipeline, metrics.jsonl/TensorBoard every 10 steps, the progress bar and an async "
        f"checkpoint every 50 steps; wall time between steps {WARMUP} and {WARMUP + _STEPS.value} (the "
        "`elapsed_s` of metrics.jsonl), CPU time as the difference between a "
        f"{WARMUP + _STEPS.value}-step and a {WARMUP}-step run (cancels startup and compilation). "
        f"*Bare*: the same jitted train step on one fixed device batch, {_STEPS.value} steps back to "
        "back after a warm-up, nothing else. Wall time and process CPU time (all threads: on a CPU "
        "host every bit of host work competes with XLA for the same cores, whereas an accelerator "
        f"overlaps it). Median of {len(engine_runs)} alternating repeats; the machine is shared, "
        "so single runs vary by up to ~10%.",
        "",
        "| | wall s/step | CPU s/step | wall, all runs | CPU, all runs |",
        "|---|---|---|---|---|",
        *[f"| {name} | {med(runs, 0):.4f} | {med(runs, 1):.4f} | "
          f"{', '.join(f'{r[0]:.4f}' for r in runs)} | {', '.join(f'{r[1]:.4f}' for r in runs)} |"
          for name, runs in (("engine", engine_runs), ("bare jitted step", bare_runs))],
        f"| **overhead** | **{100 * (med(engine_runs, 0) / med(bare_runs, 0) - 1):+.1f}%** | "
        f"**{100 * (med(engine_runs, 1) / med(bare_runs, 1) - 1):+.1f}%** | target <= 5% | |",
        "",
        "## GOAT vs RoPE vs NoPE",
        "",
        "Bare jitted train step (forward, backward, AdamW). Memory from XLA's `memory_analysis()` of "
        "the compiled step: arguments = params + Adam moments + batch; temporaries = activations and "
        "workspace. The 125M shape (lm_c4_125m: 12 layers, d 768, 12 heads, 32k vocab) is run at a "
        f"short sequence ({_SEQ_125M.value}) and batch ({_BATCH_125M.value}) in float32 so it fits this "
        "CPU; at 2048 tokens the attention share, and so the differences, are larger.",
        "",
        "| shape | encoding | params | s/step | tokens/s | arguments MiB | temporaries MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['encoding']} | {r['params']:,} | {r['step_s']:.4f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['argument_mib']:.1f} | {r['temp_mib']:.1f} |")
    lines.append("")
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    app.run(main)
