"""Evaluate trained LM checkpoints: length extrapolation, passkey, NIAH and attention sinks.

    python -m experiments.evaluate --workdir runs/tiny --workdir runs/tiny_rope \\
        --evals extrapolation,sinks --out runs/eval
    python -m experiments.evaluate --workdir runs/passkey_goat --evals passkey --multipliers 1,2,4,8

Each ``--workdir`` is a run of ``experiments.train`` (its ``config.json`` and checkpoints); the
label of a run is its position encoding unless ``--label`` names them. Results go to
``OUT/results.json`` (all numbers), ``OUT/results.md`` (one table per evaluation, runs side by
side) and one PNG per evaluation, runs as lines (NIAH: one heatmap per run).

Evaluations (protocols in REFERENCE.md section 4; code in goat_jax.eval):
  extrapolation  perplexity on the held-out stream at ``m x`` the training length,
                 non-overlapping windows (``--stride`` for sliding); synthetic runs score
                 fresh batches of their own task at each length instead.
  passkey        synthetic passkey (teacher-forced exact match of the 8-digit key) and the
                 standard prompt (greedy decoding with the KV cache, first integer == key).
  niah           synthetic NIAH span token accuracy over lengths x depths (heatmap).
  sinks          attention mass on position 0 and first-key norm / other keys, per layer, on
                 held-out data at the training length.

This module also holds :func:`load_run`, the one place that turns a workdir back into
``(config, model, params)`` through the engine's checkpoint module.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from goat_jax.data import synthetic, text
from goat_jax.eval import extrapolation, plots, retrieval, sinks
from goat_jax.train import checkpoint as checkpoint_lib
from goat_jax.train import optim
from goat_jax.train import tasks as tasks_lib
from goat_jax.train import trainer

EVALS = ("extrapolation", "passkey", "niah", "sinks")
DEFAULT_MULTIPLIERS = (1, 2, 4, 8, 16)
NIAH_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # official GOAT NIAH depths


def log(msg: str) -> None:
    """Progress line on stdout (flushed: the harness runs under nohup with a log file)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# Loading a run
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """A trained model read back from its workdir."""

    workdir: str
    config: ml_collections.ConfigDict  # the resolved config the run wrote (config.json)
    model: Any  # the Linen model (decode=False)
    params: Any  # the 'params' collection, unboxed, on the default device
    step: int  # the checkpoint's step

    @property
    def label(self) -> str:
        """The position encoding: what the comparisons are about."""
        return str(self.config.model.position_encoding)

    @property
    def train_len(self) -> int:
        """The training context length."""
        return int(self.config.seq_len)

    @property
    def is_synthetic(self) -> bool:
        """Whether the run trained on a synthetic task (copy mixture, passkey, NIAH)."""
        return self.config.data.get("source") == "synthetic"


def load_run(workdir: str, step: Optional[int] = None) -> Run:
    """Restores the params of ``workdir``'s checkpoint at ``step`` (default: the latest).

    The abstract train state is rebuilt exactly as the trainer builds it (task model, optimizer,
    ``trainer.TrainState``) so ``checkpoint.Checkpointer.restore`` can read it; the optimizer
    state is restored too and dropped (the engine has no params-only restore).
    """
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: {workdir} is not a run of experiments.train.")
    with open(path) as f:
        config = ml_collections.ConfigDict(json.load(f))
    task = tasks_lib.get_task(config.task)
    model = task.build_model(config)
    tx, _ = optim.make_optimizer(config.optimizer, config.num_train_steps)
    inputs = task.model_inputs(task.dummy_batch(config, 1))

    def init_state(rng):
        params = nn.unbox(model.init(rng, *inputs)["params"])
        return trainer.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                            jax.eval_shape(init_state, jax.random.PRNGKey(0)))
    ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), config.to_dict(),
                                       keep=int(config.keep_checkpoints), async_save=False)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{workdir}/checkpoints holds no complete checkpoint.")
        state, _ = ckpt.restore(step, abstract)
    finally:
        ckpt.close()
    return Run(workdir=workdir, config=config, model=model, params=state.params, step=int(step))


