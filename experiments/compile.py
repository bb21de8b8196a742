"""Compile a run's train step (or one decode step) for a TPU slice or a GPU node on this host, before booking it.

    python -m experiments.compile --config configs/lm_c4_125m.py:goat --target v5p-8 --out DIR
    python -m experiments.compile --config configs/lm_c4_125m.py:goat --target h200x8 --out DIR
    python -m experiments.compile --config configs/lm_c4_125m.py:goat --target v5e-8 --step decode --out DIR
    python -m experiments.compile --config FILE[:ARG] --target SLICE --out DIR [--config.x=y ...]

``--target`` names a TPU slice as Google Cloud does: ``v5e-N`` / ``v6e-N`` (N chips),
``v4-N`` / ``v5p-N`` (N TensorCores, two per chip: v5p-8 is 4 chips); or a GPU node as
``h100xN`` / ``h200xN`` (N GPUs: 1, 2, 4, 8 in one node, multiples of 8 as nodes of 8). The
command builds the target's devices (compile-only: no TPU or GPU needed, only libtpu,
``pip install 'goat-jax[aot]'``, or JAX's CUDA plugin, ``pip install 'goat-jax[aot-gpu]'``), the
run's mesh from ``config.mesh``, the train state as abstract arrays with their shardings and the
batch as ShapeDtypeStructs, lowers and compiles the trainer's real train step with the TPU
compiler (Mosaic kernels included) or the CUDA compiler (cuDNN's fused attention included), and writes ``DIR/compile.json`` and ``DIR/compile.md``:
per-device bytes (arguments, outputs, temporaries, aliased, total), the chip's HBM and whether the
step fits, parameters, analytic model FLOPs per step and the step time / tokens per second per
chip at peak (estimates), the attention kernel and packed head dim, compile seconds. A step
that does not fit is reported (``fits: false`` with the compiler's numbers), not a traceback.
Every flag and ``--out`` are checked before the compile: an ``--out`` that holds an earlier
compile's or search's results is refused unless ``--overwrite``, which replaces all of them (a
folder never mixes two runs' files). Ctrl-C stops a compile at once (one line, exit status
130), as SIGTERM does. See docs/aot.md and goat_jax/aot.py.

``--step decode`` compiles one KV-cache decode step instead (goat_jax/aot/decode.py): the
config's global batch, one new token per row, against a cache of its full window (``seq_len``
slots) laid out on the config's mesh (rows over data x fsdp, slots over context, KV heads over
tensor); compile.json records ``step: "decode"``, ``cache_length``, ``kv_cache_bytes_total`` and
``kv_cache_bytes_per_chip`` (the train step's records ``step: "train"``). With ``mesh.context > 1``
each chip holds ``seq_len / context`` of the cache's slots and the step attends them with the
split-cache merge (goat_jax/kernels/decode_merge.py), its one-token activations unsplit.
"""

import json
import os
import sys

# A TPU compile needs no accelerator on this host: keep JAX's own backend on the CPU (without
# this, an installed libtpu makes JAX try to open TPU chips first, and print why it could not).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A GPU compile neither: the CUDA plugin's check of its libraries against a GPU driver is moot.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

from goat_jax import _extras  # pylint: disable=g-import-not-at-top,wrong-import-position
with _extras.imports(__name__):  # the 'train' extra: one line naming it if absent
    from absl import app
    from absl import flags
from goat_jax import aot  # pylint: disable=wrong-import-position
from goat_jax import cli  # pylint: disable=wrong-import-position
from goat_jax.config import files as config_files  # pylint: disable=wrong-import-position
from goat_jax import files  # pylint: disable=wrong-import-position
from goat_jax.train import run as run_lib  # pylint: disable=wrong-import-position

_CONFIG = config_files.define_config_flag("config", None, "Config file, e.g. configs/lm_tiny.py:rope.")
_TARGET = flags.DEFINE_string(
    "target", None, "TPU slice as Cloud names it: v5e-N or v6e-N (N = chips), v4-N or v5p-N "
    "(N = TensorCores, 2 per chip); e.g. v5e-16, v6e-8, v4-8, v5p-32. Or a GPU node: h100xN or "
    "h200xN (N = GPUs: 1, 2, 4, 8; multiples of 8 are nodes of 8); e.g. h100x8, h200x1, h200x8.")
_OUT = flags.DEFINE_string("out", None, "Folder for compile.json and compile.md (created); one that holds "
                           "an earlier compile's or search's results is refused unless --overwrite.")
