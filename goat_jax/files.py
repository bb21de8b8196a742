"""Whole-file writes: the one way goat_jax replaces a file that a reader, a resumed run or a
later report relies on (a run's config.json and trimmed metrics, TensorBoard event files, the
W&B run id, a trained tokenizer, the report harness's caches and reports). Imports nothing
from goat_jax, so every layer (data, train, reproduce) can use it."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Union


def write_whole(path: str, data: Union[str, bytes]) -> None:
    """Writes ``data`` (text, or bytes for a binary file) to a temporary file beside ``path``,
    then renames it over ``path``: a kill mid-write leaves the previous file or none, never
    half of one, and a reader of a live run never sees a partial file. If the write itself
    fails (a full disk), the temporary file is removed and the error raised; ``path`` is
    untouched."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_json_object(path: str) -> Dict[str, Any]:
    """The JSON object in the file ``path`` (a cache, a record, a report's results). A file that
    is not one raises ValueError: ``json.JSONDecodeError`` or ``UnicodeDecodeError`` as JSON
    reading raises them, or "a JSON list, not an object" for another JSON value; a missing file
    raises the OSError of ``open``. The callers say what an unreadable file means for them."""
    with open(path, encoding="utf-8") as f:
        value = json.load(f)
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    return value


def check_writable(path: str, flag: str) -> None:
    """Refuses, before any work, a directory ``path`` that cannot be written: an existing path
    that is not a directory, or a nearest existing folder (``path`` itself or the parent it
    would be created in) where a file cannot be created. Tested by creating and removing a
    temporary file there (permission bits say nothing for root or a read-only mount); leaves
    nothing behind. ``flag``: the command-line flag named in the error (e.g. ``'--out'``).

    Raises:
      ValueError: naming ``flag``, ``path`` and why.
    """
    import tempfile  # pylint: disable=g-import-not-at-top  # on use only

    full = os.path.abspath(path)
    existing = full
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{flag} {path}: {existing} exists and is not a directory; give a directory "
                         "(it is created if missing).")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".goat-write-check-")
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write in {existing} ({e.strerror or e}); give a writable "
                         "directory.") from None
    os.close(fd)
    os.remove(probe)
