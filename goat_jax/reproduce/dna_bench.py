"""The genome model's training step, compiled and timed, GOAT vs RoPE: what the DNA section's
memory table and ``experiments.bench_dna`` (benchmarks/dna.md) measure.

1. Memory: XLA's ``memory_analysis()`` of the compiled training step (forward, backward, AdamW
   update) of the official genome GPT (configs/dna_hg38.py: d 512, 8 layers, 8 heads, bf16
   compute) at each length, with the batch set so every step holds the official 8 x 1024 = 8,192
   bases (at least one sequence). Arguments = parameters + Adam moments + batch; temporaries =
   activations and workspace. Compiling needs no execution, so every length is measured on any
   host. On a GPU, the device's peak bytes after running ``timed_steps`` steps is added.
2. Throughput: training tokens/s of the same step, GOAT and RoPE alternating so that load on a
   shared machine hits both alike, median of ``repeats``.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import optax
from goat_jax.config.files import load_config
from goat_jax.train import tasks
from goat_jax.kernels.plan import AttentionPlan

ENCODINGS = ("goat", "rope")
OFFICIAL_CONFIG = "configs/dna_hg38.py"
OFFICIAL_TOKENS_PER_STEP = 8192  # 8 x 1024 bases, the official genome run


def make_step(encoding: str, seq_len: int, batch: int, dtype: str, implementation: Optional[str] = None,
              model_overrides: Optional[dict] = None):
    """(jitted train step, state, batch) of the official model at ``seq_len``: the task's loss,
    AdamW as in the recipe, one fixed random batch. ``implementation``: the attention kernel
    (None or '' = auto); ``model_overrides``: model fields to change (e.g. a smaller model for
    tests)."""
    config = load_config(f"{OFFICIAL_CONFIG}:{encoding}")
    config.seq_len = seq_len
    config.model.training_seq_len = 1024  # trained at the official L, whatever the length here
    config.model.dtype = dtype
    config.model.implementation = implementation or None
    for key, value in (model_overrides or {}).items():
        config.model[key] = value
    task = tasks.get_task(config.task)
    model = task.build_model(config, AttentionPlan.from_config(config))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 5, (batch, seq_len + 1)).astype(np.int32)
    data = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
            "weights": jnp.ones((batch, seq_len), jnp.float32)}
    params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), data["inputs"][:1])["params"])
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))
    state = (params, opt.init(params))

    def step(state, batch):
        params, opt_state = state

        def loss_fn(p):
            loss_sum, (weight, _) = task.loss(model.apply, p, batch, None)
            return loss_sum / weight

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return jax.jit(step, donate_argnums=0), state, data


def memory_row(encoding: str, seq_len: int, dtype: str, *, tokens_per_step: int = OFFICIAL_TOKENS_PER_STEP,
               timed_steps: int = 5, implementation: Optional[str] = None,
               model_overrides: Optional[dict] = None) -> dict:
    """Compiled memory (MiB) of one training step at ``seq_len`` holding ``tokens_per_step``
    bases; on GPUs also the device's peak MiB after ``timed_steps`` steps (else None)."""
    batch = max(1, tokens_per_step // seq_len)
    step, state, data = make_step(encoding, seq_len, batch, dtype, implementation, model_overrides)
    mem = step.lower(state, data).compile().memory_analysis()
    row = {"encoding": encoding, "length": seq_len, "batch": batch,
           "arguments": mem.argument_size_in_bytes / 2**20, "temporaries": mem.temp_size_in_bytes / 2**20,
           "outputs": mem.output_size_in_bytes / 2**20, "peak": None}
    device = jax.devices()[0]
    if device.platform == "gpu":
        for _ in range(timed_steps):
            state, loss = step(state, data)
        jax.block_until_ready(loss)
        row["peak"] = device.memory_stats().get("peak_bytes_in_use", 0) / 2**20
    return row


def timers(seq_len: int, dtype: str, tokens: int,
           implementation: Optional[str] = None) -> dict[str, Callable[[int], float]]:
    """``{encoding: run(n) -> tokens/s of n steps}``, each compiled and warmed up once."""
    batch = max(1, tokens // seq_len)
    out = {}
    for e in ENCODINGS:
        step, state, data = make_step(e, seq_len, batch, dtype, implementation)
        holder = {"state": step(state, data)[0]}

        def run(n, step=step, holder=holder, data=data):
            t0 = time.perf_counter()
            for _ in range(n):
                holder["state"], loss = step(holder["state"], data)
            jax.block_until_ready(loss)
            return batch * seq_len * n / (time.perf_counter() - t0)

        out[e] = run
    return out


def run_benchmark(lengths: Sequence[int], *, dtype: str = "bfloat16",
                  tokens_per_step: int = OFFICIAL_TOKENS_PER_STEP, implementation: str = "", timed_length: int = 1024, timed_steps: int = 5,
                  timed_tokens: int = 0, timed_dtype: str = "", repeats: int = 3,
                  command: str = "python -m experiments.bench_dna") -> str:
    """Measures memory at every length and tokens/s at ``timed_length`` (``repeats`` 0: memory
    only; ``timed_tokens`` 0: ``tokens_per_step``; ``timed_dtype`` '': ``dtype``) and returns
    benchmarks/dna.md's markdown, naming ``command`` (the command line that made it)."""
    timed_dtype = timed_dtype or dtype
    rows = []
    for n in lengths:
        for e in ENCODINGS:
            rows.append(memory_row(e, n, dtype, tokens_per_step=tokens_per_step, timed_steps=timed_steps,
                                   implementation=implementation))
            print(f"memory {e} L={n}: {rows[-1]}", flush=True)
    tokens = timed_tokens or tokens_per_step
    run = timers(timed_length, timed_dtype, tokens, implementation) if repeats else {}
    speeds = {e: [] for e in ENCODINGS}
    for _ in range(repeats):
        for e in ENCODINGS:
            speeds[e].append(run[e](timed_steps))
            print(f"tokens/s {e}: {speeds[e][-1]:.0f}", flush=True)
    device = jax.devices()[0]
    lines = [
        "# Genome model: training-step memory and throughput, GOAT vs RoPE", "",
        f"Made by `{command}` on {datetime.date.today()}: {jax.device_count()} x {device.platform} "
        f"({device.device_kind}; {platform.machine()}), jax {jax.__version__}.", "",
        "Model: the official genome GPT (`configs/dna_hg38.py`: d 512, 8 layers, 8 heads, GELU MLP "
        "2048, biases, tied embeddings, vocab 5; GOAT R = 2, M = 8; RoPE base 1e4), compute "
        f"{dtype}, parameters float32, attention kernel `implementation={implementation or None}`. Each step "
        f"holds {tokens_per_step} bases (batch = {tokens_per_step} / length, at least 1). Memory is "
        "XLA's `memory_analysis()` of the compiled step (forward, backward, AdamW): arguments = "
        "parameters + Adam moments + batch, temporaries = activations and workspace.", "",
        "| length | batch | encoding | arguments MiB | temporaries MiB | device peak MiB |",
        "|---|---|---|---|---|---|"]
    for r in rows:
        peak = "-" if r["peak"] is None else f"{r['peak']:.1f}"
        lines.append(f"| {r['length']} | {r['batch']} | {r['encoding']} | {r['arguments']:.1f} | "
                     f"{r['temporaries']:.1f} | {peak} |")
    ratio = {n: next(r["temporaries"] for r in rows if r["length"] == n and r["encoding"] == "goat") /
             next(r["temporaries"] for r in rows if r["length"] == n and r["encoding"] == "rope")
             for n in lengths}
    lines += ["", "GOAT / RoPE temporaries: " + ", ".join(f"{ratio[n]:.3f} at {n}" for n in lengths)
              + ".", ""]
    if not repeats:
        return "\n".join(lines[:-1])
    lines += [
        f"Throughput at length {timed_length} ({timed_dtype}, batch {max(1, tokens // timed_length)}, "
        f"{timed_steps} steps per repeat, {repeats} alternating repeats, median):", "",
        "| encoding | tokens/s (median) | all repeats |", "|---|---|---|"]
    for e in ENCODINGS:
        lines.append(f"| {e} | {statistics.median(speeds[e]):,.0f} | "
                     + ", ".join(f"{s:,.0f}" for s in speeds[e]) + " |")
    g, r = statistics.median(speeds["goat"]), statistics.median(speeds["rope"])
    lines += ["", f"GOAT / RoPE tokens/s: {g / r:.3f}.", ""]
    return "\n".join(lines)
