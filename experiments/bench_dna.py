"""Benchmarks the genome model's training step, GOAT vs RoPE; writes benchmarks/dna.md.

    python -m experiments.bench_dna [--out benchmarks/dna.md] [--lengths 1024,4096,16384]

1. Memory: XLA's ``memory_analysis()`` of the compiled training step (forward, backward, AdamW
   update) of the official genome GPT (configs/dna_hg38.py: d 512, 8 layers, 8 heads, bf16
   compute) at each length, with the batch set so every step holds the official 8 x 1024 = 8,192
   bases (at least one sequence). Arguments = parameters + Adam moments + batch; temporaries =
   activations and workspace. Compiling needs no execution, so every length is measured on any
   host. On a GPU, the device's peak bytes after running ``--timed_steps`` steps is added.
2. Throughput: training tokens/s of the same step, GOAT and RoPE alternating, median of
   ``--repeats``, at ``--timed_length`` (default 1024, the official L).
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app
from absl import flags

from configs import dna_hg38
from goat_jax.train import tasks

_OUT = flags.DEFINE_string("out", "benchmarks/dna.md", "Markdown file to write.")
_LENGTHS = flags.DEFINE_string("lengths", "1024,4096,16384", "Sequence lengths (memory).")
_TOKENS = flags.DEFINE_integer("tokens_per_step", 8192, "Bases per step (official 8 x 1024).")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Compute dtype (official: bfloat16).")
_TIMED_LENGTH = flags.DEFINE_integer("timed_length", 1024, "Length of the tokens/s measurement.")
_TIMED_STEPS = flags.DEFINE_integer("timed_steps", 5, "Measured steps per repeat.")
_IMPL = flags.DEFINE_string("implementation", "", "Attention kernel (model.implementation): '' = "
                            "auto (goat_jax.kernels: 'flash' on CPU above 16 MiB of logits, cuDNN on a "
                            "GPU in bf16), 'xla' for XLA's materialized attention.")
_TIMED_TOKENS = flags.DEFINE_integer("timed_tokens", 0, "Bases per step of the tokens/s "
                                     "measurement (0: --tokens_per_step; a CPU needs fewer).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Alternating GOAT / RoPE repeats (median); 0: "
                                "memory only.")
_TIMED_DTYPE = flags.DEFINE_string("timed_dtype", "", "Compute dtype for tokens/s ('' = --dtype; "
                                   "CPUs emulate bfloat16 slowly, so float32 is fairer there).")

ENCODINGS = ("goat", "rope")


def _flag(holder):
    """A flag's value, or its default when the flags were never parsed (a library caller)."""
    return holder.value if flags.FLAGS.is_parsed() else holder.default


def make_step(encoding: str, seq_len: int, batch: int, dtype: str, implementation: Optional[str] = None,
              model_overrides: Optional[dict] = None):
    """(jitted train step, state, batch) of the official model at ``seq_len``: the task's loss,
    AdamW as in the recipe, one fixed random batch. ``implementation``: the attention kernel
    (default: ``--implementation``, '' = auto); ``model_overrides``: model fields to change
    (e.g. a smaller model for tests)."""
    config = dna_hg38.get_config(encoding)
    config.seq_len = seq_len
    config.model.training_seq_len = 1024  # trained at the official L, whatever the length here
    config.model.dtype = dtype
    config.model.implementation = (_flag(_IMPL) if implementation is None else implementation) or None
    for key, value in (model_overrides or {}).items():
        config.model[key] = value
    task = tasks.get_task(config.task)
    model = task.build_model(config)
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


def memory_row(encoding: str, seq_len: int, dtype: str, *, tokens_per_step: Optional[int] = None,
               timed_steps: Optional[int] = None, implementation: Optional[str] = None,
               model_overrides: Optional[dict] = None) -> dict:
    """Compiled memory (MiB) of one training step; device peak bytes on GPUs (after
    ``timed_steps`` steps). Arguments left None take the command-line flags' values (parsed or
    default), so other programs can call this without absl."""
    tokens_per_step = tokens_per_step or _flag(_TOKENS)
    timed_steps = _flag(_TIMED_STEPS) if timed_steps is None else timed_steps
    implementation = _flag(_IMPL) if implementation is None else implementation
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


