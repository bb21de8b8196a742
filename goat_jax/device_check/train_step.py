"""Section 3 of the device check, the 125M LM train step, and the step measurement that the
levers (:mod:`goat_jax.device_check.levers`) share.

One :class:`StepVariant` is an :class:`goat_jax.models.lm.LMConfig`, a batch, a length and
whether XLA's GPU options (``goat_jax.platforms.GPU_XLA_FLAGS``, GPUs only) are on.
:func:`measure_step` compiles its AdamW train step (bf16 compute, float32 master weights, the
model's own loss: ``TransformerLM.token_loss``, so ``loss_chunk_size`` takes effect), reads
XLA's memory plan, skips a step that would not fit in the device's memory, and times
``steps`` steps: ms/step, tokens/s and MFU (model FLOPs from ``lm_flops_per_token`` over the
chip table's dense bf16 peak; GPUs only, since a CPU has no row).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List

from goat_jax.device_check import Check, Section
from goat_jax.device_check.report import table


@dataclasses.dataclass(frozen=True)
class StepVariant:
    """One train step to time: ``cfg`` (an LMConfig) at ``batch`` x ``seq`` tokens."""

    name: str
    encoding: str
    cfg: Any
    batch: int
    seq: int
    gpu_xla_flags: bool = False


def base_config(dry_run: bool, **overrides):
    """``(LMConfig, batch, seq)`` of the step's base: the Llama-style 125M of
    ``configs/lm_c4_125m.py:goat,llama`` built without ml_collections (12 x 768, 12 heads,
    SwiGLU 2560, 32k vocabulary, bf16 compute, float32 weights, scanned layers, no remat) at
    8 x 2,048 tokens, or a tiny float32 model on CPU (``dry_run``)."""
    from goat_jax.models.lm import LMConfig  # pylint: disable=g-import-not-at-top

    if dry_run:
        fields = dict(vocab_size=259, num_layers=1, embed_dim=32, num_heads=2, mlp_dim=64, pos_rank=2, abs_rank=2,
                      training_seq_len=32, dtype="float32", scan_layers=True)
        batch, seq = 2, 32
    else:
        fields = dict(vocab_size=32_000, num_layers=12, embed_dim=768, num_heads=12, mlp_dim=2560,
                      training_seq_len=2048, dtype="bfloat16", param_dtype="float32", scan_layers=True)
        batch, seq = 8, 2048
    return LMConfig(**{**fields, **overrides}), batch, seq


def measure_step(variant: StepVariant, steps: int, deadline: float) -> Dict[str, Any]:
    """Compiles and times ``variant``'s train step (module docstring). Returns its numbers:
    ``compile_s``, ``planned_gib``, ``steps``, ``ms``, ``tokens_s``, ``mfu``, ``est_ms`` (at
    peak), ``loss``, ``device``, ``note`` (why it did not run, if it did not)."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    import optax  # pylint: disable=g-import-not-at-top

    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    from goat_jax.models.lm import TransformerLM, lm_flops_per_token  # pylint: disable=g-import-not-at-top
    from goat_jax.targets import chips  # pylint: disable=g-import-not-at-top

    cfg, batch, seq = variant.cfg, variant.batch, variant.seq
    device = jax.devices()[0]
    out: Dict[str, Any] = {"device": device.device_kind, "note": ""}
    model = TransformerLM(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (batch, seq + 1)), jnp.int32)
    weights = jnp.ones((batch, seq), jnp.float32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
    tx = optax.adamw(1e-4, weight_decay=0.1)
    opt_state = tx.init(params)

    def step(params, opt_state, tokens):
        def loss_fn(p):
            total, count = model.apply({"params": p}, tokens[:, :-1], tokens[:, 1:], weights, method="token_loss")
            return total / count
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    options = platforms.gpu_compiler_options(variant.gpu_xla_flags, device.platform)
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1), compiler_options=options).lower(params, opt_state, tokens).compile()
    out["compile_s"] = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    planned = None if mem is None else (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                        + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    out["planned_gib"] = None if planned is None else planned / 2**30
    limit = (device.memory_stats() or {}).get("bytes_limit")
    peak = chips.peak_flops_per_device(device.device_kind)
    flops = lm_flops_per_token(cfg, seq) * batch * seq
    out["est_ms"] = None if peak is None else 1e3 * flops / peak
    out.update(steps=0, ms=None, tokens_s=None, mfu=None, loss=None)
    if limit and planned and planned > 0.9 * limit:
        out["note"] = f"not run: plans {planned / 2**30:.1f} GiB of {limit / 2**30:.0f}"
        return out
    for _ in range(2):  # warm-up (the first call may still load the executable)
        params, opt_state, loss = compiled(params, opt_state, tokens)
    jax.block_until_ready(loss)
    done, t0 = 0, time.perf_counter()
    while done < steps and (done < 2 or time.time() < deadline):
        params, opt_state, loss = compiled(params, opt_state, tokens)
        jax.block_until_ready(loss)
        done += 1
    dt = (time.perf_counter() - t0) / max(done, 1)
    out.update(steps=done, ms=1e3 * dt, tokens_s=batch * seq / dt, loss=float(loss))
    if peak is not None and jax.default_backend() == "gpu":
        out["mfu"] = flops / dt / peak
    return out


def train_step_rows(dry_run: bool, steps: int, deadline: float) -> List[List]:
    """Section 3's one row: the GOAT 125M step at its base settings (:func:`base_config`)."""
    from goat_jax.targets import chips  # pylint: disable=g-import-not-at-top

    cfg, batch, seq = base_config(dry_run)
    r = measure_step(StepVariant("base", "goat", cfg, batch, seq), steps, deadline)
    peak = chips.peak_flops_per_device(r["device"])
    name = "tiny (dry run)" if dry_run else "125M (12 x 768, 12 heads, GOAT)"
    return [[name, cfg.dtype, batch, seq, r["steps"], r["ms"], r["est_ms"], r["tokens_s"], r["mfu"],
             r["planned_gib"], f"{r['device']}, peak {peak / 1e12 if peak else '-'} TFLOP/s bf16",
             r["note"] or (f"loss {r['loss']:.3f}" if r["loss"] is not None else "")]]


def run_train_step(check: Check) -> None:
    """Section 3."""
    rows = train_step_rows(check.dry_run, 2 if check.dry_run else 30, check.deadline + 30)
    check.report.section("3. LM train step (measured, beside the compile-time estimate: step time at 100% of the "
                         "peak, and XLA's memory plan)", table(
                             ["model", "compute dtype", "batch", "seq", "steps timed", "ms/step", "est. ms/step at peak",
                              "tokens/s", "MFU", "planned GiB", "device", "note"], rows))


TRAIN_STEP = Section("3", "3. LM train step", run_train_step)
