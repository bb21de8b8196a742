"""The training engine under context parallelism on 8 fake CPU devices, one subprocess per plan
(tests/test_context.py): the smoke LM trained at several ``mesh.context`` sizes and context
strategies, runs resumed under another context size or strategy, and the compiled step's
per-device temporaries at several context sizes.

A plan is a dict (JSON, passed to the subprocess):

* ``common``: config overrides every run shares (steps, checkpoints, packing);
* ``runs``: ``[name, overrides, baseline]`` trained in order; ``baseline`` names an earlier run
  whose losses and evaluation loss this one must equal (None: it is a baseline);
* ``resumes``: ``[name, source, overrides]``: a copy of the finished run ``source`` without its
  last checkpoint (as if stopped one checkpoint earlier) resumed under ``overrides``; it must
  resume at the last step with the source's losses;
* ``memory``: the context sizes whose compiled train step's temporaries are measured at a fixed
  per-device batch (data 2 on 2 x context devices; the 'xla' kernel, whose T x S logits dominate).

One process serves every run of a plan: the context-1 baseline is trained once for all-gather
and ring alike, and the process (jax, the trainer, the fake devices) starts once.
"""

import json

import numpy as np

from tests.config_helpers import run_on_fake_devices

SCRIPT = r'''
import json, shutil, sys
import jax
from goat_jax.train import trainer
from tests.config_helpers import compile_train_step, lm_smoke_config
root, plan = sys.argv[1], json.loads(sys.argv[2])


def losses(workdir):
    return [r["train_loss"] for r in map(json.loads, open(workdir + "/metrics.jsonl")) if "train_loss" in r]


def config(overrides):
    return lm_smoke_config(**{"mesh.data": -1, "log_every_steps": 1, **plan["common"], **overrides})


out = {}
for name, overrides, _ in plan["runs"]:
    summary = trainer.train_and_evaluate(config(overrides), f"{root}/{name}")
    out[name] = {"losses": losses(f"{root}/{name}"), "eval_loss": summary.get("eval_loss")}
last = plan["common"]["num_train_steps"]
for name, source, overrides in plan["resumes"]:
    workdir = f"{root}/{name}"
    shutil.copytree(f"{root}/{source}", workdir)
    shutil.rmtree(f"{workdir}/checkpoints/{last}")
    out[name] = {"resumed_at": trainer.train_and_evaluate(config(overrides), workdir)["step"],
                 "losses": losses(workdir)}
memory = {}
for c in plan["memory"]:
    cfg = config({"mesh.context": c, "seq_len": 256, "model.implementation": "xla", "mesh.data": 2})
    compiled = compile_train_step(cfg, jax.devices()[:2 * c])
    memory[c] = compiled.memory_analysis().temp_size_in_bytes
out["temporaries"] = memory
print("RESULT " + json.dumps(out))
'''

RTOL = 2e-6  # float32 round-off: the sharded step sums the same terms in another order


def run_plan(plan: dict, root: str, timeout: int = 1800) -> dict:
    """Runs ``plan`` in one fake-device process under ``root``; checks every run against its
    baseline and every resume against its source (losses and evaluation loss to :data:`RTOL`,
    the resume at the last step), and returns the per-device temporaries by context size."""
    out = json.loads(run_on_fake_devices(SCRIPT, root, json.dumps(plan), timeout=timeout).split("RESULT ")[-1])
    steps = plan["common"]["num_train_steps"]
    for name, _, baseline in plan["runs"]:
        assert len(out[name]["losses"]) == steps, (name, out[name])
        if baseline is not None:
            np.testing.assert_allclose(out[name]["losses"], out[baseline]["losses"], rtol=RTOL, atol=0,
                                       err_msg=f"{name} against {baseline}")
            np.testing.assert_allclose(out[name]["eval_loss"], out[baseline]["eval_loss"], rtol=RTOL,
                                       err_msg=f"{name} against {baseline} (evaluation)")
    for name, source, _ in plan["resumes"]:
        assert out[name]["resumed_at"] == steps, (name, out[name])
        np.testing.assert_allclose(out[name]["losses"], out[source]["losses"], rtol=RTOL, err_msg=name)
    return {int(k): v for k, v in out["temporaries"].items()}
