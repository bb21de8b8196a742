"""Config helpers shared by the engine tests."""

from configs import lm_tiny


def set_fields(config, **overrides):
    """Sets dotted fields, ``set_fields(c, **{'optimizer.learning_rate': 1e-3})``; returns c."""
    for key, value in overrides.items():
        node = config
        *path, leaf = key.split(".")
        for p in path:
            node = node[p]
        node[leaf] = value
    return config


def lm_smoke_config(**overrides):
    """``configs/lm_tiny.py:goat,smoke`` without the progress bar, with dotted overrides."""
    config = lm_tiny.get_config("goat,smoke")
    config.progress_bar = False
    return set_fields(config, **overrides)