def timers(seq_len: int, dtype: str, tokens: int) -> dict:
    """``{encoding: run(n) -> tokens/s of n steps}``, each compiled and warmed up once."""
    batch = max(1, tokens // seq_len)
    out = {}
    for e in ENCODINGS:
        step, state, data = make_step(e, seq_len, batch, dtype)
        holder = {"state": step(state, data)[0]}

        def run(n, step=step, holder=holder, data=data):
            t0 = time.perf_counter()
            for _ in range(n):
                holder["state"], loss = step(holder["state"], data)
            jax.block_until_ready(loss)
            return batch * seq_len * n / (time.perf_counter() - t0)

        out[e] = run
    return out


def main(argv):
    del argv
    lengths = [int(x) for x in _LENGTHS.value.split(",") if x]
    dtype, timed_dtype = _DTYPE.value, _TIMED_DTYPE.value or _DTYPE.value
    rows = []
    for n in lengths:
        for e in ENCODINGS:
            rows.append(memory_row(e, n, dtype))
            print(f"memory {e} L={n}: {rows[-1]}", flush=True)
    timed_tokens = _TIMED_TOKENS.value or _TOKENS.value
    # Alternate the encodings so load on a shared machine hits both alike.
    run = timers(_TIMED_LENGTH.value, timed_dtype, timed_tokens) if _REPEATS.value else {}
    speeds = {e: [] for e in ENCODINGS}
    for _ in range(_REPEATS.value):
        for e in ENCODINGS:
            speeds[e].append(run[e](_TIMED_STEPS.value))
            print(f"tokens/s {e}: {speeds[e][-1]:.0f}", flush=True)
    device = jax.devices()[0]
    lines = [
        "# Genome model: training-step memory and throughput, GOAT vs RoPE", "",
        f"Made by `python -m experiments.bench_dna --lengths {_LENGTHS.value} --dtype {dtype}"
        f"{' --timed_dtype ' + timed_dtype if _TIMED_DTYPE.value else ''}"
        f"{' --timed_tokens %d' % timed_tokens if _TIMED_TOKENS.value else ''}"
        f"{' --implementation ' + _IMPL.value if _IMPL.value else ''} --timed_steps "
        f"{_TIMED_STEPS.value} --repeats {_REPEATS.value}` on "
        f"{datetime.date.today()}: {jax.device_count()} x {device.platform} ({device.device_kind}; "
        f"{platform.machine()}), jax {jax.__version__}.", "",
        "Model: the official genome GPT (`configs/dna_hg38.py`: d 512, 8 layers, 8 heads, GELU MLP "
        "2048, biases, tied embeddings, vocab 5; GOAT R = 2, M = 8; RoPE base 1e4), compute "
        f"{dtype}, parameters float32, attention kernel `implementation={_IMPL.value or None}`. Each step "
        f"holds {_TOKENS.value} bases (batch = {_TOKENS.value} / length, at least 1). Memory is "
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
    if not _REPEATS.value:
        lines = lines[:-1]
    else:
        lines += [
              f"Throughput at length {_TIMED_LENGTH.value} ({timed_dtype}, batch "
              f"{max(1, timed_tokens // _TIMED_LENGTH.value)}, {_TIMED_STEPS.value} steps per repeat, "
              f"{_REPEATS.value} alternating repeats, median):", "",
              "| encoding | tokens/s (median) | all repeats |", "|---|---|---|"]
        for e in ENCODINGS:
            lines.append(f"| {e} | {statistics.median(speeds[e]):,.0f} | "
                         + ", ".join(f"{s:,.0f}" for s in speeds[e]) + " |")
        g, r = statistics.median(speeds["goat"]), statistics.median(speeds["rope"])
        lines += ["", f"GOAT / RoPE tokens/s: {g / r:.3f}.", ""]
    text = "\n".join(lines)
    with open(_OUT.value, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    app.run(main)