_SEARCH = flags.DEFINE_bool(
    "search_batch", False, "Instead of one compile: find the largest per-device batch (one microbatch, "
    "grad_accum_steps 1) whose train step fits the target, for each --search_remat setting, by doubling "
    "then bisecting with the real compiler; writes OUT/search.json and OUT/search.md (and the largest "
    "fitting batch's compile.json / compile.md).")
_SEARCH_REMAT = flags.DEFINE_list("search_remat", ["off", "on"], "With --search_batch: model.remat settings to "
                                  "search (comma list of off/on).")
_SEARCH_START = flags.DEFINE_integer("search_start", 1, "With --search_batch: the first per-device batch tried "
                                     "(start near the expected answer to spend fewer compiles).")
_MAX_COMPILES = flags.DEFINE_integer("max_compiles", 8, "With --search_batch: compiles per remat setting at most; "
                                     "a search that runs out reports its bracket.")
_STEP = flags.DEFINE_enum("step", "train", ["train", "decode"], "What to compile: the train step (default), or "
                          "one KV-cache decode step of the config's global batch (one new token per row) against a "
                          "cache of its full window (seq_len slots), sharded as the config's mesh says; compile.json "
                          "then records step 'decode', kv_cache_bytes_total and kv_cache_bytes_per_chip.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the results of an earlier compile or search in --out "
                                "(without it such an --out is refused before any work).")
flags.mark_flags_as_required(["config", "target", "out"])

# Everything a compile or a search writes into --out: an --out holding any of them is refused
# unless --overwrite, which removes them all before the new ones are written, so a folder never
# holds one run's compile.json beside another search's search.md.
RESULT_FILES = ("compile.json", "compile.md", "search.json", "search.md")
# The flags only --search_batch reads.
_SEARCH_FLAGS = ("search_remat", "search_start", "max_compiles")


def _config_arguments(argv):
    """The command's ``--config FILE[:ARG]`` and ``--config.*`` overrides, as one string."""
    kept, take = [], False
    for a in argv:
        if take or a.startswith("--config.") or a.startswith("--config="):
            kept.append(a)
        take = a == "--config"
        if take:
            kept.append(a)
    return " ".join(kept)


def check_out(out: str, overwrite: bool) -> None:
    """Refuses, before any compile, an ``--out`` that cannot be written (a file, a read-only
    place), one inside a run's workdir (the check evaluate makes), or one that holds a previous compile's or search's results (:data:`RESULT_FILES`)
    unless ``overwrite``. Nothing is removed here: with ``overwrite`` the old results stay
    until the new ones are ready (:func:`_replace_results`)."""
    run_lib.check_output_dir(out, "the compile", "_compile")
    held = sorted(n for n in RESULT_FILES if os.path.exists(os.path.join(out, n)))
    if held and not overwrite:
        raise ValueError(f"--out {out} already holds results ({', '.join(held)}); give another --out, or add "
                         "--overwrite to replace them (every compile.* and search.* file there is removed).")


def _replace_results(out: str) -> None:
    """Clears the previous results out of ``out`` (created if missing) for the new ones."""
    os.makedirs(out, exist_ok=True)
    for name in RESULT_FILES:
        path = os.path.join(out, name)
        if os.path.isfile(path):
            os.remove(path)


def _search_options():
    """``(remat settings, start, max_compiles)`` of the --search_* flags, checked; ValueError
    (one line, no usage text) naming the flag. Without --search_batch, a --search_* flag
    would be ignored, so it is refused."""
    given = [f"--{n}" for n in _SEARCH_FLAGS if flags.FLAGS[n].present]
    if not _SEARCH.value:
        if given:
            raise ValueError(f"{', '.join(given)} apply to --search_batch only; add --search_batch, or drop them.")
        return None
    remats = []
    for v in _SEARCH_REMAT.value:
        if v not in ("off", "on"):
            raise ValueError(f"--search_remat={','.join(_SEARCH_REMAT.value)}: {v!r} is neither off nor on; "
                             "give off, on or off,on.")
        remats.append(v == "on")
    if not remats:
        raise ValueError("--search_remat is empty; give off, on or off,on.")
    bad = [f"--{n}={flags.FLAGS[n].value}" for n in ("search_start", "max_compiles") if flags.FLAGS[n].value < 1]
    if bad:
        raise ValueError(f"{' and '.join(bad)}: must be >= 1 (--search_start: the first per-device batch "
                         "tried; --max_compiles: compiles per remat setting).")
    if "remat" not in _CONFIG.value.get("model", {}):
        raise ValueError("--search_batch: the config has no model.remat field to search over; search "
                         "a config whose model has one (the LM, DNA and ViT configs do).")
    return remats, _SEARCH_START.value, _MAX_COMPILES.value