def heldout_tokens(run: Run, max_tokens: Optional[int] = None) -> np.ndarray:
    """The held-out token stream of a text run (its data config's eval split, whole)."""
    data = ml_collections.ConfigDict(run.config.data.to_dict())
    data.num_eval_batches = 0  # <= 0: the whole eval split
    data.read_threads = 1
    _, make_eval, _ = text.make_lm_datasets(data, seq_len=run.train_len, global_batch_size=8,
                                            seed=int(run.config.seed), process_index=0, process_count=1)
    tokens = extrapolation.tokens_from_batches(make_eval())
    return tokens[:max_tokens] if max_tokens else tokens


def _synthetic_batches(run: Run, length: int, num_examples: int, batch_size: int = 8):
    """Fresh eval batches of a synthetic run's own task at ``length`` (a stream the training
    never saw: the seed differs from any training seed's role)."""
    make = synthetic.make_batch_fn(run.config.data, batch_size, length)
    rng = np.random.default_rng([int(run.config.seed), 7919, length])
    return [make(rng)[0] for _ in range(max(1, num_examples // batch_size))]


# ----------------------------------------------------------------------------------------------
# Evaluations (each returns plain JSON-able dicts keyed by length)
# ----------------------------------------------------------------------------------------------


def eval_extrapolation(run: Run, multipliers: Sequence[int] = DEFAULT_MULTIPLIERS, *,
                       stride: Optional[int] = None, max_tokens: Optional[int] = None,
                       num_examples: int = 64) -> dict[int, dict[str, float]]:
    """``{length: {'ppl', 'nll', 'tokens'}}`` at ``m * train_len``.

    Text runs: the held-out stream in non-overlapping windows (``stride``: sliding), the same
    tokens for every model. Synthetic runs: ``num_examples`` fresh windows of the run's task
    at each length (their perplexity is what the task's scored targets cost).
    """
    apply_fn = extrapolation.model_apply_fn(run.model)
    if run.is_synthetic:
        out = {}
        for m in multipliers:
            length = int(m * run.train_len)
            r = extrapolation.perplexity_on_batches(apply_fn, run.params,
                                                    _synthetic_batches(run, length, num_examples))
            out[length] = {"ppl": r.ppl, "nll": r.nll, "tokens": r.num_tokens}
        return out
    tokens = heldout_tokens(run, max_tokens)
    res = extrapolation.perplexity_by_length(apply_fn, run.params, tokens, run.train_len,
                                             multipliers, stride=stride, tokens_per_batch=8192)
    return {int(n): {"ppl": r.ppl, "nll": r.nll, "tokens": r.num_tokens} for n, r in res.items()}


def eval_passkey(run: Run, multipliers: Sequence[int] = DEFAULT_MULTIPLIERS, *,
                 variants: Sequence[str] = ("synthetic", "standard"), num_examples: int = 32,
                 num_trials: int = 8, seed: int = 0) -> dict[str, dict[int, float]]:
    """``{variant: {length: accuracy}}`` at ``m * train_len``.

    'synthetic': teacher-forced exact match of the key span (lengths too short for the needle
    are skipped); 'standard': the Landmark prompt decoded greedily with the KV cache (prompts
    shorter than the fixed task text and needle are skipped).
    """
    out: dict[str, dict[int, float]] = {}
    lengths = [int(m * run.train_len) for m in multipliers]
    if "synthetic" in variants:
        key_len = int(run.config.data.get("key_len", 8))
        ok = [n for n in lengths if n >= 1 + len(synthetic.PASSKEY_NEEDLE) + len(synthetic.PASSKEY_QUERY) + 2 * key_len]
        out["synthetic"] = retrieval.passkey_accuracy_synthetic(
            extrapolation.model_apply_fn(run.model), run.params, ok, num_examples=num_examples,
            key_len=key_len, seed=seed)
    if "standard" in variants:
        # The fixed part of the prompt (task, needle, question) is ~280 bytes: lengths too short
        # to hold it are skipped rather than failing the whole run.
        ok = [n for n in lengths if _standard_prompt_fits(n)]
        gen = retrieval.greedy_generator(run.model, run.params)
        out["standard"] = retrieval.passkey_accuracy_standard(gen, ok, num_trials=num_trials,
                                                              batch_size=min(4, num_trials), seed=seed)
    return out


def _standard_prompt_fits(length: int) -> bool:
    try:
        synthetic.passkey_prompt(length, 0.0, 50000)
    except ValueError:
        return False
    return True


def eval_niah(run: Run, multipliers: Sequence[int] = DEFAULT_MULTIPLIERS, *,
              depths: Sequence[float] = NIAH_DEPTHS, num_examples: int = 16,
              seed: int = 0) -> dict[str, Any]:
    """The synthetic NIAH grid at ``m * train_len`` x ``depths``: ``{'lengths', 'depths',
    'token_accuracy' [nL][nD], 'exact_match' [nL][nD]}`` (lists, JSON-able)."""
    lengths = [int(m * run.train_len) for m in multipliers]
    grid = retrieval.niah_accuracy_grid(extrapolation.model_apply_fn(run.model), run.params, lengths,
                                        depths, num_examples=num_examples, seed=seed,
                                        key_len=int(run.config.data.get("niah_key_len", 5)),
                                        value_len=int(run.config.data.get("niah_value_len", 6)))
    return {k: np.asarray(v).tolist() for k, v in grid.items()}


def eval_sinks(run: Run, *, length: Optional[int] = None, num_examples: int = 8) -> dict[str, Any]:
    """Per layer: attention mass on position 0 (mean over heads and queries >= 1), first key
    norm / mean other key norm; for GOAT also the prior's own sink margin (nats over the row
    median, :func:`goat_jax.eval.sinks.sink_margin`). On held-out inputs at ``length``
    (default: the training length)."""
    length = int(length or run.train_len)
    if run.is_synthetic:
        tokens = np.concatenate([b["inputs"] for b in _synthetic_batches(run, length, num_examples)])
    else:
        stream = heldout_tokens(run, max_tokens=num_examples * (length + 1) * 4)
        starts = extrapolation.window_starts(len(stream), length)[:num_examples]
        tokens = stream[starts[:, None] + np.arange(length)]
    tokens = tokens[:num_examples]
    stats = sinks.sink_statistics(run.model, run.params, tokens)
    out = {"length": length,
           "first_mass": stats["first_mass"].mean(axis=-1).tolist(),  # [Y]
           "first_mass_max_head": stats["first_mass"].max(axis=-1).tolist(),  # [Y]
           "key_norm_ratio": stats["key_norm_ratio"].tolist()}  # [Y]
    if run.label == "goat":
        margins = [sinks.sink_margin(sinks.prior_components(run.model, run.params, i, min(length, 64))["log_prior"])
                   for i in range(run.model.config.num_layers)]
        out["prior_sink_margin_max_head"] = [float(np.max(m)) for m in margins]
    return out


# ----------------------------------------------------------------------------------------------
# Tables and figures
# ----------------------------------------------------------------------------------------------


def _fmt(x: Optional[float], pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.0f}%" if pct else (f"{x:.3f}" if x < 100 else f"{x:.1f}")


def table(rows: dict[str, dict[int, Optional[float]]], *, pct: bool = False,
          first_col: str = "model", header_fmt=lambda n: str(n)) -> str:
    """A markdown table, one row per label, one column per (sorted) key."""
    keys = sorted({k for r in rows.values() for k in r})
    lines = [f"| {first_col} | " + " | ".join(header_fmt(k) for k in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for label, r in rows.items():
        lines.append(f"| {label} | " + " | ".join(_fmt(r.get(k), pct) for k in keys) + " |")
    return "\n".join(lines)


def write_outputs(results: dict[str, dict[str, Any]], out: str, train_lens: dict[str, int]) -> str:
    """Writes ``results.json``, ``results.md`` and the PNGs of ``{label: {eval: result}}``
    into ``out``; returns the markdown."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=float)
    md = []
    train_len = next(iter(train_lens.values()), None)
    ext = {k: r["extrapolation"] for k, r in results.items() if "extrapolation" in r}
    if ext:
        md += ["## Perplexity by evaluation length", "",
               table({k: {int(n): v["ppl"] for n, v in r.items()} for k, r in ext.items()}), ""]
        plots.plot_perplexity_vs_length({k: {int(n): v["ppl"] for n, v in r.items()} for k, r in ext.items()},
                                        os.path.join(out, "perplexity_vs_length.png"), train_len=train_len)
    for variant in ("synthetic", "standard"):
        pk = {k: r["passkey"][variant] for k, r in results.items() if variant in r.get("passkey", {})}
        if pk:
            md += [f"## Passkey accuracy ({variant})", "", table(pk, pct=True), ""]
            plots.plot_passkey_accuracy({k: {int(n): a for n, a in v.items()} for k, v in pk.items()},
                                        os.path.join(out, f"passkey_{variant}.png"), train_len=train_len,
                                        title=f"Passkey retrieval ({variant})")
    niah = {k: r["niah"] for k, r in results.items() if "niah" in r}
    if niah:
        mean = {k: dict(zip(g["lengths"], np.mean(g["token_accuracy"], axis=1))) for k, g in niah.items()}
        md += ["## NIAH span token accuracy (mean over depths)", "", table(mean, pct=True), ""]
        for k, g in niah.items():
            plots.plot_niah_heatmap({n: np.asarray(v) for n, v in g.items()},
                                    os.path.join(out, f"niah_{k}.png"), title=f"NIAH, {k}")
    sk = {k: r["sinks"] for k, r in results.items() if "sinks" in r}
    if sk:
        md += ["## Attention sinks (per layer)", "", "| model | mass on pos. 0 (mean head) | "
               "mass on pos. 0 (max head) | first-key norm / others |", "|---|---|---|---|"]
        for k, s in sk.items():
            md.append(f"| {k} | " + ", ".join(f"{x:.2f}" for x in s["first_mass"]) + " | " +
                      ", ".join(f"{x:.2f}" for x in s["first_mass_max_head"]) + " | " +
                      ", ".join(f"{x:.2f}" for x in s["key_norm_ratio"]) + " |")
        md.append("")
    text_md = "\n".join(md)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text_md)
    return text_md


def evaluate_run(run: Run, evals: Sequence[str], multipliers: Sequence[int], *,
                 stride: Optional[int] = None, num_examples: int = 32,
                 num_trials: int = 8) -> dict[str, Any]:
    """Runs ``evals`` (a subset of :data:`EVALS`) on one run; returns ``{eval: result}``."""
    unknown = sorted(set(evals) - set(EVALS))
    if unknown:
        raise ValueError(f"unknown evaluation(s) {unknown}; choose from {EVALS}.")
    out: dict[str, Any] = {}
    for name in evals:
        t0 = time.time()
        if name == "extrapolation":
            out[name] = eval_extrapolation(run, multipliers, stride=stride, num_examples=num_examples)
        elif name == "passkey":
            variants = ("synthetic",) if run.is_synthetic else ("standard",)
            out[name] = eval_passkey(run, multipliers, variants=variants, num_examples=num_examples,
                                     num_trials=num_trials)
        elif name == "niah":
            out[name] = eval_niah(run, multipliers, num_examples=max(8, num_examples // 2))
        else:
            out[name] = eval_sinks(run)
        log(f"  {run.label} {name}: {time.time() - t0:.0f}s")
    return out


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """CLI entry point (argparse); returns ``{label: {eval: result}}``."""
    import argparse  # pylint: disable=g-import-not-at-top

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", action="append", required=True, help="run dir (repeatable)")
    p.add_argument("--label", action="append", help="label per --workdir (default: encoding)")
    p.add_argument("--evals", default="extrapolation,sinks", help=f"comma list of {EVALS}")
    p.add_argument("--multipliers", default="1,2,4,8,16", help="lengths as multiples of seq_len")
    p.add_argument("--stride", type=int, default=None, help="sliding-window stride (default: none)")
    p.add_argument("--num_examples", type=int, default=32, help="examples per length (retrieval)")
    p.add_argument("--num_trials", type=int, default=8, help="standard passkey prompts per length")
    p.add_argument("--out", default=None, help="output dir (default: WORKDIR/eval)")
    args = p.parse_args(argv)
    evals = [e for e in args.evals.split(",") if e]
    mults = [int(m) for m in args.multipliers.split(",") if m]
    labels = args.label or [None] * len(args.workdir)
    if len(labels) != len(args.workdir):
        p.error("give one --label per --workdir, or none")
    results, train_lens = {}, {}
    for workdir, label in zip(args.workdir, labels):
        run = load_run(workdir)
        label = label or run.label
        log(f"evaluating {label} ({workdir}, step {run.step}): {', '.join(evals)}")
        results[label] = evaluate_run(run, evals, mults, stride=args.stride,
                                      num_examples=args.num_examples, num_trials=args.num_trials)
        train_lens[label] = run.train_len
    out = args.out or os.path.join(args.workdir[0], "eval")
    print(write_outputs(results, out, train_lens))
    log(f"wrote {out}/results.md, results.json and figures")
    return results


if __name__ == "__main__":
    from experiments import cli  # pylint: disable=g-import-not-at-top
    cli.run(main)  # config and input errors: one line (GOAT_DEBUG=1: traceback)
