"""The image-classification pipeline: records -> host shard -> shuffle -> augment -> batches.

    source (TFDS array_record | JPEG folder | Fashion-MNIST IDX files)
      -> this host's shard (fixed, disjoint) -> per-epoch shuffle, repeated
      -> decode + per-example train transforms (goat_jax.data.image_transforms)
      -> local batch -> Mixup / CutMix + smoothed targets

Entry point: ``make_image_datasets(data_config, global_batch_size=, seed=)`` returns
``(train_iter, make_eval_iter, info)``; batches are dicts of NumPy arrays with b =
global_batch_size // process_count examples per host:

    image    float32 [b, r, r, Ch]  normalized pixels (r = data.image_size for training)
    label    int32   [b]            class index (top-1; in training, before mixing)
    targets  float32 [b, K]         the class distribution the loss fits: mixed and smoothed
                                    in training, one-hot in evaluation
    weights  float32 [b]            1 for real images, 0 for eval padding

* Every random choice (shuffle, crop, RandAugment, erasing, Mixup/CutMix) comes from grain's
  per-index generators seeded by ``seed``, so the stream is a pure function of (config, seed,
  process layout): ``train_iter.get_state()`` is ``{'next_index': n}`` and ``set_state`` on a
  freshly built iterator continues with exactly the batches the uninterrupted one would give.
* ``make_eval_iter(resolution=None)`` returns a fresh finite iterator over this host's shard of
  the eval split at ``resolution`` (default ``data.image_size``): resize the shorter side to
  ``resolution / data.eval_crop_fraction``, centre crop. All hosts yield the same number of
  batches (padded with weight-0 images).
* ``info``: ``ImageInfo(num_classes, channels, num_train, num_eval)``.

Sources (``data.source``):
  'tfds'           ``tfds.data_source(data.tfds_name)`` over a dataset already prepared as
                   array_record in ``data.tfds_data_dir`` (e.g. ``imagenet2012``: preparing it
                   from the ILSVRC tars needs TensorFlow, reading it does not)
  'folder'         ``data.folder/train/<class>/*`` and ``data.folder/val/<class>/*`` images
                   (.jpeg/.jpg/.png, any case), classes = sorted names of the train subfolders
  'fashion_mnist'  the IDX files of Debian's ``dataset-fashion-mnist`` in ``data.folder``
Decoding converts every image to ``data.channels`` (3: 'RGB', 1: 'L') -- ImageNet holds a few
grayscale and CMYK JPEGs. A file that cannot be decoded raises an error naming it.
"""

from __future__ import annotations

import gzip
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from goat_jax import _extras
with _extras.imports(__name__):  # optional packages: one-line error naming the extra
    import grain
    import ml_collections
    from PIL import Image

from goat_jax.data import hosts
from goat_jax.data import tfds_source
from goat_jax.data import image_transforms as T
from goat_jax.config.fields import Bool, Float, Floats, Int, Section, Str, check_section

Batch = dict[str, np.ndarray]
SOURCES = ("tfds", "folder", "fashion_mnist")
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian package dataset-fashion-mnist
FASHION_MNIST_MEAN, FASHION_MNIST_STD = (0.2860,), (0.3530,)  # over the 60k training images
_IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")


