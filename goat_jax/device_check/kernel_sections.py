"""Sections 1, 2, 2b/2c and 4 of the device check (moved from experiments/device_check.py):

1. Correctness on the GPU: the kernels (cuDNN, flash, XLA) against the hand-written float64
   reference (``tests/goat_reference.py``: value and dq/dk/dv) at bf16 tolerance (2e-2, the bar
   the GPU-only test uses), flash also in float32 at 1e-5.
2. Attention forward+backward, B=1, 8 heads, H=64, causal, at 1k-16k: GOAT packed on cuDNN vs
   plain cuDNN flash vs GOAT's dense log-prior as a bias on XLA (bf16), and the flash kernel on
   GOAT's packed q/k in float32 vs XLA float32: median wall ms and compiled memory (temp +
   argument + output bytes, ``memory_analysis()``). A variant that would not fit in device memory
   is compiled but not run.
2b. Packed documents (segment ids) on cuDNN's packed layout: GOAT and RoPE, MHA and GQA (4 query
   heads per key head), value and gradients against the float64 reference; 2c the wall time of
   cuDNN packed against 'flash' on the same inputs at 2k and 8k.
4. With the time left: the GPU-only pytest tests (the cuDNN tests of ``tests/test_attention.py``,
   and ``tests/test_flash.py`` on the GPU) if pytest is importable (``--wheel_dir``).
"""

from __future__ import annotations

import glob
import os
import statistics
import subprocess
import sys
import time
from typing import Any, List, Optional, Tuple

from goat_jax.device_check import Check, Section
from goat_jax.device_check.report import table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ----------------------------------------------------------------------------------------------
# 1. Correctness against the float64 reference
# ----------------------------------------------------------------------------------------------


