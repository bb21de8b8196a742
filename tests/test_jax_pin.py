"""jax is pinned (pyproject.toml: jax==0.10.2, jaxlib with it) because the code relies on jax's
private modules. Each private entry point the code uses is named here, with what the code needs
of it, and checked against the installed jax: a release that moves one fails this test with the
entry point's name and the file that uses it, not somewhere deep in a kernel on a GPU.

The table is complete: every ``jax._src`` import in goat_jax/ and experiments/ (read with ``ast``)
must have its row, and every module-level name the code replaces at run time (the monkey-patches
of ``goat_jax.aot.target.gpu_target``) must still be read through the module's globals by the
functions that check the GPU, or the replacement would change nothing.

The entry points are checked on the installed jax, whatever its version (the GPU check runs
under another jax on the lent machine); that the installed jax is the pinned one is a test of
its own.
"""

import ast
import importlib
import inspect
import os
import re
import tomllib

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FA = "jax._src.cudnn.fused_attention_stablehlo"
SPLASH = "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel"

# (private module, attribute path or None for the module itself, the file that uses it, what it
# must accept: keyword parameters of a callable, or members of an enum).
ENTRY_POINTS = [
    (FA, "dot_product_attention", "goat_jax/kernels/cudnn.py, goat_jax/kernels/cudnn_packed.py",
     ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale", "mask_type", "qkv_layout")),
    (FA, "MaskType", "goat_jax/kernels/cudnn.py, goat_jax/kernels/cudnn_packed.py",
     ("NO_MASK", "CAUSAL", "PADDING", "PADDING_CAUSAL")),
    (FA, "check_compute_capability", "goat_jax/kernels/cudnn.py, goat_jax/aot/target.py", ("capability",)),
    (FA, "check_cudnn_version", "goat_jax/kernels/cudnn.py, goat_jax/aot/target.py", ()),
    (FA, "is_cuda_compute_capability_equal", "goat_jax/aot/target.py", ("capability",)),
    ("jax._src.mesh", "thread_resources.env.physical_mesh", "goat_jax/kernels/choice.py", ()),
    ("jax._src.xla_bridge", "get_backend", "goat_jax/aot/target.py", ()),
    # Ring blocks on cuDNN: the forward with its float32 stats, and the backward primitive bound
    # with the ring's merged output and stats.
    (FA, "dot_product_attention", "goat_jax/kernels/ring_blocks.py",
     ("scale", "mask_type", "qkv_layout", "return_residual")),
    (FA, "_dot_product_attention_bwd_p_wrapper.bind", "goat_jax/kernels/ring_blocks.py", ()),
    (FA, "AttentionLayout", "goat_jax/kernels/ring_blocks.py", ("BTNH",)),
    # Ring blocks on splash (not under jax._src, but private): the backward fed with the global
    # output and log-sum-exp.
    (SPLASH, "_splash_attention_bwd", "goat_jax/kernels/ring_blocks.py",
     ("save_residuals", "mask_value", "is_mqa", "block_sizes", "residual_checkpoint_name", "mask_function",
      "attn_logits_soft_cap", "interpret", "res", "do")),
]
# Names goat_jax.aot.target.gpu_target replaces in FA, and the FA functions that must read them
# as module globals for the replacement to act.
PATCHED = {"check_compute_capability": "check_is_flash_attention",
           "is_cuda_compute_capability_equal": "check_is_flash_attention",
           "check_cudnn_version": "dot_product_attention"}


def _resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("module,path,used_by,needs", ENTRY_POINTS,
                         ids=[f"{m}.{p}" for m, p, _, _ in ENTRY_POINTS])
def test_each_private_entry_point_the_code_uses_is_where_it_was(module, path, used_by, needs):
    where = f"{module}.{path} (used by {used_by}; pinned jax==0.10.2 in pyproject.toml)"
    try:
        obj = _resolve(module, path)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"jax {jax.__version__} moved a private entry point: {where}: {type(e).__name__}: {e}")
    if isinstance(obj, type) and hasattr(obj, "__members__"):
        missing = [n for n in needs if n not in obj.__members__]
    elif callable(obj) and needs:
        params = inspect.signature(obj).parameters
        positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        # A needed name absent as a keyword: for one-argument checks only the arity counts.
        missing = [n for n in needs if n not in params] if len(needs) > 1 else (
            [] if len(positional) >= 1 else list(needs))
    else:
        missing = []
    assert not missing, f"jax {jax.__version__}: {where} no longer takes {missing}"


@pytest.mark.parametrize("name,reader", sorted(PATCHED.items()))
def test_the_names_gpu_target_replaces_are_still_read_through_the_module(name, reader):
    """gpu_target assigns FA.<name> for the ``with`` block; that works only while FA's own
    functions look the name up in the module's globals at call time."""
    fa = importlib.import_module(FA)
    fn = getattr(fa, reader, None)
    assert fn is not None and name in fn.__code__.co_names and fn.__globals__ is vars(fa), (
        f"jax {jax.__version__}: {FA}.{reader} no longer reads {name} from its module, so "
        f"goat_jax.aot.target.gpu_target's replacement of {FA}.{name} would change nothing")


def _private_imports():
    """``[(file, module)]``, one per ``jax._src`` import statement in goat_jax/ and experiments/."""
    found = []
    for folder in ("goat_jax", "experiments"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, folder)):
            for name in names:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    tree = ast.parse(f.read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jax._src"):
                        mods = [f"{node.module}.{a.name}" for a in node.names]
                    elif isinstance(node, ast.Import):
                        mods = [a.name for a in node.names if a.name.startswith("jax._src")]
                    else:
                        continue
                    for m in mods:
                        found.append((os.path.relpath(path, ROOT), m))
    return found


def test_every_private_import_of_the_code_has_a_row_above():
    covered = {m for m, _, _, _ in ENTRY_POINTS}
    imports = _private_imports()
    assert len(imports) == 7, sorted(imports)  # the six the pin was written for, and the ring blocks' cuDNN
    missing = sorted((f, m) for f, m in imports if m not in covered)
    assert not missing, f"private jax imports without a row in ENTRY_POINTS (add one): {missing}"


def test_the_installed_jax_is_the_pinned_one_and_pyproject_says_why():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    pins = {d.split("==")[0]: d.split("==")[1] for d in deps if "==" in d}
    assert pins.get("jax") == pins.get("jaxlib") == "0.10.2", deps
    assert re.search(r"#.*jax 0\.10\.2's private", text), "pyproject.toml: say why jax is pinned"
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        assert f"jax=={pins['jax']}" in f.read().split()
    if jax.__version__ != pins["jax"]:
        pytest.skip(f"jax {jax.__version__} is installed, not the pinned {pins['jax']}: the entry "
                    "points above were checked on it")