# Every field of the ``data`` section, declared once: default (the official ViT / DeiT
# ImageNet-1k recipe), type, range or choices, doc. The engine checks FIELD_SPECS before any
# work; the tuples' lengths and the cross-field rules are checked by make_image_datasets.
DATA = Section(
    source=("tfds", Str(choices=SOURCES)),
    tfds_name=("imagenet2012", Str(nonempty=True, doc="TFDS name, prepared as array_record in tfds_data_dir")),
    tfds_data_dir=("", Str(doc="'' = the TFDS default (~/tensorflow_datasets)")),
    tfds_train_split=("train", Str(nonempty=True, doc="TFDS split for training")),
    tfds_eval_split=("validation", Str(nonempty=True, doc="TFDS split for evaluation")),
    folder=("", Str(doc="'folder': root with train/ and val/; 'fashion_mnist': the IDX directory")),
    channels=(3, Int(choices=(1, 3), doc="1 grayscale, 3 RGB; images are converted on decode")),
    image_size=(224, Int(min=1, doc="training resolution")),
    eval_crop_fraction=(224 / 256, Float(min=0.0, max=1.0, min_inclusive=False,
                                         doc="eval: shorter side to r / this, centre crop r")),
    mean=(T.IMAGENET_MEAN, Floats(nonempty=True, doc="per-channel normalization mean (0-1 pixel scale)")),
    std=(T.IMAGENET_STD, Floats(nonempty=True, doc="per-channel normalization std")),
    crop_scale=((0.08, 1.0), Floats(doc="RandomResizedCrop area range (min, max); () = plain resize to image_size")),
    hflip=(True, Bool(doc="random horizontal flip (p 0.5)")),
    randaugment_ops=(2, Int(min=0, doc="RandAugment ops per image; 0 disables")),
    randaugment_magnitude=(9, Int(min=0, max=30, doc="RandAugment magnitude bin (of 31)")),
    random_erasing=(0.25, Float(min=0.0, max=1.0, doc="probability of one random-erasing box (timm 'pixel' mode)")),
    mixup_alpha=(0.8, Float(min=0.0, doc="Mixup Beta(alpha, alpha); 0 disables")),
    cutmix_alpha=(1.0, Float(min=0.0, doc="CutMix Beta(alpha, alpha); 0 disables")),
    mixup_switch_prob=(0.5, Float(min=0.0, max=1.0, doc="probability of CutMix when both are enabled")),
    label_smoothing=(0.1, Float(min=0.0, max=1.0, max_inclusive=False, doc="smoothing of the one-hot targets")),
    num_eval_batches=(0, Int(doc="eval batches per make_eval_iter call; <= 0: the whole split")),
    read_threads=(8, Int(min=0, doc="threads decoding and augmenting ahead of the trainer")),
)
FIELD_SPECS = DATA.specs


def default_data_config() -> ml_collections.ConfigDict:
    """ImageNet-1k with the official ViT (DeiT-style) training recipe."""
    return DATA.defaults()


def fashion_mnist_config() -> ml_collections.ConfigDict:
    """Fashion-MNIST at 28 px, grayscale, light augmentation (flip only: 60k small images)."""
    c = default_data_config()
    c.update(source="fashion_mnist", folder=FASHION_MNIST_DIR, channels=1, image_size=28, eval_crop_fraction=1.0,
             mean=FASHION_MNIST_MEAN, std=FASHION_MNIST_STD, crop_scale=(), randaugment_ops=0,
             random_erasing=0.0, mixup_alpha=0.0, cutmix_alpha=0.0, label_smoothing=0.1, read_threads=2)
    return c


class ImageInfo(NamedTuple):
    """What the model and the trainer need to know about the data."""

    num_classes: int
    channels: int
    num_train: int
    num_eval: int


# ----------------------------------------------------------------------------------------------
# Sources: sequences of (image loader input, label)
# ----------------------------------------------------------------------------------------------


def _mode(channels: int) -> str:
    if channels not in (1, 3):
        raise ValueError(f"data.channels={channels} must be 1 (grayscale) or 3 (RGB).")
    return "L" if channels == 1 else "RGB"


def decode_image(path: str, channels: int) -> Image.Image:
    """Opens an image file as 'RGB' (channels 3) or 'L' (1); raises ValueError naming the file
    if it cannot be decoded."""
    try:
        with Image.open(path) as img:
            return img.convert(_mode(channels))
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"Cannot decode image file {path!r} ({type(e).__name__}: {e}); remove or "
                         "replace it.") from e


