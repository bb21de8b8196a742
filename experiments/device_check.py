"""One prepared check for a one-GPU machine; writes a markdown table (``benchmarks/gpu.md``).

    scripts/device_check.sh [--out benchmarks/gpu.md] [--wheel_dir DIR]   # on the GPU machine
    python -m experiments.device_check --dry_run --out /tmp/gpu.md       # CPU, tiny sizes

Sections (each written to ``--out`` as soon as it finishes, so a timeout keeps what ran):

1. Correctness on the GPU: the kernels (cuDNN, flash, XLA) against the hand-written float64
   reference (``tests/goat_reference.py``: value and dq/dk/dv) at bf16 tolerance (2e-2, the bar
   the GPU-only test uses), flash also in float32 at 1e-5.
2b. Packed documents (segment ids) on cuDNN's packed layout: GOAT and RoPE, MHA and GQA (4 query
   heads per key head), value and gradients against the float64 reference; then the wall time
   of cuDNN packed against 'flash' on the same inputs at 2k and 8k.
2. Attention forward+backward, B=1, 8 heads, H=64, causal, at 1k-16k: GOAT packed on cuDNN vs
   plain cuDNN flash vs GOAT's dense log-prior as a bias on XLA (bf16), and the flash kernel on
   GOAT's packed q/k in float32 vs XLA float32: median wall ms and compiled memory (temp +
   argument + output bytes, ``memory_analysis()``). A variant that would not fit in device memory
   is compiled but not run.
3. The 125M language model (12 layers, d 768, 12 heads, GOAT, bf16, seq 2048) train step:
   tokens/s and MFU (model FLOPs from ``lm_flops_per_token`` over the bf16 dense peak).
4. With the time left: the GPU-only pytest tests (the cuDNN tests of ``tests/test_attention.py``,
   and ``tests/test_flash.py`` on the GPU) if pytest is importable (carry its wheels with ``--wheel_dir``).

The GPU image has jax, flax, optax, orbax and einops but not tensorflow, grain or ml_collections:
nothing here imports them (``--dry_run`` makes them unimportable to prove it), and the model is
built from ``LMConfig`` directly. ``--wheel_dir`` puts every ``*.whl`` in a folder on
``sys.path`` (pure-Python wheels import from the zip), e.g. pytest and its dependencies.
``--dry_run``: CPU, tiny sizes, every code path that needs no GPU; cuDNN rows say they were
skipped. A time budget (``--budget_s``, default 420 s) skips what would run past 8 minutes.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import statistics
import subprocess
import sys
import time
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = ("tensorflow", "grain", "ml_collections")  # absent from the GPU image


class Report:
    """Markdown sections, rewritten to ``path`` after each one (a timeout keeps what ran)."""

    def __init__(self, path: Optional[str], header: List[str]):
        self.path, self.lines = path, list(header)

    def section(self, title: str, lines: List[str]) -> None:
        self.lines += [f"## {title}", ""] + lines + [""]
        print("\n".join([f"## {title}"] + lines), flush=True)
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "w") as f:
                f.write("\n".join(self.lines) + "\n")


def table(head: List[str], rows: List[List]) -> List[str]:
    """A markdown table."""
    fmt = lambda x: "-" if x is None else (f"{x:.4g}" if isinstance(x, float) else str(x))
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows])


# ----------------------------------------------------------------------------------------------
# 1. Correctness against the float64 reference
# ----------------------------------------------------------------------------------------------


def correctness(kernel_names: List[str], length: int) -> List[List]:
    """Each kernel's value and q/k/v gradients vs ``goat_reference.attention_and_grads``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from goat_jax import kernels
    from tests import goat_reference as ref

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


SECTIONS = ("1", "2", "2b", "3", "4")


class _Skipped(Exception):
    """A section left out with ``--sections``."""


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
    from goat_jax import segments
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


