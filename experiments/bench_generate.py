"""Wall time and compiles of lm-eval's ``generate_until`` (goat_jax.eval.harness.GoatLM) on
prompts of many lengths, one compiled decoder per prompt length (``prefill_multiple=1``)
against one per 64-token bucket (the default).

A random-parameter model of ``--config`` (no checkpoint needed: the decoder's cost does not
depend on the weights) answers ``--prompts`` greedy requests whose prompt lengths are spread
evenly over ``[8, max_length - max_gen_toks]``, each length once, as in a real generation
task. Each setting runs once, in the same process, one after the other (their compiled
programs differ, so neither warms the other's cache); the continuations of the two are
compared token for token.

    python experiments/bench_generate.py --config configs/lm_tiny.py:goat --max_length 512 \
        --prompts 24 --out benchmarks/generate.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from goat_jax.config.files import load_config  # noqa: E402
from goat_jax.eval import harness, lm_run  # noqa: E402
from goat_jax.models import sampling  # noqa: E402
from goat_jax.train import tasks  # noqa: E402
from goat_jax.kernels.plan import AttentionPlan  # noqa: E402


class _Request:  # what generate_until reads of lm-eval's Instance
    def __init__(self, context: str, max_gen_toks: int):
        self.args = (context, {"until": [], "max_gen_toks": max_gen_toks})


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/lm_tiny.py:goat")
    p.add_argument("--max_length", type=int, default=512, help="the harness window in tokens")
    p.add_argument("--max_gen_toks", type=int, default=16)
    p.add_argument("--prompts", type=int, default=24, help="requests, each of its own length")
    p.add_argument("--multiples", type=int, nargs="+", default=[1, 64], help="prefill_multiple values")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.max_length - args.max_gen_toks < 8 + args.prompts:
        raise SystemExit(f"--max_length {args.max_length} leaves too few prompt lengths for --prompts "
                         f"{args.prompts} after --max_gen_toks {args.max_gen_toks}; raise --max_length.")

    config = load_config(args.config)
    task = tasks.get_task(config.task)
    model = task.build_model(config, AttentionPlan.from_config(config))
    params = model.init(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
    run = lm_run.LMRun(workdir="", config=config, task=task, model=model, params=params, step=0)
    # Prompt lengths in tokens (BOS + bytes): evenly spread, distinct.
    lengths = np.unique(np.linspace(8, args.max_length - args.max_gen_toks, args.prompts).astype(int))
    requests = [_Request("x" * (int(n) - 1), args.max_gen_toks) for n in lengths]

    rows, outputs = [], {}
    for m in args.multiples:
        lm = harness.GoatLM(run, batch_size=1, max_length=args.max_length,
                            max_gen_toks=args.max_gen_toks, prefill_multiple=m)
        before = sampling._generate_bucketed._cache_size()  # pylint: disable=protected-access
        start = time.perf_counter()
        outputs[m] = lm.generate_until(requests)
        seconds = time.perf_counter() - start
        compiles = sampling._generate_bucketed._cache_size() - before  # pylint: disable=protected-access
        rows.append((m, compiles, seconds))
        print(f"prefill_multiple={m}: {compiles} compiles, {seconds:.1f} s for {len(requests)} prompts", flush=True)
    same = all(outputs[m] == outputs[args.multiples[0]] for m in args.multiples)
    base = rows[0][2]
    md = [f"# generate_until: compiles and wall time over prompt lengths ({datetime.date.today()})", "",
          f"Command: `python experiments/bench_generate.py --config {args.config} --max_length "
          f"{args.max_length} --prompts {args.prompts} --max_gen_toks {args.max_gen_toks}`  ",
          f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, {jax.default_backend()}; "
          "the settings ran one after the other in one process.  ",
          f"{len(requests)} greedy requests, prompt lengths {lengths[0]}..{lengths[-1]} tokens (each once), "
          f"{args.max_gen_toks} new tokens each, batch 1; continuations identical across settings: "
          f"{'yes' if same else 'NO'}.", "",
          "| prefill_multiple | decoder compiles | seconds | ratio to the first row |", "|---|---|---|---|"]
    md += [f"| {m} | {c} | {s:.1f} | {s / base:.2f} |" for m, c, s in rows]
    text = "\n".join(md) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    if not same:
        raise SystemExit("the settings' continuations differ: a bug, not a benchmark result.")
    return text


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    main()
