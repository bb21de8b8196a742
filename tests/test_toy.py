"""The toy copy-mixture experiment (paper Figure 1): a short training run of
configs/toy_copy_mixture.py:smoke must learn a prior with a sink at position 0 and a diagonal
at lag 1, and experiments.toy_prior must write its figures and summary."""

import os

import numpy as np
import pytest

from configs import toy_copy_mixture
from goat_jax.eval import toy as toy_prior
from goat_jax.eval import sinks
from goat_jax.train import trainer


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """Trains the smoke toy once (300 steps, ~20-40 s on 2 cores) and writes every output."""
    workdir = str(tmp_path_factory.mktemp("toy"))
    result = toy_prior.run_toy(toy_copy_mixture.get_config("smoke"), workdir, all_heads=True)
    return workdir, result


def test_prior_learns_sink_at_zero_and_diagonal_at_lag_one(toy_run):
    _, result = toy_run
    checks = result["checks"]
    assert checks["sink"], f"no sink at position 0: margins {checks['sink_margin']}"
    assert checks["diagonal"], f"no diagonal at lag 1: margins {checks['lag_margin']}"
    assert checks["lag"] == 1
    # The model learned the task: well below the uniform guess, near the Bayes-optimal loss.
    loss = result["loss"]
    assert loss["nll"] < loss["bayes"] + 0.25 * (loss["uniform"] - loss["bayes"]), loss


def test_prior_checks_agree_with_the_eval_module(toy_run):
    """The toy's checks are goat_jax.eval.sinks' checks on the stored checkpoint (no private
    re-implementation): a flat prior fails both."""
    workdir, result = toy_run
    from goat_jax.eval import lm_run  # pylint: disable=g-import-not-at-top
    run = lm_run.load_lm_run(workdir)
    priors = sinks.log_priors(run.model, run.params, 32)
    assert sinks.has_sink_at_zero(priors, toy_prior.MARGIN) == result["checks"]["sink"]
    assert sinks.has_diagonal_at_lag(priors, 1, toy_prior.MARGIN) == result["checks"]["diagonal"]
    flat = np.where(np.isfinite(priors), 0.0, -np.inf)
    assert not sinks.has_sink_at_zero(flat) and not sinks.has_diagonal_at_lag(flat, 1)


def test_outputs_written(toy_run):
    workdir, result = toy_run
    for name in ("toy_prior.png", "toy_prior_all_heads.png", "toy_summary.txt"):
        path = os.path.join(workdir, name)
        assert os.path.getsize(path) > 1000 if name.endswith(".png") else os.path.getsize(path) > 100
    text = open(os.path.join(workdir, "toy_summary.txt")).read()
    assert text == result["summary"]
    assert "sink at position 0: YES" in text and "diagonal at lag 1: YES" in text
    assert "layer 0 head 0:" in text


def test_rerun_skips_training(toy_run, monkeypatch):
    """A finished workdir goes straight to the figures (the engine resumes at the last step)."""
    workdir, _ = toy_run
    steps = []
    real = trainer.train_and_evaluate
    monkeypatch.setattr(trainer, "train_and_evaluate",
                        lambda c, w: steps.append(real(c, w)["step"]) or {"step": steps[-1]})
    toy_prior.run_toy(toy_copy_mixture.get_config("smoke"), workdir)
    assert steps == [toy_copy_mixture.get_config("smoke").num_train_steps]


def test_config_rejects_unknown_argument():
    with pytest.raises(ValueError, match=r"unknown config argument token 'big'. accepted tokens.*size: smoke"):
        toy_copy_mixture.get_config("big")
    trainer.validate_config(toy_copy_mixture.get_config(), num_devices=1)
