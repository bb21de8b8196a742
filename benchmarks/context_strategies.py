"""The three context strategies compared from compiled programs (benchmarks/context.md, "All-gather,
ring and Ulysses"): one config's real train step compiled by the compile tool's own path
(:func:`goat_jax.aot.compile_train_step`) for a target, per strategy, with the fused attention
calls in the step, the per-device memory, whether it fits, and the collectives per layer read
from the compiled program.

    JAX_PLATFORMS=cpu python benchmarks/context_strategies.py --config configs/lm_c4_125m.py:goat \
        --target v5p-8 --seq_len 32768 --context 4 [--strategies all_gather ring ulysses] \
        [--set model.remat=True ...] [--markdown]
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 .venv-gpu/bin/python benchmarks/context_strategies.py \
        --config configs/lm_fineweb_1b.py:goat --target h200x8 --seq_len 32768 131072 --context 8 --markdown

Each strategy (and each ``--seq_len``) compiles in a child process (one compile's memory at a time)
and prints one JSON line; ``--markdown`` then prints the rows as the table of benchmarks/context.md
(GiB = 2**30 bytes per device, collectives' MiB per device as below). On a GPU target each row also
names the operands of the step's first cuDNN forward call (``cudnn_operands``: q, k, v and, for
cuDNN's packed layout, its int32 lengths and offsets). The collectives are
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
from typing import Optional

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
        if m.group(3) and kind in ("all-gather", "collective-permute", "all-to-all"):
            # Their async start returns (operands, results[, scalar contexts]): count the results
            # (the GPU compiler's all-to-all-start too: ((operands), results)).
            shapes = [(d, dims) for d, dims in _SHAPE.findall(result) if dims]
            half = len(shapes) // 2
            result = " ".join(f"{d}[{dims}]" for d, dims in shapes[half:] or shapes)
        found[kind]["count"] += 1
        found[kind]["bytes"] += _shape_bytes(result)
        found[kind]["in_loops"] += computation in bodies
    return found


def cudnn_operands(hlo: str) -> Optional[list]:
    """The operand shapes of the first cuDNN forward call (``__cudnn$fmha...`` without
    ``Backward``) in compiled HLO text, from its ``operand_layout_constraints``; None without one."""
    for line in hlo.splitlines():
        m = re.search(r'custom_call_target="(__cudnn\$fmha[^"]*)"', line)
        if m and "Backward" not in m.group(1) and "operand_layout_constraints={" in line:
            rest, depth = line.split("operand_layout_constraints={", 1)[1], 1
            for end, ch in enumerate(rest):  # up to the closing brace of the constraints
                depth += {"{": 1, "}": -1}.get(ch, 0)
                if depth == 0:
                    break
            return [f"{d}[{dims}]" for d, dims in _SHAPE.findall(rest[:end])] or None
    return None


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
    report["cudnn_operands"] = cudnn_operands(texts[0]) if texts else None
    return report


def _gib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def markdown(rows: list) -> str:
    """The rows (the JSON lines this script prints) as one Markdown table (benchmarks/context.md)."""
    head = ["seq_len", "strategy", "kernel", "fused attention calls in the step", "cuDNN forward operands (per device)",
            "arguments GiB", "temporaries GiB", "total GiB", "fits", "collectives in the step (count, MiB per device)",
            "compile s (trace+lower)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('seq_len')} | {r['strategy']} | error: {' '.join(r['error'])} |" + " |" * 8)
            continue
        kernel = r["attention_implementation"]
        if r.get("ring_blocks"):
            kernel = f"ring blocks on {r['ring_blocks']}"
        elif r.get("whole_sequence"):
            kernel = f"{r['whole_sequence']} on the whole sequence"
        calls = ", ".join(f"`{k}` x{v}" for k, v in (r["custom_calls"] or {}).items()
                          if k.startswith("__cudnn$fmha") or k == "tpu_custom_call") or "none"
        ops = ", ".join(f"`{o}`" for o in r.get("cudnn_operands") or []) or "-"
        mem = r["per_device_bytes"] or {}
        hbm = r.get("device_memory_bytes")
        fits = {True: "yes", False: "**no**", None: "?"}[r["fits"]] + (f" (of {hbm / 2**30:.0f})" if hbm else "")
        coll = "; ".join(f"{k} {v['count']} ({v['bytes'] / 2**20:.1f})" for k, v in (r["collectives"] or {}).items()
                         if v["count"])
        lower = r.get("lower_seconds")
        seconds = f"{r['compile_seconds']:.0f}" + (f" ({lower:.0f})" if lower is not None else "")
        lines.append("| " + " | ".join([f"{r.get('seq_len'):,}", r["strategy"], kernel, calls, ops, _gib(mem.get("arguments")),
                                        _gib(mem.get("temporaries")), f"**{_gib(mem.get('total'))}**", fits, coll,
                                        seconds]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--seq_len", type=int, nargs="+", required=True, help="one or more: each compiled")
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--strategies", nargs="+", default=["all_gather", "ring", "ulysses"])
    parser.add_argument("--set", nargs="*", default=[], help="more dotted overrides, key=value (JSON values)")
    parser.add_argument("--markdown", action="store_true", help="print the rows as a Markdown table at the end")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's overrides (JSON)
    args = parser.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(measure(args.config, args.target, json.loads(args.one)), default=str))
        return
    rows = []
    for seq_len, strategy in [(t, s) for t in args.seq_len for s in args.strategies]:
        overrides = {"seq_len": seq_len, "mesh.context": args.context, "mesh.data": 1,
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
            rows.append({"seq_len": seq_len, "strategy": strategy, "error": proc.stderr.strip().splitlines()[-1:]})
            print(json.dumps(rows[-1]), flush=True)
            continue
        report = json.loads(proc.stdout.split("RESULT ")[-1])
        keep = ("target", "attention_implementation", "context_strategy", "ring_blocks", "whole_sequence",
                "load_balanced", "per_device_bytes", "device_memory_bytes", "fits", "custom_calls", "cudnn_operands",
                "collectives", "estimated_step_seconds", "compile_seconds", "lower_seconds")
        rows.append({"seq_len": seq_len, "strategy": strategy, **{k: report.get(k) for k in keep}})
        print(json.dumps(rows[-1]), flush=True)
    if args.markdown:
        print(markdown(rows))


if __name__ == "__main__":
    main()
