"""Config fields that another field's value makes inert are refused in one line naming both, not
silently ignored (issue #67, item 7 and its sweep; the fields that stay documented instead are
listed in docs/training.md, "Settings another setting makes inert")."""

import pytest

from goat_jax.data import text
from goat_jax.models import LMConfig
from goat_jax.tasks import lm as lm_task
from goat_jax.train import trainer
from tests.config_helpers import lm_smoke_config


def test_remat_policy_without_remat_is_refused():
    """``model.remat_policy`` says what each rematerialized block keeps; without
    ``model.remat=True`` it was silently ignored."""
    with pytest.raises(ValueError, match=r"model.remat_policy='dots' applies only with model.remat=True"):
        LMConfig(remat_policy="dots")
    LMConfig(remat=True, remat_policy="dots")  # what it is for
    LMConfig(remat_policy="full")  # the default: nothing to refuse
    with pytest.raises(ValueError, match=r"model.remat_policy='dots_no_batch' applies only with model.remat=True"):
        trainer.validate_config(lm_smoke_config(**{"model.remat_policy": "dots_no_batch"}), 1)
    trainer.validate_config(lm_smoke_config(**{"model.remat_policy": "dots_no_batch", "model.remat": True}), 1)


def test_the_compile_tools_remat_search_turns_the_policy_off_with_remat():
    """The batch search compiles each config with remat off and on: off resets the policy to its
    default instead of building a config the model refuses."""
    from goat_jax.aot import search  # pylint: disable=g-import-not-at-top

    config = lm_smoke_config(**{"model.remat": True, "model.remat_policy": "dots"})
    off, on = search.with_batch(config, 2, remat=False), search.with_batch(config, 2, remat=True)
    assert (off.model.remat, off.model.remat_policy) == (False, "full")
    assert (on.model.remat, on.model.remat_policy) == (True, "dots")
    lm_task.model_config(off)  # the model's fields of the section (the plan's are the plan's)


@pytest.mark.parametrize("overrides, says", [
    ({"eval_paths": ("held.txt",), "eval_fraction": 0.1}, r"data.eval_fraction=0.1 is not used: data.eval_paths is set"),
    ({"source": "tfds", "eval_fraction": 0.1}, r"data.eval_fraction=0.1 is not used: data.source='tfds'"),
])
def test_an_eval_fraction_that_holds_out_nothing_is_refused(overrides, says):
    cfg = text.default_data_config()
    cfg.update(overrides)
    with pytest.raises(ValueError, match=says):
        text._check_config(cfg)  # pylint: disable=protected-access
    cfg.eval_fraction = text.DATA.default_values()["eval_fraction"]  # left at its default: fine
    text._check_config(cfg)  # pylint: disable=protected-access
