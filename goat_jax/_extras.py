"""Which optional extra installs which import, and the one-line error when one is missing.

``pip install goat-jax`` installs the layer's dependencies only (jax, flax, numpy); the
training engine, the input pipelines, the evaluations and the integrations need an extra
(``pyproject.toml``, ``[project.optional-dependencies]``; docs/ecosystem.md has the table). A
module that needs one imports its optional packages under :func:`imports`::

    with _extras.imports(__name__):
        import optax

and a user without the extra reads one line naming the module, the missing package and the
command that installs it, instead of a bare ``No module named 'optax'`` deep in a traceback.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

# Top-level import name -> the extra whose install provides it. Several extras pull in some of
# the same packages; each name maps to the smallest extra that has it.
EXTRA_OF_MODULE = {
    "optax": "train", "orbax": "train", "etils": "train", "ml_collections": "train",
    "absl": "train", "grain": "train", "tensorboardX": "train", "tqdm": "train",
    "tensorflow_datasets": "data", "array_record": "data", "sentencepiece": "data",
    "tiktoken": "data", "pyarrow": "data", "PIL": "data",
    "pyfaidx": "dna", "Bio": "dna",
    "matplotlib": "eval", "lm_eval": "eval",
    "wandb": "wandb",
    "torch": "test", "goat": "test",
}


class MissingExtraError(ModuleNotFoundError):
    """An optional package is not installed; the message names the extra that installs it."""


def install_hint(extra: str) -> str:
    """The command that installs ``extra``, e.g. ``pip install 'goat-jax[train]'``."""
    return f"pip install 'goat-jax[{extra}]'"


def missing_message(module: str, package: str) -> str:
    """The one-line message for ``module`` failing to import the top-level ``package``."""
    extra = EXTRA_OF_MODULE.get(package)
    if extra is None:
        return f"{module} needs {package!r}, which is not installed."
    return (f"{module} needs {package!r}, which is not installed; it comes with the '{extra}' "
            f"extra: {install_hint(extra)}")


@contextlib.contextmanager
def imports(module: str) -> Iterator[None]:
    """Turns a ``ModuleNotFoundError`` of an optional package imported inside the block into a
    :class:`MissingExtraError` whose one-line message names ``module`` (the importing module,
    usually ``__name__``) and the extra. Errors of other modules pass unchanged, so a broken
    install or a typo is not disguised as a missing extra."""
    try:
        yield
    except MissingExtraError:
        raise
    except ModuleNotFoundError as e:
        package = (e.name or "").split(".")[0]
        if package not in EXTRA_OF_MODULE:
            raise
        raise MissingExtraError(missing_message(module, package), name=e.name) from None