def correctness(kernel_names: List, length: int, ref: Any) -> List[List]:
    """Each kernel's value and q/k/v gradients vs ``ref.attention_and_grads`` (the float64
    reference, tests/goat_reference.py)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from goat_jax import kernels

    rng = np.random.default_rng(0)
    b, n, kh, h = 2, 4, 2, 64
    q, k, v, ct = (rng.normal(size=shape) for shape in
                   ((b, length, n, h), (b, length, kh, h), (b, length, kh, h), (b, length, n, h)))
    kpm = np.zeros((b, length), bool)
    kpm[1, -length // 4:] = True  # right padding in one example
    rows = []
    for name, dtype, tol in kernel_names:
        for causal in (True, False):
            kw = dict(scale=h ** -0.5, is_causal=causal, key_padding_mask=None if causal else kpm)
            jkw = {**kw, "key_padding_mask": None if causal else jnp.asarray(kpm)}
            xs = [jnp.asarray(x, dtype) for x in (q, k, v, ct)]
            want = ref.attention_and_grads(*(np.asarray(x.astype(jnp.float32), np.float64) for x in xs), **kw)

            def run(q_, k_, v_, ct_):
                out, vjp = jax.vjp(lambda a, c, d: kernels.attend(a, c, d, implementation=name, **jkw), q_, k_, v_)
                return (out,) + vjp(ct_)

            mask = "causal" if causal else "bidirectional + padding"
            try:
                got = jax.jit(run)(*xs)
            except Exception as err:  # noqa: BLE001 -- an unchecked machine: record, go on
                rows.append([name, jnp.dtype(dtype).name, mask, length] + [None] * 4
                            + [tol, f"**ERROR** {type(err).__name__}: {str(err).splitlines()[0][:200]}"])
                continue
            errs = [float(np.abs(np.asarray(g.astype(jnp.float32), np.float64) - w).max() / np.abs(w).max())
                    for g, w in zip(got, want)]
            rows.append([name, jnp.dtype(dtype).name, mask, length] + errs
                        + [tol, "ok" if max(errs) <= tol else "**FAIL**"])
    return rows

# ----------------------------------------------------------------------------------------------
# 2. Attention benchmark
# ----------------------------------------------------------------------------------------------


def attention_rows(lengths: List[int], cudnn: bool, repeats: int, deadline: float) -> List[List]:
    """GOAT on cuDNN / plain cuDNN / GOAT dense prior on XLA (bf16); flash / XLA (float32)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from goat_jax.layers import goat as attn_lib
    from goat_jax.prior import packing
    from goat_jax import kernels
    from goat_jax.benchmarking import jax_variant, measure
    from goat_jax import prior as prior_lib

    b, n, h, r, m = 1, 8, 64, 8, 8
    spec = prior_lib.PriorSpec(num_heads=n, kv_num_heads=n, pos_rank=r, abs_rank=m)
    d_c = spec.content_dim(h)
    pp = attn_lib.GoatPrior(spec).init(
        jax.random.PRNGKey(0), prior_lib.positions_1d(4), prior_lib.positions_1d(4), True)["params"]
    device_bytes = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    rows = []
    for length in lengths:
        pos = prior_lib.positions_1d(length)
        rng = np.random.default_rng(length)
        variants = []

        def goat(dtype, impl):
            channels = packing.default_sink_channels(dtype)

            def loss(q_, k_, v_, pp_):
                q_rel, q_sink = prior_lib.query_features(spec, pp_, pos)
                k_rel, u = prior_lib.key_features(spec, pp_, pos, True)
                qp = packing.pack_query(q_[..., :d_c], q_rel, q_sink, channels, dtype)
                kp = packing.pack_key(k_[..., :d_c], k_rel, u, channels, dtype)
                return jnp.sum(kernels.attend(qp, kp, v_, implementation=impl, is_causal=True).astype(jnp.float32))
            return loss

        def dense_prior_bias(q_, k_, v_, pp_):  # GOAT without packing: the T x S log-prior as a bias
            bias = prior_lib.log_prior(spec, pp_, pos, pos, is_causal=True)
            out = kernels.attend(q_[..., :d_c], k_[..., :d_c], v_, implementation="xla", scale=d_c ** -0.5,
                                 is_causal=True, bias=bias.astype(q_.dtype))
            return jnp.sum(out.astype(jnp.float32))

        def plain(impl):
            return lambda q_, k_, v_, pp_: jnp.sum(kernels.attend(q_, k_, v_, implementation=impl, scale=h ** -0.5,
                                                                  is_causal=True).astype(jnp.float32))

        specs = []
        if cudnn:
            specs += [("goat:cudnn", jnp.bfloat16, goat(jnp.bfloat16, "cudnn")),
                      ("plain:cudnn", jnp.bfloat16, plain("cudnn"))]
        specs += [("goat_dense_bias:xla", jnp.bfloat16, dense_prior_bias),
                  ("goat:flash", jnp.float32, goat(jnp.float32, "flash")),
                  ("goat:xla", jnp.float32, goat(jnp.float32, "xla"))]
        for name, dtype, loss in specs:
            if time.time() > deadline:
                rows.append([length, name, jnp.dtype(dtype).name, None, None, "skipped: time budget"])
                continue
            args = tuple(jnp.asarray(rng.normal(size=(b, length, n, h)), dtype) for _ in range(3)) + (pp,)
            try:
                var = jax_variant(name, loss, args, (0, 1, 2, 3))
            except Exception as err:  # noqa: BLE001 -- e.g. a cuDNN constraint: record, go on
                rows.append([length, name, jnp.dtype(dtype).name, None, None,
                             f"**ERROR** {type(err).__name__}: {str(err).splitlines()[0][:200]}"])
                continue
            if device_bytes and var.memory and var.memory > 0.9 * device_bytes:
                rows.append([length, name, jnp.dtype(dtype).name, None, var.memory / 2**20,
                             f"not run: needs {var.memory / 2**30:.1f} GiB of {device_bytes / 2**30:.0f}"])
                continue
            variants.append((var, dtype))
        try:
            measure([v for v, _ in variants], repeats)
        except Exception as err:  # noqa: BLE001 -- e.g. out of memory at run time
            rows += [[length, v.name, jnp.dtype(d).name, None, None if v.memory is None else v.memory / 2**20,
                      f"**ERROR** while running: {type(err).__name__}: {str(err).splitlines()[0][:200]}"]
                     for v, d in variants]
            continue
        for var, dtype in variants:
            rows.append([length, var.name, jnp.dtype(dtype).name, 1e3 * statistics.median(var.times),
                         None if var.memory is None else var.memory / 2**20, ""])
        del variants
    return rows

