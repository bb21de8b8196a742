"""Whole-file writes: the one way goat_jax replaces a file that a reader, a resumed run or a
later report relies on (a run's config.json and trimmed metrics, TensorBoard event files, the
W&B run id, a trained tokenizer, the report harness's caches and reports). Imports nothing
from goat_jax, so every layer (data, train, reproduce) can use it."""

from __future__ import annotations

import os
from typing import Union


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