def list_image_folder(split_dir: str, classes: Sequence[str] | None = None) -> tuple[list[tuple[str, int]], list[str]]:
    """``split_dir/<class>/*.{jpeg,jpg,png}`` -> ``([(path, label)], classes)``.

    Classes are the sorted subfolder names, or the given ``classes`` (the train split's, so
    labels agree); a subfolder not among them, a folder without classes or a class without
    images raises ValueError naming it.
    """
    if not os.path.isdir(split_dir):
        raise ValueError(f"Image folder {split_dir!r} does not exist (expected <root>/train/<class>/*.JPEG "
                         "and <root>/val/<class>/*).")
    found = sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
    if not found:
        raise ValueError(f"Image folder {split_dir!r} has no class subfolders; expected "
                         f"{split_dir}/<class>/<image>.JPEG.")
    if classes is None:
        classes = found
    index = {name: i for i, name in enumerate(classes)}
    unknown = sorted(set(found) - set(index))
    if unknown:
        raise ValueError(f"{split_dir!r} has class folders not in the training split: {unknown[:5]}.")
    records = []
    for name in found:
        folder = os.path.join(split_dir, name)
        files = sorted(f for f in os.listdir(folder) if f.lower().endswith(_IMAGE_SUFFIXES))
        if not files:
            raise ValueError(f"Class folder {folder!r} has no images ({'/'.join(_IMAGE_SUFFIXES)}).")
        records += [(os.path.join(folder, f), index[name]) for f in files]
    return records, list(classes)


def read_idx(path: str) -> np.ndarray:
    """Reads an IDX file (MNIST format, optionally gzipped) into a NumPy array."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path!r} is not an unsigned-byte IDX file (bad magic {data[:4]!r}).")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    body = np.frombuffer(data, np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path!r}: header says {shape} but holds {body.size} bytes.")
    return body.reshape(shape)


class _ArraySource:
    """In-memory images [N, R, C] uint8 and labels [N], as a random-access source."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], int(self.labels[i])


class _TfdsSource:
    """A ``tfds.data_source`` split as ``(image array [R, C, Ch] uint8, label)`` records."""

    def __init__(self, source):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int):
        record = self.source[i]
        return record["image"], int(record["label"])


def _warn_missing_classes(split_dir: str, classes: Sequence[str], present: set) -> None:
    """A loud warning (not an error: a held-out subset of some classes still gives a valid
    top-1 over them, and quick checks on part of ImageNet val are common) when the validation
    split lacks classes that training has: its top-1 then says nothing about those classes."""
    missing = [c for i, c in enumerate(classes) if i not in present]
    if missing:
        logging.warning("%s has no folder for %d of the %d training classes (%s%s): eval top-1 "
                        "covers only the other %d. Add them, or ignore this if the subset is on "
                        "purpose.", split_dir, len(missing), len(classes), ", ".join(missing[:10]),
                        ", ..." if len(missing) > 10 else "", len(classes) - len(missing))


def _load_splits(cfg: ml_collections.ConfigDict):
    """(train source, eval source, num_classes); sources give (path or array, label)."""
    if cfg.source == "folder":
        if not cfg.folder:
            raise ValueError("data.source='folder' needs data.folder (the root holding train/ and val/).")
        train, classes = list_image_folder(os.path.join(cfg.folder, "train"))
        val, _ = list_image_folder(os.path.join(cfg.folder, "val"), classes)
        _warn_missing_classes(os.path.join(cfg.folder, "val"), classes, {label for _, label in val})
        return train, val, len(classes)
    if cfg.source == "fashion_mnist":
        if cfg.channels != 1:
            raise ValueError(f"Fashion-MNIST is grayscale (1 channel) but data.channels={cfg.channels}; "
                             "set data.channels=1 (and model.channels=1).")
        splits = []
        for prefix in ("train", "t10k"):
            paths = [os.path.join(cfg.folder, f"{prefix}-{kind}-ubyte.gz") for kind in ("images-idx3", "labels-idx1")]
            missing = [p for p in paths if not os.path.exists(p)]
            if missing:
                raise ValueError(f"Fashion-MNIST file(s) {missing} not found: install the Debian package "
                                 f"dataset-fashion-mnist or set data.folder (default {FASHION_MNIST_DIR}).")
            splits.append(_ArraySource(read_idx(paths[0]), read_idx(paths[1])))
        return splits[0], splits[1], 10
    train, val = (tfds_source.open_data_source(cfg.tfds_name, split, cfg.tfds_data_dir, name_field="data.tfds_name",
                                               split_field=f"data.{field}", dir_field="data.tfds_data_dir")
                  for split, field in ((cfg.tfds_train_split, "tfds_train_split"),
                                       (cfg.tfds_eval_split, "tfds_eval_split")))
    num_classes = train.dataset_info.features["label"].num_classes
    return _TfdsSource(train), _TfdsSource(val), int(num_classes)


