"""The three context strategies compared from compiled programs (benchmarks/context.md, "All-gather,
ring and Ulysses"): one config's real train step compiled by the compile tool's own path
(:func:`goat_jax.aot.compile_train_step`) for a target, per strategy, with the fused attention
calls in the step, the per-device memory, whether it fits, and the collectives per layer read
from the compiled program.

    JAX_PLATFORMS=cpu python benchmarks/context_strategies.py --config configs/lm_c4_125m.py:goat \
        --target v5p-8 --seq_len 32768 --context 4 [--strategies all_gather ring ulysses] \
        [--set model.remat=True ...]

Each strategy compiles in a child process (one compile's memory at a time). The collectives are
the compiled program's ``all-to-all``, ``all-gather``, ``reduce-scatter``, ``collective-permute``
and ``all-reduce`` instructions (their async ``-start`` halves on TPU and GPU), each counted once
per appearance in the program text with the bytes of its result buffer (per device), and how
many of them sit in a while loop's body: with the layers scanned (the configs' default) the
layer body is one loop, so its instructions are one layer's, and a ring's steps are a loop nested
in it (run ``c - 1`` or ``c`` times per layer; benchmarks/context.md says how each row counts
them). Needs libtpu for TPU targets, JAX's CUDA plugin (the ``aot-gpu`` extra) for GPU targets.
"""

import argparse
import json
import os
import re
import subprocess
import sys

_KINDS = ("all-to-all", "all-gather", "reduce-scatter", "collective-permute", "all-reduce")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "s64": 8, "f64": 8}
_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|pred|s8|u8|s64|f64)\[([0-9,]*)\]")


def _shape_bytes(text: str) -> int:
    """The bytes of every array shape in ``text`` (an HLO result type, a tuple's members summed)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES[dtype]
    return total


def collectives(hlo: str) -> dict:
    """``kind -> {"count", "bytes", "in_loops"}`` of the collectives in compiled HLO text:
    ``bytes`` sums each instruction's result (once per appearance), ``in_loops`` counts those in
    a computation that is a while loop's body (run once per iteration)."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    found = {k: {"count": 0, "bytes": 0, "in_loops": 0} for k in _KINDS}
    computation = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            computation = head.group(1)
            continue
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (.+?) (" + "|".join(_KINDS) + r")(-start)?\(", line)
        if not m:
            continue
        kind = m.group(2)
        result = m.group(1)
        if m.group(3) and kind in ("all-gather", "collective-permute"):
            # Their async start returns (operands, results[, scalar contexts]): count the results.
            shapes = [(d, dims) for d, dims in _SHAPE.findall(result) if dims]
            half = len(shapes) // 2
            result = " ".join(f"{d}[{dims}]" for d, dims in shapes[half:] or shapes)
        found[kind]["count"] += 1
        found[kind]["bytes"] += _shape_bytes(result)
        found[kind]["in_loops"] += computation in bodies
    return found


def measure(config_arg: str, target_name: str, overrides: dict) -> dict:
    """One compile (this process): the compile tool's report plus the program's collectives."""
    from goat_jax import aot  # pylint: disable=g-import-not-at-top
    from goat_jax.config import files as config_files
    from goat_jax.aot import compiler

    from goat_jax.train import validation

    config = config_files.load_config(config_arg)
    validation.add_engine_defaults(config)  # the engine fields a config leaves out (context_strategy)
    for key, value in overrides.items():  # dotted overrides, as --config.x.y=value
        node = config
        *path, leaf = key.split(".")
        for part in path:
            node = node[part]
        node[leaf] = value
    texts = []
    original = compiler.custom_calls
    compiler.custom_calls = lambda text: (texts.append(text), original(text))[1]  # keep the program text
    report = compiler.compile_train_step(config, aot.parse_target(target_name))
    report["collectives"] = collectives(texts[0]) if texts else None
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--seq_len", type=int, required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--strategies", nargs="+", default=["all_gather", "ring", "ulysses"])
    parser.add_argument("--set", nargs="*", default=[], help="more dotted overrides, key=value (JSON values)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's overrides (JSON)
    args = parser.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(measure(args.config, args.target, json.loads(args.one)), default=str))
        return
    for strategy in args.strategies:
        overrides = {"seq_len": args.seq_len, "mesh.context": args.context, "mesh.data": 1,
                     "global_batch_size": 1, "grad_accum_steps": 1, "context_strategy": strategy}
        for item in args.set:
            key, value = item.split("=", 1)
            try:
                overrides[key] = json.loads(value)
            except json.JSONDecodeError:
                overrides[key] = value
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--config", args.config, "--target",
                               args.target, "--seq_len", "0", "--context", "0", "--one", json.dumps(overrides)],
                              cwd=root, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=root))
        if proc.returncode:
            print(json.dumps({"strategy": strategy, "error": proc.stderr.strip().splitlines()[-1:]}))
            continue
        report = json.loads(proc.stdout.split("RESULT ")[-1])
        keep = ("target", "attention_implementation", "context_strategy", "ring_blocks", "whole_sequence",
                "load_balanced", "per_device_bytes", "fits", "custom_calls", "collectives", "compile_seconds")
        print(json.dumps({"strategy": strategy, **{k: report.get(k) for k in keep}}), flush=True)


if __name__ == "__main__":
    main()
