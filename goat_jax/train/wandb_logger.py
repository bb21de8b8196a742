"""``config.wandb``: Weights & Biases logging of a training run (the ``[wandb]`` extra).

    --config.wandb.mode=online --config.wandb.project=goat --config.wandb.name=tiny_goat

Fields (declared here, :data:`FIELDS`, a section of the engine's schema in
goat_jax/train/validation.py; a config leaves the section out for W&B off): ``project``,
``name`` (default: the workdir's name), ``entity`` (default: the user's default), ``mode``
('disabled' | 'online' | 'offline'). When on, the primary process logs
every row that ``metrics.jsonl`` gets (train and eval rows, at their step) and the resolved
config. The W&B run id is stored in ``WORKDIR/wandb_run_id``, so a resumed training continues
the same W&B run (``resume='allow'``); rows the resumed run logs again are ones W&B already
has (it drops steps it has seen). Files go to ``WORKDIR/wandb`` (``$WANDB_DIR/wandb`` if
``$WANDB_DIR`` is set). ``offline`` runs are uploaded later with
``wandb sync WORKDIR/wandb/offline-run-*``.

``online`` is checked before the trainer creates anything (:func:`preflight`): without W&B
credentials, or with the W&B server unreachable within a few seconds, the run is refused with one
line naming the cause and the fix (``--config.wandb.mode=offline``, then ``wandb sync``), instead
of wandb's own traceback a minute and a half later. A ``wandb.init`` that fails anyway is one line
too, and no run id is written for it.
"""

from __future__ import annotations

import os
import re
import secrets
import ssl
import string
import urllib.error
import urllib.request
from typing import Any, Callable, Dict, Optional

from goat_jax import _extras, files
from goat_jax.config.fields import RESUME_SAFE, Section, Str

MODES = ("disabled", "online", "offline")
# The ``wandb`` section of every run's config, declared once (the engine's schema includes it:
# goat_jax/train/validation.py); the code below reads its defaults from here.
# Logging changes nothing computed: every field may change on resume.
FIELDS = Section(
    project=(None, Str(optional=True, resume=RESUME_SAFE, doc="W&B project; None: W&B's default")),
    name=(None, Str(optional=True, resume=RESUME_SAFE, doc="run name; None: the workdir's name")),
    entity=(None, Str(optional=True, resume=RESUME_SAFE, doc="user or team; None: the login's default")),
    mode=("disabled", Str(choices=MODES, resume=RESUME_SAFE, doc="'disabled' = off")),
)
RUN_ID_FILE = "wandb_run_id"
# How long :func:`preflight` waits for the W&B server to answer before refusing an online run.
REACH_TIMEOUT_S = 5.0
_OFFLINE_FIX = ("or train without network with --config.wandb.mode=offline and upload later with "
                "`wandb sync WORKDIR/wandb/offline-run-*`")


def require() -> None:
    """Raises the one-line missing-extra error unless ``wandb`` is importable."""
    with _extras.imports(__name__):
        import wandb  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import


def enabled(wandb_config: Optional[Any]) -> bool:
    """Whether ``config.wandb`` asks for logging."""
    return wandb_config is not None and FIELDS.value(wandb_config, "mode") != "disabled"


def check_config(wandb_config: Optional[Any]) -> None:
    """ValueError (one line, before any work) if W&B is asked for but not installed."""
    if not enabled(wandb_config):
        return
    try:
        require()
    except _extras.MissingExtraError as e:
        raise ValueError(f"wandb.mode={wandb_config.mode!r}: {e} (or set "
                         "--config.wandb.mode=disabled).") from None


def _one_line(error: BaseException) -> str:
    return re.sub(r"\s+", " ", str(error) or type(error).__name__).strip()


def _has_credentials(base_url: str) -> Optional[bool]:
    """Whether wandb finds credentials for ``base_url`` (``WANDB_API_KEY``, ``~/.netrc`` from
    ``wandb login``, its settings) without prompting; None where this wandb version's lookup is
    not the one known here (then ``wandb.init`` decides). Raises ValueError for a key wandb
    finds but refuses (e.g. a malformed ``WANDB_API_KEY``)."""
    try:
        import wandb.errors  # pylint: disable=g-import-not-at-top
        from wandb.sdk.lib.wbauth import authenticate  # pylint: disable=g-import-not-at-top
    except ImportError:
        return None
    try:
        auth = authenticate.authenticate_session(host=base_url, source="goat_jax", prompt=False,
                                                 update_session=False)
    except wandb.errors.AuthenticationError as e:
        raise ValueError(f"config.wandb.mode='online': wandb refuses the W&B credentials for "
                         f"{base_url}: {_one_line(e)}. Fix WANDB_API_KEY or run `wandb login`, "
                         f"{_OFFLINE_FIX}.") from None
    except (TypeError, AttributeError):  # another wandb version's internals
        return None
    return auth is not None