# ----------------------------------------------------------------------------------------------
# 2b. Packed documents on cuDNN's packed layout (goat_jax/kernels/cudnn_packed.py)
# ----------------------------------------------------------------------------------------------


def _documents(rng, b: int, t: int, docs: int):
    """[b, t] int32 segment ids: ``docs`` documents of random lengths per row, the last row
    ending in padding (PAD_SEGMENT_ID), one row with a one-token document."""
    import numpy as np

    rows = []
    for r in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), docs - 1, replace=False))
        row = np.repeat(np.arange(1, docs + 1), np.diff(np.r_[0, cuts, t])).astype(np.int32)
        if r == b - 1:
            row[-t // 8:] = np.iinfo(np.int32).max
        rows.append(row)
    rows[0][:1] = 0  # a one-token document at the start of row 0
    return np.stack(rows)


def packed_inputs(encoding: str, b: int, t: int, n: int, kh: int, h: int, ids, dtype):
    """bf16 q/k/v as the kernel sees them for GOAT (prior packed into q/k, per-document
    positions) or RoPE (rotated by per-document positions)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from goat_jax.layers import goat as attn_lib
    from goat_jax import prior as prior_lib
    from goat_jax.prior import segments
    from goat_jax.positional import rope
    from goat_jax.prior import packing

    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in
               ((b, t, n, h), (b, t, kh, h), (b, t, kh, h)))
    pos = segments.segment_positions(jnp.asarray(ids))
    if encoding == "rope":
        return rope.apply_rope(q, pos).astype(dtype), rope.apply_rope(k, pos).astype(dtype), v.astype(dtype)
    spec = prior_lib.PriorSpec(num_heads=n, kv_num_heads=kh, pos_rank=8, abs_rank=8, training_seq_len=t)
    channels = packing.default_sink_channels(dtype)
    d_c = spec.content_dim(h, channels)
    p_pos = prior_lib.positions_1d(t, positions=pos)
    params = attn_lib.GoatPrior(spec).init(jax.random.PRNGKey(0), p_pos, p_pos, True)["params"]
    q_rel, q_sink = prior_lib.query_features(spec, params, p_pos)
    k_rel, u = prior_lib.key_features(spec, params, p_pos, True)
    return (packing.pack_query(q[..., :d_c], q_rel, q_sink, channels, dtype),
            packing.pack_key(k[..., :d_c], k_rel, u, channels, dtype), v.astype(dtype))


def packed_rows(length: int, timing_lengths: List[int], repeats: int, deadline: float, dry_run: bool,
                ref: Any) -> Tuple[List[List], List[List]]:
    """cuDNN's packed layout vs the float64 reference (value, dq, dk, dv) for GOAT and RoPE, MHA
    and GQA (4 query heads per key head); then forward+backward wall time against 'flash' on the
    same inputs. On CPU (dry run) the 'cudnn' rows say they were skipped and flash is checked."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from goat_jax import kernels
    from goat_jax.benchmarking import jax_variant, measure

    rows = []
    rng = np.random.default_rng(1)
    impls = ["flash"] if dry_run else ["cudnn", "flash"]
    b, n, h = 2, 8, 64
    ids = _documents(rng, b, length, 6)
    for encoding in ("goat", "rope"):
        for kh in (n, n // 4):
            q, k, v = packed_inputs(encoding, b, length, n, kh, h, ids, jnp.bfloat16)
            ct = jnp.asarray(rng.normal(size=(b, length, n, h)), jnp.bfloat16)
            want = ref.attention_and_grads(*(np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v, ct)),
                                           is_causal=True, q_segment_ids=ids, kv_segment_ids=ids)
            for impl in impls:
                def run(q_, k_, v_, ct_, impl=impl):
                    out, vjp = jax.vjp(lambda a, c, d: kernels.attend(
                        a, c, d, implementation=impl, is_causal=True, segment_ids=jnp.asarray(ids)), q_, k_, v_)
                    return (out,) + vjp(ct_)
                label = [encoding, "MHA" if kh == n else f"GQA {n // kh}:1", impl, length]
                try:
                    got = jax.jit(run)(q, k, v, ct)
                except Exception as err:  # noqa: BLE001 -- an unchecked machine: record, go on
                    rows.append(label + [None] * 5 + [f"**ERROR** {type(err).__name__}: {str(err).splitlines()[0][:200]}"])
                    continue
                rel = lambda g, w: float(np.abs(np.asarray(g.astype(jnp.float32), np.float64) - w).max()
                                         / np.abs(w).max())
                sink = 3 if encoding == "goat" else 0  # bf16: u(j) split over 3 channels (prior/packing.py)
                main = [got[0], got[1][..., :got[1].shape[-1] - sink]] + list(got[2:])
                main_want = [want[0], want[1][..., :want[1].shape[-1] - sink]] + list(want[2:])
                errs = [rel(g, w) for g, w in zip(main, main_want)]
                sink_err = rel(got[1][..., -sink:], want[1][..., -sink:]) if sink else None
                rows.append(label + errs[:2] + [sink_err] + errs[2:] + ["ok" if max(errs) <= 2e-2 else "**FAIL**"])
    timing = []
    for t in timing_lengths:
        ids_t = _documents(rng, 1, t, max(2, t // 1024))
        for encoding in ("goat", "rope"):
            q, k, v = packed_inputs(encoding, 1, t, n, n // 4, h, ids_t, jnp.bfloat16)
            variants = []
            for impl in impls:
                if time.time() > deadline:
                    timing.append([t, encoding, impl, None, None, "skipped: time budget"])
                    continue
                loss = lambda q_, k_, v_, impl=impl: jnp.sum(kernels.attend(
                    q_, k_, v_, implementation=impl, is_causal=True,
                    segment_ids=jnp.asarray(ids_t)).astype(jnp.float32))
                try:
                    variants.append(jax_variant(f"{encoding}:{impl}", loss, (q, k, v), (0, 1, 2)))
                except Exception as err:  # noqa: BLE001
                    timing.append([t, encoding, impl, None, None, f"**ERROR** {type(err).__name__}: "
                                   f"{str(err).splitlines()[0][:200]}"])
            try:
                measure(variants, repeats)
            except Exception as err:  # noqa: BLE001
                timing += [[t, encoding, v_.name.split(":")[1], None, None, f"**ERROR** while running: "
                            f"{type(err).__name__}"] for v_ in variants]
                continue
            for var in variants:
                timing.append([t, encoding, var.name.split(":")[1], 1e3 * statistics.median(var.times),
                               None if var.memory is None else var.memory / 2**20, ""])
    return rows, timing

# ----------------------------------------------------------------------------------------------
# 4. The GPU-only pytest tests
# ----------------------------------------------------------------------------------------------


GPU_TESTS = ["tests/test_attention.py::test_cudnn_matches_reference_in_bf16",
             "tests/test_attention.py::test_cudnn_packed_documents_match_reference_in_bf16",
             "tests/test_attention.py::test_error_cudnn_float32_or_no_gpu", "tests/test_flash.py"]


def gpu_pytest(wheel_dir: Optional[str], budget_s: float, nodes: List[str]) -> List[str]:
    """Runs the pytest ``nodes`` in a subprocess if pytest is importable."""
    env = dict(os.environ)
    if wheel_dir:
        env["PYTHONPATH"] = os.pathsep.join(sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
                                            + [env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider"] + nodes
    probe = subprocess.run([sys.executable, "-c", "import pytest"], env=env, cwd=ROOT, capture_output=True)
    if probe.returncode:
        return ["pytest is not importable: pass `--wheel_dir` with pytest's wheels (pytest, pluggy, "
                "iniconfig, packaging) to run the GPU-only tests; the kernel check above does not need it."]
    try:
        res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired:
        return [f"`{' '.join(cmd[2:])}` timed out after {budget_s:.0f} s."]
    lines = [line for line in res.stdout.splitlines() if line.strip()]
    tail = [line for line in lines if line.startswith(("FAILED", "ERROR"))][:12] + lines[-3:]
    return [f"`{' '.join(cmd[2:])}`: exit code {res.returncode}", "", "```"] + tail + ["```"]

# ----------------------------------------------------------------------------------------------
# The sections
# ----------------------------------------------------------------------------------------------


def run_correctness(check: Check) -> None:
    """Section 1."""
    kernels_checked = [("flash", "float32", 1e-5), ("flash", "bfloat16", 2e-2), ("xla", "bfloat16", 2e-2)]
    if check.gpu:
        kernels_checked.insert(0, ("cudnn", "bfloat16", 2e-2))
    rows = correctness(kernels_checked, 16 if check.dry_run else 256, check.reference)
    check.report.section("1. Kernels vs the float64 reference (value and gradients, relative max error)",
                         check.skip_note + [""] + table(
                             ["kernel", "dtype", "mask", "L", "out", "dq", "dk", "dv", "tolerance", "result"], rows))


def run_attention(check: Check) -> None:
    """Section 2."""
    rows = attention_rows(check.lengths, check.gpu, check.repeats, check.deadline - 150)
    check.report.section("2. Attention forward+backward (B=1, N=8, H=64, causal)", check.skip_note + [""] + table(
        ["L", "variant", "dtype", "median wall ms", "compiled MiB", "note"], rows))


def run_packed(check: Check) -> None:
    """Sections 2b and 2c."""
    rows, timing = packed_rows(64 if check.dry_run else 1024, [64] if check.dry_run else [2048, 8192],
                               check.repeats, check.deadline - 90, check.dry_run, check.reference)
    check.report.section(
        "2b. Packed documents: cuDNN's packed layout vs the float64 reference (causal, per-document; "
        "relative max error of value and gradients), B=2, N=8, H=64, 6 documents per row",
        check.skip_note + [
            "GOAT's dq is split: the content and Fourier channels (tolerance 2e-2), and the 3 bf16 "
            "sink channels, reported alone: their keys carry u(j), which grows with the position, "
            "and every bf16 flash kernel (cuDNN and ours alike) rounds the softmax gradient to bf16 "
            "before multiplying it by the keys, so dq there is a small difference of large terms. "
            "Their gradient reaches a parameter only through prior_gate='query_norm' (the queries' "
            "sink channels are the constant 1 otherwise).", ""]
        + table(["encoding", "heads", "kernel", "L", "out", "dq", "dq sink channels", "dk", "dv", "result"], rows))
    check.report.section("2c. Packed documents: forward+backward wall time, cuDNN packed vs flash (bf16, B=1, N=8, "
                         "GQA 4:1, one document per 1024 tokens)", table(
                             ["L", "encoding", "kernel", "median wall ms", "compiled MiB", "note"], timing))


def run_gpu_tests(check: Check) -> None:
    """Section 4: last, with what is left of the 8 minutes (it repeats section 1 more broadly)."""
    if check.gpu:
        lines = gpu_pytest(check.wheel_dir, max(30.0, check.start + 440 - time.time()), GPU_TESTS)
    else:  # the same machinery on one quick test
        lines = (["skipped on CPU; the runner checked on one test instead:", ""]
                 + gpu_pytest(check.wheel_dir, 120.0, GPU_TESTS[2:3]))
    check.report.section("4. GPU-only pytest tests", lines)


CORRECTNESS = Section("1", "1. Kernels vs the float64 reference", run_correctness)
ATTENTION = Section("2", "2. Attention forward+backward", run_attention)
PACKED = Section("2b", "2b. Packed documents", run_packed)
GPU_TESTS_SECTION = Section("4", "4. GPU-only pytest tests", run_gpu_tests)
