"""The Markdown pages of the compiles: one report (:func:`markdown`, OUT/compile.md), a batch
search (:func:`search_markdown`, OUT/search.md) and a table of reports (:func:`summary_table`,
benchmarks/aot.md)."""

from __future__ import annotations

from typing import Any, Dict, Sequence

from goat_jax.aot.compiler import GiB


def search_markdown(search: Dict[str, Any], config_text: str = "") -> str:
    """The result of :func:`largest_batch` as a short Markdown page (OUT/search.md)."""
    def gib(b):
        return "-" if b is None else f"{b / GiB:.2f}"

    lines = [f"# Largest per-device batch that fits: {search['target']}", ""]
    if config_text:
        lines += [f"Config: `{config_text}` (one microbatch per step: grad_accum_steps 1)", ""]
    lines += ["| remat | largest fitting per-device batch | first failing | GiB/chip at the largest | "
              "tried (batch: GiB/chip) |", "|---|---:|---:|---:|---|"]
    for r in search["per_remat"]:
        best = next((t for t in r["tried"] if t["per_device"] == r["largest"]), {})
        tried = ", ".join(f"{t['per_device']}: {gib(t['total_bytes'])}{'' if t['fits'] else ' (no)'}"
                          for t in r["tried"])
        largest = "none" if r["largest"] is None else str(r["largest"])
        lines.append(f"| {'on' if r['remat'] else 'off'} | {largest}"
                     f"{'' if r['exact'] else ' (bracket only: compile budget spent)'} | "
                     f"{r['first_failing'] or '-'} | {gib(best.get('total_bytes'))} | {tried} |")
    return "\n".join(lines) + "\n"


def markdown(report: Dict[str, Any]) -> str:
    """The report as a short Markdown page (OUT/compile.md)."""
    def gib(b):
        if b is None:
            return "n/a"
        return f"{b / GiB:.2f} GiB" if abs(b) >= GiB / 4 else f"{b / 2**20:.2f} MiB"

    mem = report.get("per_device_bytes") or {}
    lines = [f"# Ahead-of-time compile: {report['target']} ({report['topology']}, {report['device_kind']})", ""]
    if report.get("config"):
        lines += [f"Config: `{report['config']}`", ""]
    lines += ["| | |", "|---|---|"]
    if report.get("step") == "decode":
        lines += [f"| step | one decode step: a new token per row against a KV cache of {report['cache_length']:,} "
                  "slots (the config's seq_len) |",
                  f"| KV cache | {gib(report['kv_cache_bytes_total'])} in all, "
                  f"{gib(report['kv_cache_bytes_per_chip'])} per chip |"]
    lines += [f"| devices (chips) | {report['num_devices']} on {report['num_hosts']} host(s), mesh {report['mesh']} |",
              f"| global batch | {report['global_batch_size']} ({report['tokens_per_step']} tokens/step) |",
              f"| parameters | {report['parameters']:,} |",
              f"| attention | {report['attention_implementation']}, packed q/k head dim {report['packed_head_dim']} |"]
    if report.get("context_strategy"):
        ring = (f", each block computed by {report['ring_blocks']}'s block math"
                if report.get("ring_blocks") else "")
        if report.get("whole_sequence"):
            ring += f", heads exchanged all-to-all: {report['whole_sequence']} on the whole sequence per device"
        lines.append(f"| context parallelism | strategy {report['context_strategy']}, load-balanced "
                     f"{report.get('load_balanced')}{ring} |")
    for key in ("arguments", "outputs", "temporaries", "aliased", "total"):
        lines.append(f"| per device: {key} | {gib(mem.get(key))} |")
    if report.get("custom_calls"):
        kernels_found = [f"`{k}` x{v}" for k, v in report["custom_calls"].items()
                         if k == "tpu_custom_call" or "fmha" in k]
        if kernels_found:
            lines.append(f"| attention kernels in the compiled step | {', '.join(kernels_found)} |")
    for warning in report.get("layout_warnings") or ():
        lines.append(f"| q/k layout | {warning} |")
    lines.append(f"| HBM per chip | {gib(report['device_memory_bytes'])} |")
    verdict = {True: "yes", False: "**no**", None: "unknown"}[report["fits"]]
    lines.append(f"| fits (leaving {report['fit_margin']:.0%} free) | {verdict}"
                 + (f", margin {gib(report['margin_bytes'])}" if report.get("margin_bytes") is not None else "")
                 + (f", short by at least {gib(report['shortfall_bytes'])} (the compiler's count of the temporaries "
                    "alone, over what it can use)" if report.get("shortfall_bytes") is not None else "") + " |")
    if report.get("compiler_error"):
        lines.append(f"| compiler | {report['compiler_error']} |")
    flops = report["model_flops_per_step"]
    lines.append(f"| model FLOPs/step (analytic) | {'n/a' if flops is None else f'{flops:.4g}'} |")
    if report["estimated_step_seconds"]:
        step = report["estimated_step_seconds"]
        lines.append(f"| estimated step time at peak | "
                     f"{f'{step * 1e3:.2f} ms' if step >= 1e-3 else f'{step * 1e6:.1f} us'} |")
        lines.append(f"| estimated tokens/s/chip at peak | {report['estimated_tokens_per_second_per_chip']:,.0f} |")
    lines.append(f"| compile time on this host | {report['compile_seconds']:.1f} s "
                 f"(tracing and lowering {report.get('lower_seconds', 0):.1f} s) |")
    lines += ["", f"Estimates: {report['estimate_note']}; peak {report['peak_bf16_flops_per_chip'] / 1e12:.0f} "
              f"TFLOP/s per chip ({report['peak_source']}). Memory: XLA's plan of one step per device "
              "(arguments + outputs + temporaries - aliased donated state).", ""]
    return "\n".join(lines)


def summary_table(reports: Sequence[Dict[str, Any]]) -> str:
    """One Markdown row per compile report (benchmarks/aot.md): config, target, kernel, packed
    head dim, per-device GiB (arguments, temporaries, total), HBM, fits, the estimates at peak
    and the compile time."""
    g = lambda b: "-" if b is None else f"{b / GiB:.3f}"
    rows = ["| config | target | attention | packed head dim | parameters | args GiB | temps GiB | "
            "total GiB/chip | HBM GiB | fits | model TFLOP/step | est. step at peak | "
            "est. tokens/s/chip at peak | compile s |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in reports:
        m = r.get("per_device_bytes") or {}
        total = m.get("total")
        if total is None and r.get("compiler_used_bytes"):
            total = r["compiler_used_bytes"]  # the compiler's own count when it refused
        step = r.get("estimated_step_seconds")
        flops = r.get("model_flops_per_step")
        rate = r.get("estimated_tokens_per_second_per_chip")
        rows.append(
            f"| `{r.get('config') or '-'}` | {r['target']} | {r['attention_implementation']} | "
            f"{r['packed_head_dim']} | {r['parameters']:,} | {g(m.get('arguments'))} | "
            f"{g(m.get('temporaries'))} | {g(total)}{'' if m else ' (compiler)'} | "
            f"{g(r['device_memory_bytes'])} | {'yes' if r['fits'] else '**no**'} | "
            f"{'-' if flops is None else f'{flops / 1e12:.1f}'} | "
            f"{'-' if not step else f'{step * 1e3:.1f} ms'} | "
            f"{'-' if not rate else f'{rate:,.0f}'} | "
            f"{r['compile_seconds']:.0f} |")
    return "\n".join(rows) + "\n"