# Tiny images (e.g. a 1x1 placeholder saved by a broken download) are upscaled, with a warning
# naming the file, rather than refused: files are opened only when read, so refusing one would
# stop a long run at an arbitrary step for a single example. Warned: the first few per process.
_TINY_WARNINGS = {"left": 10}


def _warn_if_tiny(img: Image.Image, item: Any, image_size: int) -> None:
    """Warns when ``img`` is upscaled more than 2x to reach ``image_size`` (data.image_size)."""
    side = min(img.size)
    if side * 2 >= image_size or _TINY_WARNINGS["left"] <= 0:
        return
    _TINY_WARNINGS["left"] -= 1
    what = item if isinstance(item, str) else f"an image of the source ({np.asarray(item).shape})"
    more = "" if _TINY_WARNINGS["left"] else " (further tiny images are not named)"
    logging.warning("%s is %dx%d px, upscaled more than 2x to data.image_size=%d: a placeholder "
                    "or a damaged file? Remove or replace it if so.%s", what, img.size[0],
                    img.size[1], image_size, more)


def _to_image(item: Any, channels: int, image_size: int | None = None) -> Image.Image:
    """A source item (file path, or a decoded uint8 array) as a PIL image of ``channels``;
    warns if it is tiny next to ``image_size`` (:func:`_warn_if_tiny`)."""
    if isinstance(item, str):
        img = decode_image(item, channels)
    else:
        arr = np.asarray(item)
        if arr.ndim == 3 and arr.shape[-1] == 1:
            arr = arr[..., 0]
        img = Image.fromarray(arr).convert(_mode(channels))
    if image_size:
        _warn_if_tiny(img, item, image_size)
    return img


# ----------------------------------------------------------------------------------------------
# Transforms as record -> example functions
# ----------------------------------------------------------------------------------------------


def train_example(record: tuple[Any, int], rng: np.random.Generator, cfg: ml_collections.ConfigDict) -> Batch:
    """One training example: crop (or resize), flip, RandAugment, normalize, random erasing."""
    img = _to_image(record[0], cfg.channels, cfg.image_size)
    if cfg.crop_scale:
        img = T.random_resized_crop(img, cfg.image_size, rng, scale=tuple(cfg.crop_scale))
    elif img.size != (cfg.image_size, cfg.image_size):
        img = img.resize((cfg.image_size, cfg.image_size), Image.BICUBIC)
    if cfg.hflip:
        img = T.random_flip(img, rng)
    if cfg.randaugment_ops:
        img = T.rand_augment(img, rng, cfg.randaugment_ops, cfg.randaugment_magnitude)
    x = T.to_normalized_array(img, cfg.mean, cfg.std)
    if cfg.random_erasing:
        x = T.random_erasing(x, rng, cfg.random_erasing)
    return {"image": x, "label": np.int32(record[1])}


def eval_example(record: tuple[Any, int], cfg: ml_collections.ConfigDict, resolution: int,
                 num_classes: int) -> Batch:
    """One evaluation example at ``resolution`` (resize + centre crop, normalize), one-hot
    target, weight 1."""
    img = T.eval_resize_crop(_to_image(record[0], cfg.channels, cfg.image_size), resolution,
                             cfg.eval_crop_fraction)
    return {"image": T.to_normalized_array(img, cfg.mean, cfg.std), "label": np.int32(record[1]),
            "targets": T.smooth_one_hot(np.asarray([record[1]]), num_classes, 0.0)[0],
            "weights": np.float32(1.0)}


