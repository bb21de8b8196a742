"""Opening a TFDS dataset for random access, one way for every pipeline that reads TFDS
(documents for the LM, images for the ViT): ``tfds.data_source`` over a dataset already
prepared as array_record, never downloading or preparing it as a side effect of starting a
run, and a dataset that is missing or not prepared is one clear error naming the config
fields and the fix instead of a TFDS traceback."""

from __future__ import annotations

from typing import Any

from goat_jax import _extras


def open_data_source(name: str, split: str, data_dir: str, *, name_field: str, split_field: str,
                     dir_field: str) -> Any:
    """``tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)``.

    The ``*_field`` arguments are the config fields these values came from (e.g.
    ``'data.tfds_name'``), named in the error. Raises ValueError when the dataset, its split or
    its array_record files cannot be opened (TFDS raises many exception types for these; all
    mean "not found or not prepared"), with the first line of TFDS's reason and the command
    that prepares the data.
    """
    with _extras.imports(__name__):
        import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  # only TFDS sources need it
    try:
        # download=False: preparing C4- or ImageNet-sized data is a separate, offline job.
        return tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
    except Exception as e:  # pylint: disable=broad-except  # any failure here means: not available
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise ValueError(
            f"{name_field}={name!r} split {split_field}={split!r} could not be opened from "
            f"{dir_field}={data_dir!r} ({'the TFDS default directory' if not data_dir else 'that directory'}; "
            f"{reason}). Prepare it as array_record (`tfds build {name} --file_format=array_record"
            f"{' --data_dir ' + data_dir if data_dir else ''}`) or fix these fields.") from e
