"""The toy prior figure (paper Figure 1): train a small GOAT LM on the copy mixture, plot its prior.

    python -m experiments.toy_prior                       # ~20-40 s on 2 CPU cores
    python -m experiments.toy_prior --all_heads --workdir runs/toy4 \
        --config.model.num_heads=4 --config.model.kv_num_heads=4

Trains ``configs/toy_copy_mixture.py`` with the engine into ``--workdir`` (re-running resumes or,
when finished, goes straight to the figures), then writes into the workdir:

* ``toy_prior.png`` -- four panels for the head that shows both a sink and the lag diagonal best:
  the learned key-only sink ``u(j)``, the relative prior ``kappa(i - j)``, the row-centred total
  causal log-prior ``kappa(i - j) + u(j)`` and its row softmax (the attention of a head with no
  content signal);
* ``toy_prior_all_heads.png`` (``--all_heads``) -- the same four panels for every layer/head;
* ``toy_summary.txt`` -- what the prior learned in words (also printed): held-out loss against
  the Bayes-optimal entropy, the sink and lag-diagonal checks, one line per layer/head.

What to expect: each token copies the first token or the token at lag 1 (or is noise), and the
token identities carry no hint of *where* to look, so the prior has to learn a sink at position
0 and a diagonal at lag 1 (``goat_jax.eval.sinks.has_sink_at_zero`` / ``has_diagonal_at_lag``).
"""

from __future__ import annotations

from goat_jax.eval.toy import run_toy


def check_flags(seq_len: int) -> None:
    """Refuses a ``--seq_len`` the figures cannot show (one-line ValueError), before training."""
    from goat_jax.prior import MAX_POSITION  # pylint: disable=g-import-not-at-top
    if not 1 <= seq_len <= MAX_POSITION:
        raise ValueError(f"--seq_len={seq_len} is out of range: the figures need 1 <= seq_len <= "
                         f"{MAX_POSITION} positions (default 32).")


def main(argv) -> None:
    """Entry point: train (or resume) the toy, then figures and summary."""
    del argv
    check_flags(_SEQ_LEN.value)  # before any training: a bad flag is refused in a second
    # orbax logs dozens of INFO lines per checkpoint; the progress bar and the summary suffice.
    logging.set_verbosity(logging.WARNING)
    with cli.workdir_cleanup(_WORKDIR.value):  # a rejected config leaves no workdir behind
        result = run_toy(_CONFIG.value, _WORKDIR.value, all_heads=_ALL_HEADS.value, seq_len=_SEQ_LEN.value)
    print(result["summary"])
    for path in result["paths"]:
        print("wrote", path)


if __name__ == "__main__":
    from goat_jax import platforms  # pylint: disable=g-import-not-at-top
    platforms.avoid_libtpu_without_tpu()  # before any JAX backend starts (goat_jax/platforms.py)
    from absl import flags, logging  # pylint: disable=g-import-not-at-top

    from goat_jax import cli  # pylint: disable=g-import-not-at-top
    from goat_jax.config import files as config_files  # pylint: disable=g-import-not-at-top

    _CONFIG = config_files.define_config_flag("config", "configs/toy_copy_mixture.py",
                                              "Toy config (overrides: --config.x=y).")
    _WORKDIR = flags.DEFINE_string("workdir", "runs/toy_prior", "Run directory (checkpoint, figures).")
    _ALL_HEADS = flags.DEFINE_bool("all_heads", False, "Also write toy_prior_all_heads.png.")
    _SEQ_LEN = flags.DEFINE_integer("seq_len", 32, "Positions shown in the figures.")
    cli.run_absl(main)  # config and input errors: one line (GOAT_DEBUG=1: traceback)
