"""One prepared check for a one-GPU machine; writes a markdown table (``benchmarks/gpu.md``).

    scripts/device_check.sh [--out benchmarks/gpu.md] [--wheel_dir DIR]   # on the GPU machine
    scripts/device_check.sh --sections 1 5 6                            # issue #55's lease
    python -m experiments.device_check --dry_run --out /tmp/gpu.md       # CPU, tiny sizes

The sections live in ``goat_jax/device_check/`` (one module per family); this command parses the
flags and runs those listed in ``SECTIONS`` (each written to ``--out`` as soon as it finishes, so
a timeout keeps what ran; a section that raises is reported and the next one runs):

1. the kernels vs the float64 reference; 2. attention forward+backward at 1k-16k (GOAT on cuDNN,
plain cuDNN, GOAT's dense prior on XLA, flash/XLA in float32); 2b/2c. packed documents on
cuDNN's packed layout (value and gradients vs float64, then time vs flash); ring. ring attention's
per-step work on one GPU (cuDNN ring blocks vs flash blocks vs plain cuDNN); ulysses. one device's
attention per layer under Ulysses (cuDNN's packed layout on the whole sequence) against the ring's
blocks, packed documents, FineWeb 1B's heads; 3. the 125M LM train
step (tokens/s, MFU); 5. the q/k width sweep on cuDNN (64-128, GOAT's layouts, RoPE, as ratios
to plain); 6 / 6b. the 125M step's throughput levers, GOAT beside RoPE; 4. the GPU-only pytest
tests, last, with the time left.

The GPU image has jax, flax, optax, orbax and einops but not tensorflow, grain or ml_collections:
nothing here imports them (``--dry_run`` makes them unimportable to prove it), and the model is
built from ``LMConfig`` directly. ``--wheel_dir`` puts every ``*.whl`` in a folder on
``sys.path`` (pure-Python wheels import from the zip), e.g. pytest and its dependencies.
``--dry_run``: CPU, tiny sizes, every code path that needs no GPU; cuDNN rows say they were
skipped. A time budget (``--budget_s``, default 420 s) skips what would run past 8 minutes; each
of sections 5, 6 and 6b also stops starting rows after its own share (their modules' ``SHARE_S``),
so all of them together do not fit one 8-minute run: choose with ``--sections`` (docs/training.md,
"GPU settings").
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = ("tensorflow", "grain", "ml_collections")  # absent from the GPU image


def sections():
    """The check's sections in the order they run (``--sections`` picks among their keys): one
    line per section family, so a new one is one entry here and a module in goat_jax/device_check/."""
    from goat_jax.device_check import Section, kernel_sections, levers, ring, train_step, ulysses, widths  # pylint: disable=g-import-not-at-top

    return [kernel_sections.CORRECTNESS, kernel_sections.ATTENTION, kernel_sections.PACKED,
            Section("ring", "ring. Ring attention per step", ring.run_ring),
            Section("ulysses", "ulysses. One device's attention per layer, Ulysses vs ring", ulysses.run_ulysses),
            train_step.TRAIN_STEP,
            widths.WIDTH_SWEEP,
            levers.LEVERS, levers.LEVERS_B,
            kernel_sections.GPU_TESTS_SECTION]  # last: the pytest run takes what time is left


SECTIONS = ("1", "2", "2b", "ring", "ulysses", "3", "5", "6", "6b", "4")  # the keys of sections(), for --sections


def forbid_imports() -> None:
    """Makes the modules missing on the GPU image unimportable (``import`` raises ImportError)."""
    for name in FORBIDDEN:
        sys.modules[name] = None  # type: ignore[assignment]


def main(argv=None) -> int:
    """Parses the flags, then runs the chosen sections in order (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "gpu.md"))
    parser.add_argument("--dry_run", action="store_true", help="CPU, tiny sizes, no cuDNN")
    parser.add_argument("--wheel_dir", default=None, help="folder of pure-Python wheels to put on sys.path")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="section 2: default 1024..16384 (dry: 64)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5; dry 1)")
    parser.add_argument("--budget_s", type=float, default=420.0, help="skip what starts after this many seconds")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS,
                        help="run only these sections (a rerun after a fix; default all, in the listed order)")
    args = parser.parse_args(argv)
    start = time.time()
    if args.dry_run:
        forbid_imports()
    if args.wheel_dir:
        sys.path[:0] = sorted(glob.glob(os.path.join(args.wheel_dir, "*.whl")))
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import jax  # pylint: disable=g-import-not-at-top

    from goat_jax.device_check import Check  # pylint: disable=g-import-not-at-top
    from goat_jax.device_check.report import Report, error_text  # pylint: disable=g-import-not-at-top
    from tests import cudnn_stand_in, goat_reference  # pylint: disable=g-import-not-at-top  # float64 reference, CPU stand-in

    backend = jax.default_backend()
    if not args.dry_run and backend != "gpu":
        print(f"JAX backend is '{backend}', not 'gpu': run on the GPU machine, or pass --dry_run.")
        return 2
    report = Report(args.out, [
        "# GPU check" + (" (DRY RUN on CPU: tiny sizes, not a measurement)" if args.dry_run else ""), "",
        f"Command: `scripts/device_check.sh {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
        f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}; jax {jax.__version__}; device "
        f"{jax.devices()[0].device_kind} ({backend}).", ""])
    check = Check(report=report, dry_run=args.dry_run, gpu=backend == "gpu",
                  lengths=args.lengths or ([64] if args.dry_run else [1024, 2048, 4096, 8192, 16384]),
                  repeats=args.repeats or (1 if args.dry_run else 5), start=start, budget_s=args.budget_s,
                  wheel_dir=args.wheel_dir, reference=goat_reference,
                  stand_in=None if backend == "gpu" else cudnn_stand_in.calls)
    for section in sections():
        if section.key not in args.sections:
            continue
        try:
            section.run(check)
        except Exception as err:  # noqa: BLE001 -- keep the sections before and run the next
            report.section(section.title, [error_text(err, 300)])

    loaded = [m for m in FORBIDDEN if sys.modules.get(m) is not None]
    report.section("Environment", [f"Imported of {FORBIDDEN}: {loaded or 'none'}; total {time.time() - start:.0f} s."])
    return 0


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    sys.exit(main())