def _stack(examples: Sequence[Batch]) -> Batch:
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def _check_config(cfg: ml_collections.ConfigDict) -> None:
    """Each field's type and range (:data:`FIELD_SPECS`, also when called outside the engine),
    then the tuples and the cross-field rules."""
    check_section(cfg, FIELD_SPECS, "data")
    if len(cfg.mean) != cfg.channels or len(cfg.std) != cfg.channels:
        raise ValueError(f"data.mean/data.std have {len(cfg.mean)}/{len(cfg.std)} entries for "
                         f"data.channels={cfg.channels}; give one per channel.")
    if cfg.crop_scale and not (len(cfg.crop_scale) == 2 and 0 < cfg.crop_scale[0] <= cfg.crop_scale[1] <= 1):
        raise ValueError(f"data.crop_scale={cfg.crop_scale} must be (min, max) with 0 < min <= max <= 1, or ().")


def _hashed(seed: int, stream: int) -> int:
    """Independent per-stream seeds: seeds s and s + 1 do not replay each other's streams."""
    return int(np.random.SeedSequence([seed, stream]).generate_state(1)[0])


def make_image_datasets(
    data_config: ml_collections.ConfigDict,
    *,
    global_batch_size: int,
    seed: int,
    process_index: int | None = None,
    process_count: int | None = None,
) -> tuple[grain.DatasetIterator, Callable[..., Iterator[Batch]], ImageInfo]:
    """Builds the training iterator, the eval-iterator factory and :class:`ImageInfo`.

    See the module docstring for the batch format, the state and the sources.

    Args:
      data_config: ``default_data_config()`` / ``fashion_mnist_config()`` and overrides.
      global_batch_size: examples per step over all processes.
      seed: in [0, 2**32); the eval stream does not depend on it.
      process_index / process_count: default ``jax.process_index()`` / ``jax.process_count()``.
    """
    cfg = data_config
    process_index, process_count, local_batch = hosts.host_split(
        global_batch_size, seed, process_index, process_count)
    _check_config(cfg)
    train_src, eval_src, num_classes = _load_splits(cfg)
    if len(train_src) < process_count:
        raise ValueError(f"The training split has {len(train_src)} images for {process_count} hosts.")
    info = ImageInfo(num_classes, cfg.channels, len(train_src), len(eval_src))

    def mix(batch: Batch, rng: np.random.Generator) -> Batch:
        images, targets = T.mixup_cutmix(
            batch["image"], batch["label"], rng, num_classes=num_classes, mixup_alpha=cfg.mixup_alpha,
            cutmix_alpha=cfg.cutmix_alpha, switch_prob=cfg.mixup_switch_prob, smoothing=cfg.label_smoothing)
        return {"image": images, "label": batch["label"], "targets": targets,
                "weights": np.ones(len(targets), np.float32)}

    # Shard before shuffling: each host's images are fixed across epochs and disjoint.
    train = (grain.MapDataset.source(train_src)[process_index::process_count]
             .shuffle(_hashed(seed, 0)).repeat()
             .random_map(lambda r, rng: train_example(r, rng, cfg), seed=_hashed(seed, 1))
             .batch(local_batch, drop_remainder=True, batch_fn=_stack)
             .random_map(mix, seed=_hashed(seed, 2)))
    train_iter = iter(train.to_iter_dataset(grain.ReadOptions(num_threads=cfg.read_threads,
                                                               prefetch_buffer_size=4 * local_batch)))

    shard = grain.MapDataset.source(eval_src)[process_index::process_count]
    # Every host runs as many batches as the largest shard needs, so collectives stay in step.
    whole = math.ceil(math.ceil(len(eval_src) / process_count) / local_batch)
    num_batches = whole if cfg.num_eval_batches <= 0 else cfg.num_eval_batches

    def make_eval_iter(resolution: int | None = None) -> Iterator[Batch]:
        r = cfg.image_size if resolution is None else int(resolution)
        if r < 1:
            raise ValueError(f"eval resolution={resolution} must be positive.")
        examples = iter(shard.map(lambda rec: eval_example(rec, cfg, r, num_classes)).to_iter_dataset(
            grain.ReadOptions(num_threads=cfg.read_threads)))
        pad = {"image": np.zeros((r, r, cfg.channels), np.float32), "label": np.int32(0),
               "targets": np.zeros(num_classes, np.float32), "weights": np.float32(0)}
        for _ in range(num_batches):
            yield _stack([next(examples, pad) for _ in range(local_batch)])

    return train_iter, make_eval_iter, info
