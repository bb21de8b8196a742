"""``config.wandb``: Weights & Biases logging of a training run (the ``[wandb]`` extra).

    c.wandb = wandb_logger.default_config()   # mode 'disabled': off
    --config.wandb.mode=online --config.wandb.project=goat --config.wandb.name=tiny_goat

Fields: ``project``, ``name`` (default: the workdir's name), ``entity`` (default: the user's
default), ``mode`` ('disabled' | 'online' | 'offline'). When on, the primary process logs
every row that ``metrics.jsonl`` gets (train and eval rows, at their step) and the resolved
config. The W&B run id is stored in ``WORKDIR/wandb_run_id``, so a resumed training continues
the same W&B run (``resume='allow'``); rows the resumed run logs again are ones W&B already
has (it drops steps it has seen). Files go to ``$WANDB_DIR`` if set, else to ``WORKDIR/wandb``.
``offline`` runs are uploaded later with ``wandb sync WORKDIR/wandb/offline-run-*``.
"""

from __future__ import annotations

import os
import secrets
import string
from typing import Any, Callable, Dict, Optional

from goat_jax import _extras, files

MODES = ("disabled", "online", "offline")
RUN_ID_FILE = "wandb_run_id"


def default_config():
    """The ``config.wandb`` section with W&B off (``mode='disabled'``)."""
    import ml_collections  # pylint: disable=g-import-not-at-top  # configs have it already
    from ml_collections import config_dict  # pylint: disable=g-import-not-at-top
    c = ml_collections.ConfigDict()
    c.project = config_dict.placeholder(str)  # W&B project (None: W&B's default)
    c.name = config_dict.placeholder(str)  # run name (None: the workdir's name)
    c.entity = config_dict.placeholder(str)  # user or team (None: the login's default)
    c.mode = "disabled"  # 'disabled' (off) | 'online' | 'offline'
    return c


def require() -> None:
    """Raises the one-line missing-extra error unless ``wandb`` is importable."""
    with _extras.imports(__name__):
        import wandb  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import


def enabled(wandb_config: Optional[Any]) -> bool:
    """Whether ``config.wandb`` asks for logging."""
    return wandb_config is not None and wandb_config.get("mode", "disabled") != "disabled"


def check_config(wandb_config: Optional[Any]) -> None:
    """ValueError (one line, before any work) if W&B is asked for but not installed."""
    if not enabled(wandb_config):
        return
    try:
        require()
    except _extras.MissingExtraError as e:
        raise ValueError(f"wandb.mode={wandb_config.mode!r}: {e} (or set "
                         "--config.wandb.mode=disabled).") from None


def run_id_path(workdir: str) -> str:
    """``WORKDIR/wandb_run_id``: the W&B run this workdir logs to."""
    return os.path.join(workdir, RUN_ID_FILE)


class WandbLogger:
    """One W&B run per workdir; a no-op when disabled or on a non-primary process.

    Args:
      wandb_config: ``config.wandb`` (or None).
      config_dict: the resolved config, logged as the run's config.
      workdir: the run directory (the run id is kept there).
      primary: False on non-primary processes (they log nothing).
    """

    def __init__(self, wandb_config: Optional[Any], config_dict: Dict[str, Any], workdir: str,
                 primary: bool = True):
        self.run = None
        if not (primary and enabled(wandb_config)):
            return
        with _extras.imports(__name__):
            import wandb  # pylint: disable=g-import-not-at-top
        path = run_id_path(workdir)
        if os.path.exists(path):
            with open(path) as f:
                run_id = f.read().strip()
        else:
            # W&B's id format: 8 lowercase letters and digits.
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
            files.write_whole(path, run_id + "\n")
        directory = os.environ.get("WANDB_DIR") or os.path.join(workdir, "wandb")
        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(
            project=wandb_config.get("project"), entity=wandb_config.get("entity"),
            name=wandb_config.get("name") or os.path.basename(os.path.normpath(workdir)),
            mode=wandb_config.mode, id=run_id, resume="allow", dir=directory, config=config_dict)

    @property
    def sink(self) -> Optional[Callable[[Dict[str, Any]], None]]:
        """``row -> None`` for :class:`goat_jax.train.metrics.MetricsWriter` (None when off)."""
        return self.log if self.run is not None else None

    def log(self, row: Dict[str, Any]) -> None:
        """Logs one ``metrics.jsonl`` row (its numbers) at its ``step``."""
        if self.run is None:
            return
        values = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))
                  and not isinstance(v, bool)}
        self.run.log(values, step=int(row["step"]))

    def finish(self) -> None:
        """Closes the W&B run (flushes offline files)."""
        if self.run is not None:
            self.run.finish()
            self.run = None
