"""Initialized parameters are bit-identical to those recorded before the config/model refactor.

The fixture ``tests/fixtures/param_fingerprints.json`` holds, for one smoke config of each family
(and the LM / ViT encodings with parameters of their own), the SHA-256 of every parameter leaf's
bytes with its path, shape and dtype, as the engine initializes them
(``goat_jax.train.run.make_init_fns`` at ``PRNGKey(config.seed)``), plus the weight-decay mask
each config's optimizer applies. It was written from main @ aff7b72 with::

    PYTHONPATH=$PWD python -m tests.test_param_fingerprints --write

A refactor that renames a parameter, changes an initializer, reorders RNG splits or changes
which leaves are decayed fails here, naming the leaf.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest
from tests.marks import SLOW_CASE
from goat_jax.kernels.plan import AttentionPlan

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "param_fingerprints.json")

# (config file module, config argument). One config per family runs in the default suite
# (~4 s each, mostly the init compile); the baselines with their own parameters are 'slow'.
DEFAULT_CASES = (
    ("lm_tiny", "goat,smoke"),
    ("vit_tiny", "goat,smoke"),
    ("dna_tiny", "goat,smoke"),
)
SLOW_CASES = (
    ("lm_tiny", "rope,smoke"),
    ("lm_tiny", "learned,smoke"),
    ("lm_tiny", "naive_prior,smoke"),
    ("vit_tiny", "ape,smoke"),
)
CASES = DEFAULT_CASES + SLOW_CASES


def _config(module: str, arg: str):
    import importlib  # pylint: disable=g-import-not-at-top

    from goat_jax.train import validation  # pylint: disable=g-import-not-at-top

    # As a run has it: the engine fields the file leaves out at their declared defaults.
    return validation.add_engine_defaults(importlib.import_module(f"configs.{module}").get_config(arg))


def _leaf_records(tree) -> dict:
    """``{keystr(path): 'dtype shape sha256'}`` of every leaf, in flatten order."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        arr = np.asarray(leaf)
        digest = hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
        out[jax.tree_util.keystr(path)] = f"{arr.dtype} {list(arr.shape)} {digest}"
    return out


def fingerprint(module: str, arg: str) -> dict:
    """Parameter leaf hashes and the decay mask of ``configs/<module>.py:<arg>`` at init."""
    from goat_jax.train import run as run_lib  # pylint: disable=g-import-not-at-top
    from goat_jax.train import tasks  # pylint: disable=g-import-not-at-top

    config = _config(module, arg)
    task = tasks.get_task(config.task)
    model = task.build_model(config, AttentionPlan.from_config(config))
    tx, _ = run_lib.make_optimizer(task, config)
    init_params, _ = run_lib.make_init_fns(task, model, tx, config, 1)
    params = nn.unbox(jax.jit(init_params)(jax.random.PRNGKey(config.seed)))
    mask = _decay_mask(task, config, params)
    return {"params": _leaf_records(params),
            "decayed": sorted(jax.tree_util.keystr(p) for p, m in
                              jax.tree_util.tree_flatten_with_path(mask)[0] if m)}


def _decay_mask(task, config, params):
    """The pytree of bools (True = decayed) the optimizer of ``config`` uses."""
    from goat_jax.train import optim  # pylint: disable=g-import-not-at-top

    grouping = config.optimizer.get("decay_grouping", "default")
    if grouping != "default":
        return task.decay_groupings[grouping](params)
    return optim.decay_mask(params, frozenset(task.no_decay_names))


def _load():
    with open(FIXTURE) as f:
        return json.load(f)


_SCRIPT = ("import json, sys; from tests.test_param_fingerprints import fingerprint; "
           "print('RESULT ' + json.dumps({f'{m}:{a}': fingerprint(m, a) for m, a in json.loads(sys.argv[1])}))")


@pytest.fixture(scope="module")
def at_defaults():
    """``fingerprint`` computed at XLA's default optimization level, as recorded
    (:func:`tests.config_helpers.run_at_xla_defaults`): the default cases in one process on the
    first call, any other case in a process of its own."""
    from tests import config_helpers  # pylint: disable=g-import-not-at-top

    def compute(cases):
        out = json.loads(config_helpers.run_at_xla_defaults(_SCRIPT, json.dumps(cases)).split("RESULT ")[-1])
        return {case: out[f"{case[0]}:{case[1]}"] for case in cases}
    return config_helpers.computed_in_batches(compute, list(DEFAULT_CASES))


@pytest.mark.parametrize("module,arg", list(DEFAULT_CASES) + [
    pytest.param(m, a, marks=SLOW_CASE) for m, a in SLOW_CASES])
def test_params_bit_identical(module, arg, at_defaults):
    want = _load()[f"{module}:{arg}"]
    got = at_defaults((module, arg))
    assert list(got["params"]) == list(want["params"]), "parameter tree structure changed"
    changed = [k for k in want["params"] if got["params"][k] != want["params"][k]]
    assert not changed, f"parameters differ from main @ aff7b72: {changed}"
    assert got["decayed"] == want["decayed"], "the weight-decay mask changed"


def test_fixture_covers_every_case():
    """Every case has a recorded fingerprint, each with parameters and a non-trivial mask."""
    data = _load()
    assert sorted(data) == sorted(f"{m}:{a}" for m, a in CASES)
    for name, entry in data.items():
        assert entry["params"], name
        assert 0 < len(entry["decayed"]) < len(entry["params"]), name


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: PYTHONPATH=$PWD python -m tests.test_param_fingerprints --write")
    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    records = {f"{m}:{a}": fingerprint(m, a) for m, a in CASES}
    with open(FIXTURE, "w") as f:
        json.dump(records, f, indent=1)  # leaf order as flattened: the test compares it
        f.write("\n")
    print(f"wrote {FIXTURE}: {len(records)} configs")