def packed_rows(length: int, timing_lengths: List[int], repeats: int, deadline: float, dry_run: bool) -> List[List]:
    """cuDNN's packed layout vs the float64 reference (value, dq, dk, dv) for GOAT and RoPE, MHA
    and GQA (4 query heads per key head); then forward+backward wall time against 'flash' on the
    same inputs. On CPU (dry run) the 'cudnn' rows say they were skipped and flash is checked."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from goat_jax import kernels
    from goat_jax.benchmarking import jax_variant, measure
    from tests import goat_reference as ref

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
# 3. The 125M train step
# ----------------------------------------------------------------------------------------------


def train_step_rows(dry_run: bool, steps: int, deadline: float) -> List[List]:
    """tokens/s and MFU of a GOAT LM train step (AdamW, bf16 compute, float32 master weights)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from goat_jax.models.lm import LMConfig, TransformerLM, lm_flops_per_token

    if dry_run:
        cfg, batch, seq = LMConfig(vocab_size=259, num_layers=1, embed_dim=32, num_heads=2, mlp_dim=64,
                                   pos_rank=2, abs_rank=2, training_seq_len=32, dtype="float32"), 2, 32
    else:  # the Llama-style 125M of configs/lm_c4_125m.py:goat,llama, without ml_collections
        cfg, batch, seq = LMConfig(vocab_size=32_000, num_layers=12, embed_dim=768, num_heads=12, mlp_dim=2560,
                                   training_seq_len=2048, dtype="bfloat16", param_dtype="float32",
                                   scan_layers=True), 8, 2048
    model = TransformerLM(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (batch, seq + 1)), jnp.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
    tx = optax.adamw(1e-4, weight_decay=0.1)
    opt_state = tx.init(params)

    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = model.apply({"params": p}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    # The compile-time view beside the measurement (as experiments.compile reports it): XLA's
    # memory plan of the step and the step time at the chip's peak bf16 FLOP/s.
    mem = step.lower(params, opt_state, tokens).compile().memory_analysis()
    planned_gib = None if mem is None else (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                            + mem.temp_size_in_bytes - mem.alias_size_in_bytes) / 2**30
    for _ in range(2):  # compile + warm-up
        params, opt_state, loss = step(params, opt_state, tokens)
    jax.block_until_ready(loss)
    done, t0 = 0, time.perf_counter()
    while done < steps and time.time() < deadline:
        params, opt_state, loss = step(params, opt_state, tokens)
        jax.block_until_ready(loss)
        done += 1
    dt = (time.perf_counter() - t0) / max(done, 1)
    tok_s = batch * seq / dt
    kind = jax.devices()[0].device_kind
    from goat_jax.targets import chips  # the one chip table (dense bf16 peak per device)
    peak = chips.peak_flops_per_device(kind)
    peak = None if peak is None else peak / 1e12  # TFLOP/s
    mfu = None if peak is None or jax.default_backend() != "gpu" else lm_flops_per_token(cfg, seq) * tok_s / (peak * 1e12)
    est_ms = None if peak is None else 1e3 * lm_flops_per_token(cfg, seq) * batch * seq / (peak * 1e12)
    name = "tiny (dry run)" if dry_run else "125M (12 x 768, 12 heads, GOAT)"
    return [[name, cfg.dtype, batch, seq, done, 1e3 * dt, est_ms, tok_s, mfu, planned_gib,
             f"{kind}, peak {peak or '-'} TFLOP/s bf16", f"loss {float(loss):.3f}"]]


# ----------------------------------------------------------------------------------------------


def forbid_imports() -> None:
    """Makes the modules missing on the GPU image unimportable (``import`` raises ImportError)."""
    for name in FORBIDDEN:
        sys.modules[name] = None  # type: ignore[assignment]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "gpu.md"))
    parser.add_argument("--dry_run", action="store_true", help="CPU, tiny sizes, no cuDNN")
    parser.add_argument("--wheel_dir", default=None, help="folder of pure-Python wheels to put on sys.path")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="default 1024..16384 (dry: 64)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5; dry 1)")
    parser.add_argument("--budget_s", type=float, default=420.0, help="skip what starts after this many seconds")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS,
                        help="run only these sections (a rerun after a fix; default all)")
    args = parser.parse_args(argv)
    run = set(args.sections)
    start = time.time()
    deadline = start + args.budget_s
    if args.dry_run:
        forbid_imports()
    if args.wheel_dir:
        sys.path[:0] = sorted(glob.glob(os.path.join(args.wheel_dir, "*.whl")))
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import jax

    backend = jax.default_backend()
    if not args.dry_run and backend != "gpu":
        print(f"JAX backend is '{backend}', not 'gpu': run on the GPU machine, or pass --dry_run.")
        return 2
    lengths = args.lengths or ([64] if args.dry_run else [1024, 2048, 4096, 8192, 16384])
    repeats = args.repeats or (1 if args.dry_run else 5)
    cudnn = backend == "gpu"
    report = Report(args.out, [
        "# GPU check" + (" (DRY RUN on CPU: tiny sizes, not a measurement)" if args.dry_run else ""), "",
        f"Command: `scripts/device_check.sh {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
        f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}; jax {jax.__version__}; device "
        f"{jax.devices()[0].device_kind} ({backend}).", ""])
    skip_note = [] if cudnn else ["cuDNN rows skipped: no GPU (JAX backend 'cpu')."]

    kernels_checked = [("flash", "float32", 1e-5), ("flash", "bfloat16", 2e-2), ("xla", "bfloat16", 2e-2)]
    if cudnn:
        kernels_checked.insert(0, ("cudnn", "bfloat16", 2e-2))
    if "1" in run:
        rows = correctness(kernels_checked, 16 if args.dry_run else 256)
        report.section("1. Kernels vs the float64 reference (value and gradients, relative max error)", skip_note + [""] + table(
            ["kernel", "dtype", "mask", "L", "out", "dq", "dk", "dv", "tolerance", "result"], rows))

    if "2" in run:
        rows = attention_rows(lengths, cudnn, repeats, deadline - 150)
        report.section("2. Attention forward+backward (B=1, N=8, H=64, causal)", skip_note + [""] + table(
            ["L", "variant", "dtype", "median wall ms", "compiled MiB", "note"], rows))

    try:
        if "2b" not in run:
            raise _Skipped
        rows, timing = packed_rows(64 if args.dry_run else 1024, [64] if args.dry_run else [2048, 8192],
                                   repeats, deadline - 90, args.dry_run)
        report.section("2b. Packed documents: cuDNN's packed layout vs the float64 reference (causal, per-document; "
                       "relative max error of value and gradients), B=2, N=8, H=64, 6 documents per row",
                       skip_note + [
                           "GOAT's dq is split: the content and Fourier channels (tolerance 2e-2), and the 3 bf16 "
                           "sink channels, reported alone: their keys carry u(j), which grows with the position, "
                           "and every bf16 flash kernel (cuDNN and ours alike) rounds the softmax gradient to bf16 "
                           "before multiplying it by the keys, so dq there is a small difference of large terms. "
                           "Their gradient reaches a parameter only through prior_gate='query_norm' (the queries' "
                           "sink channels are the constant 1 otherwise).", ""]
                       + table(["encoding", "heads", "kernel", "L", "out", "dq", "dq sink channels", "dk", "dv",
                                "result"], rows))
        report.section("2c. Packed documents: forward+backward wall time, cuDNN packed vs flash (bf16, B=1, N=8, "
                       "GQA 4:1, one document per 1024 tokens)", table(
                           ["L", "encoding", "kernel", "median wall ms", "compiled MiB", "note"], timing))
    except _Skipped:
        pass
    except Exception as err:  # noqa: BLE001 -- keep the sections above
        report.section("2b. Packed documents", [f"**ERROR** {type(err).__name__}: {str(err).splitlines()[0][:300]}"])

    try:
        if "3" not in run:
            raise _Skipped
        rows = train_step_rows(args.dry_run, 2 if args.dry_run else 30, deadline + 30)
        report.section("3. LM train step (measured, beside the compile-time estimate: step time at 100% of the "
                       "peak, and XLA's memory plan)", table(
                           ["model", "compute dtype", "batch", "seq", "steps timed", "ms/step", "est. ms/step at peak",
                            "tokens/s", "MFU", "planned GiB", "device", "note"], rows))
    except _Skipped:
        pass
    except Exception as err:  # noqa: BLE001 -- keep the sections above
        report.section("3. LM train step", [f"**ERROR** {type(err).__name__}: {str(err).splitlines()[0][:300]}"])

    # Last, with what is left of the 8 minutes: the pytest suite repeats section 1 more broadly.
    if "4" not in run:
        pass
    elif cudnn:
        report.section("4. GPU-only pytest tests", gpu_pytest(args.wheel_dir, max(30.0, start + 440 - time.time()),
                                                             GPU_TESTS))
    else:  # the same machinery on one quick test
        report.section("4. GPU-only pytest tests", ["skipped on CPU; the runner checked on one test instead:", ""]
                       + gpu_pytest(args.wheel_dir, 120.0, GPU_TESTS[2:3]))

    loaded = [m for m in FORBIDDEN if sys.modules.get(m) is not None]
    report.section("Environment", [f"Imported of {FORBIDDEN}: {loaded or 'none'}; total {time.time() - start:.0f} s."])
    return 0


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    sys.exit(main())