def main(argv):
    """Entry point: compiles ``--config``'s train step for ``--target`` and writes ``--out``."""
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    cli.interrupt_exits_now("the compile")  # at once, not after the compile
    # Before any work (a real compile takes minutes): the target, the flags and --out.
    target = aot.parse_target(_TARGET.value)
    search = _search_options()
    if search is not None and _STEP.value == "decode":
        raise ValueError("--search_batch searches the train step's batch; drop it with --step decode (the decode "
                         "step compiles the config's global batch as it is).")
    check_out(_OUT.value, _OVERWRITE.value)
    if search is not None:
        return _search(target, *search)
    compile_step = aot.compile_decode_step if _STEP.value == "decode" else aot.compile_train_step
    report = compile_step(_CONFIG.value, target)
    report["config"] = _config_arguments(sys.argv[1:])
    _replace_results(_OUT.value)
    files.write_whole(os.path.join(_OUT.value, "compile.json"), json.dumps(report, indent=2) + "\n")
    files.write_whole(os.path.join(_OUT.value, "compile.md"), aot.markdown(report))
    mem = report["per_device_bytes"] or {}
    total = mem.get("total", report.get("compiler_used_bytes"))
    cache = (f", KV cache {report['kv_cache_bytes_per_chip'] / aot.GiB:.3f} GiB per chip of "
             f"{report['kv_cache_bytes_total'] / aot.GiB:.3f} GiB" if report.get("step") == "decode" else "")
    cli.log(f"{report['target']} ({report.get('step', 'train')} step): {report['num_devices']} devices{cache}, "
            f"{'n/a' if total is None else f'{total / aot.GiB:.3f} GiB'} per device of "
            f"{report['device_memory_bytes'] / aot.GiB:.0f} GiB, fits={report['fits']}, "
            f"attention {_attention(report)}, compiled in {report['compile_seconds']:.1f} s "
            f"-> {os.path.join(_OUT.value, 'compile.json')}")


def _attention(report) -> str:
    """The report's kernel, and under context parallelism its strategy (a ring's blocks are
    computed by ``ring_blocks``' block math, whatever kernel the layers name; Ulysses runs
    ``whole_sequence`` on the whole sequence of each device's heads)."""
    text = str(report["attention_implementation"])
    if report.get("context_strategy"):
        blocks = f", blocks by {report['ring_blocks']}'s block math" if report.get("ring_blocks") else ""
        if report.get("whole_sequence"):
            blocks += f", heads exchanged: {report['whole_sequence']} on the whole sequence"
        text += (f" (context strategy {report['context_strategy']}{blocks}, "
                 f"load-balanced {report.get('load_balanced')})")
    return text


def _search(target, remats, start, max_compiles):
    """--search_batch: :func:`goat_jax.aot.largest_batch`, written to OUT/search.{json,md}."""
    text = _config_arguments(sys.argv[1:])
    cli.log(f"searching the largest per-device batch of `{text}` on {target.name} (remat {','.join(_SEARCH_REMAT.value)})")
    search = aot.largest_batch(_CONFIG.value, target, remat_options=remats, start=start,
                               max_compiles=max_compiles, log=cli.log)
    search["config"] = text
    _replace_results(_OUT.value)
    best = [r for r in search["per_remat"] if r["report"] is not None]
    if best:
        win = max(best, key=lambda r: r["largest"])
        top = {**win["report"], "config": f"{text} --config.global_batch_size=None --config.grad_accum_steps=1 "
                                          f"--config.per_device_batch_size={win['largest']} "
                                          f"--config.model.remat={win['remat']}"}
        files.write_whole(os.path.join(_OUT.value, "compile.json"), json.dumps(top, indent=2) + "\n")
        files.write_whole(os.path.join(_OUT.value, "compile.md"), aot.markdown(top))
    files.write_whole(os.path.join(_OUT.value, "search.json"), json.dumps(search, indent=2) + "\n")
    files.write_whole(os.path.join(_OUT.value, "search.md"), aot.search_markdown(search, text))
    for r in search["per_remat"]:
        cli.log(f"{target.name} remat={'on' if r['remat'] else 'off'}: largest per-device batch "
                f"{r['largest']} (first failing {r['first_failing']}) -> {os.path.join(_OUT.value, 'search.md')}")


if __name__ == "__main__":
    cli.run_absl(main)
