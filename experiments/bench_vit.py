"""Benchmarks the ViT training step per position encoding; writes benchmarks/vit.md.

    python -m experiments.bench_vit [--out benchmarks/vit.md] [--steps 5] [--batch_s16 4]
        [--encodings goat,ape,rope2d,rope_mixed]

For each shape (the tiny Fashion-MNIST ViT of configs/vit_tiny.py; ViT-S/16 of
configs/vit_s16_imagenet.py trained at 224 and at 384 px) and each encoding (GOAT, the official
'ape' baseline, 'rope2d', 'rope_mixed'; ``--encodings``): XLA's compiled memory of the jitted step (``memory_analysis()``:
arguments = params + AdamW state + batch, temporaries = activations and workspace) and the
median seconds per step. The step is the engine's: ``value_and_grad`` of the task loss
(:func:`goat_jax.tasks.vit.loss`, drop-path on) and the AdamW update of the config. Encodings
are timed round-robin, step by step, so a shared machine's load hits them alike.
"""

from __future__ import annotations

import datetime
import os
import platform
import time

import flax.linen as nn
import jax
import numpy as np
from goat_jax import _extras
with _extras.imports(__name__):  # the 'train' extra: one line naming it if absent
    import optax
    from absl import app
    from absl import flags

from configs import vit_s16_imagenet, vit_tiny
from goat_jax.models.vit import POSITION_ENCODINGS
from goat_jax.tasks import vit as vit_task
from goat_jax.kernels.plan import AttentionPlan

_OUT = flags.DEFINE_string("out", "benchmarks/vit.md", "Markdown file to write.")
_STEPS = flags.DEFINE_integer("steps", 5, "Measured steps per encoding and shape.")
_BATCH_TINY = flags.DEFINE_integer("batch_tiny", 128, "Batch of the tiny shape (its config's).")
_BATCH_S16 = flags.DEFINE_integer("batch_s16", 4, "Batch of the ViT-S/16 shapes on CPU.")
_IMPL = flags.DEFINE_string("implementation", "xla", "Attention kernel of every encoding (the "
                            "committed table: 'xla'; the automatic choice would take 'flash' for "
                            "the larger shapes).")

_ENCODINGS = flags.DEFINE_list("encodings", ["goat", "ape", "rope2d", "rope_mixed"],
                               "Encodings to time ('ape' is the ratio's baseline, so it is always run).")
WARMUP = 1  # steps after compilation before timing


def _shapes():
    """(label, config module, resolution, batch) of each benchmarked shape."""
    return [("tiny (Fashion-MNIST, 28 px, patch 7)", vit_tiny, 28, _BATCH_TINY.value),
            ("ViT-S/16, 224 px", vit_s16_imagenet, 224, _BATCH_S16.value),
            ("ViT-S/16, 384 px", vit_s16_imagenet, 384, _BATCH_S16.value)]


def _step_for(module, encoding: str, resolution: int, batch: int):
    """The compiled train step, its state and a random batch, for one shape and encoding."""
    config = module.get_config(encoding)
    config.model.image_size = resolution  # trained at this resolution: the 'ape' table matches
    config.model.dtype = "float32"  # CPU
    config.model.implementation = _IMPL.value  # one kernel for every encoding, named in the table
    config.data.image_size = resolution
    model = vit_task.build_model(config, AttentionPlan.from_config(config))
    tx = optax.adamw(1e-4, b1=config.optimizer.b1, b2=config.optimizer.b2, weight_decay=config.optimizer.weight_decay)
    rng = np.random.default_rng(0)
    data = vit_task.dummy_batch(config, batch)
    data["image"] = rng.standard_normal(data["image"].shape).astype(np.float32)
    params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), data["image"])["params"])
    opt_state = tx.init(params)

    def step(params, opt_state, batch, key):
        loss_fn = lambda p: vit_task.loss(model.apply, p, batch, key)
        (loss_sum, (weight, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss_sum / weight

    key = jax.random.PRNGKey(1)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, data, key).compile()
    mem = compiled.memory_analysis()
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    return compiled, [params, opt_state, data, key], mem, n_params


def main(argv):
    """Runs every shape and encoding and writes the markdown table."""
    del argv
    load_start = os.getloadavg()[0]
    encodings = ["ape"] + [e for e in _ENCODINGS.value if e != "ape"]  # 'ape': the ratio's baseline
    unknown = sorted(set(encodings) - set(POSITION_ENCODINGS))
    if unknown:  # before compiling anything
        raise app.UsageError(f"--encodings: unknown {unknown}; choose from {list(POSITION_ENCODINGS)}.")
    rows = []
    for label, module, res, batch in _shapes():
        runs = {}
        for enc in encodings:
            t0 = time.perf_counter()
            compiled, state, mem, n = _step_for(module, enc, res, batch)
            print(f"{label} {enc}: compiled in {time.perf_counter() - t0:.1f}s", flush=True)
            runs[enc] = dict(compiled=compiled, state=state, mem=mem, n=n, times=[])
        for i in range(WARMUP + _STEPS.value):
            for enc, r in runs.items():
                params, opt_state, data, key = r["state"]
                t0 = time.perf_counter()
                params, opt_state, loss = r["compiled"](params, opt_state, data, key)
                loss.block_until_ready()
                if i >= WARMUP:
                    r["times"].append(time.perf_counter() - t0)
                r["state"] = [params, opt_state, data, key]
        base = np.median(runs["ape"]["times"])
        for enc, r in runs.items():
            med = float(np.median(r["times"]))
            rows.append((label, batch, enc, r["n"], med, med / base, r["mem"].argument_size_in_bytes / 2**20,
                         r["mem"].temp_size_in_bytes / 2**20))
            print(rows[-1], flush=True)

    lines = [
        "# ViT train step: GOAT vs the official `ape` baseline vs " + ", ".join(
            f"`{e}`" for e in encodings if e not in ("goat", "ape")), "",
        "Made by `python -m experiments.bench_vit` "
        f"(`--steps {_STEPS.value} --batch_tiny {_BATCH_TINY.value} --batch_s16 {_BATCH_S16.value} "
        f"--implementation {_IMPL.value} --encodings {','.join(_ENCODINGS.value)}`) on "
        f"{datetime.date.today()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, jax {jax.__version__}, float32, attention kernel `{_IMPL.value}`; load average "
        f"{load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end.", "",
        "One step = forward + backward of the task loss (drop-path on) + AdamW update, jitted; time is "
        "the median over the measured steps, encodings interleaved step by step; `x ape` is the time "
        "ratio to `ape` in the same run. Memory is XLA's compiled `memory_analysis()`: arguments "
        "(params + AdamW state + batch) and temporaries (activations, workspace). Each shape is "
        "trained at its resolution (the `ape` table sized for it).", "",
        "| shape | batch | encoding | params | s / step | x ape | arguments MiB | temporaries MiB |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for label, batch, enc, n, med, ratio, arg, tmp in rows:
        lines.append(f"| {label} | {batch} | {enc} | {n:,} | {med:.3f} | {ratio:.2f} | {arg:.1f} | {tmp:.1f} |")
    lines += ["", "The machine is shared with other jobs: absolute times are noisy, the ratios within "
              "one shape are the comparison. GOAT's extra cost is the prior features packed into q/k "
              "(2R + 1 of each head's dims are prior channels, so its content dims are fewer, not "
              "more); `ape` adds a table, `rope2d` rotates q and k, `rope_mixed` rotates them by learned "
              "per-head angles."]
    with open(_OUT.value, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    app.run(main)