def _unreachable(base_url: str, timeout: float) -> Optional[str]:
    """Why the W&B server at ``base_url`` does not answer within ``timeout`` seconds (None when
    it answers: any HTTP status, or a TLS handshake this Python cannot verify, counts). Proxies
    in the environment (``HTTPS_PROXY``) are used as wandb uses them."""
    try:
        with urllib.request.urlopen(urllib.request.Request(base_url, method="HEAD"),
                                    timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except urllib.error.URLError as e:
        if isinstance(e.reason, ssl.SSLError):
            return None  # reached; wandb may trust other certificates (REQUESTS_CA_BUNDLE)
        return _one_line(e.reason) if not isinstance(e.reason, str) else e.reason
    except ssl.SSLError:
        return None
    except (OSError, ValueError) as e:  # a timeout, a reset connection, a malformed URL
        return _one_line(e)


def _base_url() -> str:
    """The W&B server ``wandb.init`` would talk to: wandb's settings as it loads them
    (``WANDB_BASE_URL``, its settings files), else ``WANDB_BASE_URL``, else wandb's default."""
    import wandb  # pylint: disable=g-import-not-at-top
    try:
        from wandb.sdk import wandb_setup  # pylint: disable=g-import-not-at-top
        return str(wandb_setup.singleton().settings.base_url)
    except (ImportError, AttributeError):  # another wandb version's internals
        return os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url


def preflight(wandb_config: Optional[Any], timeout: float = REACH_TIMEOUT_S) -> None:
    """ValueError (one line, before the trainer creates anything) if ``mode='online'`` cannot
    work here: no W&B credentials, or the W&B server (``WANDB_BASE_URL``, else wandb's default)
    not answering within ``timeout`` seconds. Offline and disabled modes pass at once; run on the
    primary process only (the one that logs)."""
    if not enabled(wandb_config) or wandb_config.mode != "online":
        return
    require()
    base_url = _base_url()
    if _has_credentials(base_url) is False:
        raise ValueError(f"config.wandb.mode='online' needs W&B credentials for {base_url} and "
                         "none were found: set WANDB_API_KEY or run `wandb login`, "
                         f"{_OFFLINE_FIX}.")
    why = _unreachable(base_url, timeout)
    if why is not None:
        raise ValueError(f"config.wandb.mode='online' cannot reach the W&B server {base_url} "
                         f"within {timeout:g} s ({why}): check the network (or WANDB_BASE_URL, "
                         f"HTTPS_PROXY), {_OFFLINE_FIX}.")


def files_dir(workdir: str) -> str:
    """The directory passed to ``wandb.init(dir=...)``: ``$WANDB_DIR`` if set, else ``workdir``.
    wandb writes into its ``wandb/`` subdirectory, so runs land in ``WORKDIR/wandb/*-run-*``."""
    return os.environ.get("WANDB_DIR") or workdir


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
        new_id = not os.path.exists(path)
        if new_id:
            # W&B's id format: 8 lowercase letters and digits.
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                run_id = f.read().strip()
            if not re.fullmatch(r"[A-Za-z0-9_-]+", run_id):  # an empty id is wandb's "no id": a new run
                raise ValueError(f"{path} holds no W&B run id ({run_id[:40]!r}): this workdir's W&B run "
                                 "cannot be resumed from it. Restore the file (the id is in the W&B run's "
                                 "URL), or delete it to log to a new W&B run.")
        directory = files_dir(workdir)
        os.makedirs(directory, exist_ok=True)
        try:
            self.run = wandb.init(
                project=FIELDS.value(wandb_config, "project"), entity=FIELDS.value(wandb_config, "entity"),
                name=FIELDS.value(wandb_config, "name") or os.path.basename(os.path.normpath(workdir)),
                mode=wandb_config.mode, id=run_id, resume="allow", dir=directory,
                config=config_dict)
        except wandb.errors.Error as e:  # UsageError, CommError, AuthenticationError
            raise ValueError(f"config.wandb.mode={wandb_config.mode!r}: wandb.init failed: "
                             f"{_one_line(e).rstrip('.')}. Fix the W&B setup (`wandb login`, "
                             f"the network), {_OFFLINE_FIX}.") from None
        if new_id:  # only for a W&B run that exists
            files.write_whole(path, run_id + "\n")

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
