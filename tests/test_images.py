"""goat_jax.data.images and image_transforms: real Fashion-MNIST, a generated JPEG folder, a mock
TFDS imagenet2012, every transform, resume, host shards and bad input."""

import gzip
import os

import numpy as np
import pytest
from PIL import Image

from goat_jax.data import image_transforms as T
from goat_jax.data import images as I

NUM_CLASSES, PER_CLASS = 3, 6


def _plain(cfg):
    """No augmentation: images come out as decoded (resized), for identity checks."""
    cfg.update(crop_scale=(), hflip=False, randaugment_ops=0, random_erasing=0.0, mixup_alpha=0.0,
               cutmix_alpha=0.0, label_smoothing=0.0, read_threads=1)
    return cfg


@pytest.fixture(scope="module")
def jpeg_root(tmp_path_factory):
    """train/<class>/*.JPEG (+ one grayscale JPEG and one .png) and val/<class>/*; every image
    is a flat colour whose red value is a unique id, so pipelines can be checked by content."""
    root = tmp_path_factory.mktemp("imagenet_folder")
    gen = np.random.default_rng(0)
    uid = 0
    for split, n in (("train", PER_CLASS), ("val", 2)):
        for c in range(NUM_CLASSES):
            d = root / split / f"n0{c}"
            d.mkdir(parents=True)
            for i in range(n):
                uid += 1
                size = (int(gen.integers(20, 40)), int(gen.integers(20, 40)))
                img = Image.new("RGB", size, (4 * uid, 40 * c, 7))
                if split == "train" and i == 0 and c == 0:
                    img.convert("L").save(d / f"img{i}.JPEG", quality=100)  # grayscale JPEG
                elif split == "train" and i == 1:
                    img.save(d / f"img{i}.png")
                else:
                    img.save(d / f"img{i}.JPEG", quality=100)
    return str(root)


def _folder_cfg(root, **kw):
    cfg = I.default_data_config()
    cfg.update(source="folder", folder=root, image_size=16, read_threads=1, **kw)
    return cfg


def _red_ids(images, cfg):
    """The unique id (red / 4) of flat-colour images in a batch."""
    red = images[..., 0].mean(axis=(1, 2)) * cfg.std[0] + cfg.mean[0]
    return np.round(red * 255 / 4).astype(int)


# --- sources --------------------------------------------------------------------------------------


def test_fashion_mnist_from_debian_package():
    if not os.path.exists(os.path.join(I.FASHION_MNIST_DIR, "train-images-idx3-ubyte.gz")):
        pytest.skip("dataset-fashion-mnist is not installed")
    train, test, k = I._load_splits(I.fashion_mnist_config())
    assert (len(train), len(test), k) == (60_000, 10_000, 10)
    assert train.images.shape == (60_000, 28, 28) and train.images.dtype == np.uint8
    np.testing.assert_array_equal(np.bincount(train.labels), [6000] * 10)  # balanced, as published
    assert int(train.labels[0]) == 9  # the first training image is an ankle boot
    it, make_eval, info = I.make_image_datasets(I.fashion_mnist_config(), global_batch_size=4, seed=0)
    batch = next(it)
    assert batch["image"].shape == (4, 28, 28, 1) and batch["targets"].shape == (4, 10)
    ev = next(make_eval(56))
    assert ev["image"].shape == (4, 56, 56, 1)
    with pytest.raises(ValueError, match="grayscale .*data.channels=3"):
        I.make_image_datasets(_with(I.fashion_mnist_config(), channels=3, mean=(0, 0, 0), std=(1, 1, 1)),
                              global_batch_size=4, seed=0)


def _with(cfg, **kw):
    cfg.update(**kw)
    return cfg


def test_read_idx_matches_written_file(tmp_path, rng):
    data = rng.integers(0, 256, (3, 4, 5), dtype=np.uint8)
    header = bytes([0, 0, 8, 3]) + b"".join(int(d).to_bytes(4, "big") for d in data.shape)
    path = tmp_path / "x-idx3-ubyte.gz"
    with gzip.open(path, "wb") as f:
        f.write(header + data.tobytes())
    np.testing.assert_array_equal(I.read_idx(str(path)), data)
    (tmp_path / "bad").write_bytes(b"\x00\x00\x0d\x01\x00\x00\x00\x01x")
    with pytest.raises(ValueError, match="not an unsigned-byte IDX"):
        I.read_idx(str(tmp_path / "bad"))


def test_jpeg_folder_labels_and_eval_cover_everything(jpeg_root):
    cfg = _plain(_folder_cfg(jpeg_root))
    train, val, k = I._load_splits(cfg)
    assert k == NUM_CLASSES and len(train) == NUM_CLASSES * PER_CLASS and len(val) == NUM_CLASSES * 2
    _, make_eval, info = I.make_image_datasets(cfg, global_batch_size=4, seed=0)
    batches = list(make_eval())
    assert len(batches) == 2  # 6 images, batch 4: one full batch + one padded
    weights = np.concatenate([b["weights"] for b in batches])
    assert weights.sum() == 6 and weights.tolist() == [1] * 6 + [0] * 2
    for b in batches:
        real = b["weights"] > 0
        np.testing.assert_array_equal(b["targets"], np.eye(NUM_CLASSES)[b["label"]] * real[:, None])
        # green = 40 * class: the label is the folder's class index
        green = b["image"][real][..., 1].mean(axis=(1, 2)) * cfg.std[1] + cfg.mean[1]
        np.testing.assert_array_equal(np.round(green * 255 / 40).astype(int), b["label"][real])
        assert b["image"].shape == (4, 16, 16, 3)


def test_hosts_get_disjoint_shards_that_cover_the_data(jpeg_root):
    cfg = _plain(_folder_cfg(jpeg_root))
    n = NUM_CLASSES * PER_CLASS
    seen_train, seen_eval = [], []
    for host in range(2):
        it, make_eval, _ = I.make_image_datasets(cfg, global_batch_size=6, seed=3, process_index=host, process_count=2)
        epoch = np.concatenate([_red_ids(next(it)["image"], cfg) for _ in range(n // 2 // 3)])
        assert len(set(epoch)) == n // 2  # one epoch of this host's shard, no repeats
        seen_train.append(set(epoch))
        seen_eval.append({i for b in make_eval() for i, w in zip(_red_ids(b["image"], cfg), b["weights"]) if w})
    assert not seen_train[0] & seen_train[1] and len(seen_train[0] | seen_train[1]) == n
    assert not seen_eval[0] & seen_eval[1] and len(seen_eval[0] | seen_eval[1]) == NUM_CLASSES * 2


def test_training_stream_is_deterministic_and_resumes_exactly(jpeg_root):
    cfg = _folder_cfg(jpeg_root)  # the full recipe: crop, flip, RandAugment, erasing, mixing
    make = lambda seed: I.make_image_datasets(cfg, global_batch_size=4, seed=seed)[0]
    it = make(7)
    head = [next(it) for _ in range(5)]  # more than one epoch of 18 images
    state = it.get_state()
    tail = [next(it) for _ in range(3)]
    resumed = make(7)
    resumed.set_state(state)
    for want in tail:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    again = make(7)
    np.testing.assert_array_equal(next(again)["image"], head[0]["image"])
    assert not np.array_equal(next(make(8))["image"], head[0]["image"])
    b = head[0]
    assert b["image"].shape == (4, 16, 16, 3) and b["image"].dtype == np.float32
    np.testing.assert_allclose(b["targets"].sum(axis=1), 1.0, atol=1e-6)
    assert b["targets"].min() >= 0.1 / NUM_CLASSES - 1e-6  # label smoothing floor
    np.testing.assert_array_equal(b["weights"], np.ones(4, np.float32))


def test_mock_tfds_imagenet2012_data_source():
    tfds = pytest.importorskip("tensorflow_datasets")
    cfg = I.default_data_config()
    cfg.update(image_size=32, read_threads=1)
    with tfds.testing.mock_data(num_examples=12, policy=tfds.testing.MockPolicy.USE_CODE):
        it, make_eval, info = I.make_image_datasets(cfg, global_batch_size=4, seed=0)
        assert info.num_classes == 1000 and info.num_train == 12
        batch = next(it)
        state = it.get_state()
        nxt = next(it)
        assert batch["image"].shape == (4, 32, 32, 3) and batch["targets"].shape == (4, 1000)
        assert 0 <= batch["label"].min() and batch["label"].max() < 1000
        again = I.make_image_datasets(cfg, global_batch_size=4, seed=0)[0]
        again.set_state(state)
        np.testing.assert_array_equal(next(again)["image"], nxt["image"])
        ev = list(make_eval(48))
        assert len(ev) == 3 and ev[0]["image"].shape == (4, 48, 48, 3)


# --- bad input ------------------------------------------------------------------------------------


def test_bad_folders_and_files(tmp_path, jpeg_root):
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    with pytest.raises(ValueError, match="no class subfolders"):
        I.make_image_datasets(_folder_cfg(str(tmp_path)), global_batch_size=2, seed=0)
    (tmp_path / "train" / "cat").mkdir()
    with pytest.raises(ValueError, match="cat.*has no images"):
        I.make_image_datasets(_folder_cfg(str(tmp_path)), global_batch_size=2, seed=0)
    with pytest.raises(ValueError, match="does not exist"):
        I.make_image_datasets(_folder_cfg(str(tmp_path / "nowhere")), global_batch_size=2, seed=0)
    bad = tmp_path / "train" / "cat" / "broken.JPEG"
    bad.write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    with pytest.raises(ValueError, match="Cannot decode image file .*broken.JPEG"):
        I.decode_image(str(bad), 3)
    with pytest.raises(ValueError, match="data.mean/data.std have 3/3 entries for data.channels=1"):
        I.make_image_datasets(_folder_cfg(jpeg_root, channels=1), global_batch_size=2, seed=0)
    with pytest.raises(ValueError, match="data.channels=2"):
        I.make_image_datasets(_folder_cfg(jpeg_root, channels=2), global_batch_size=2, seed=0)


def test_unprepared_tfds_dataset_is_one_error_naming_the_fields(tmp_path):
    """ImageNet not prepared in data.tfds_data_dir: a ValueError naming the fields and the
    `tfds build` command, before any download or preparation is attempted (nothing is written)."""
    pytest.importorskip("tensorflow_datasets")
    cfg = I.default_data_config()
    cfg.update(tfds_data_dir=str(tmp_path), read_threads=1)
    with pytest.raises(ValueError, match=r"data\.tfds_name='imagenet2012' split data\.tfds_train_split='train' "
                                         r"could not be opened from data\.tfds_data_dir=.*tfds build imagenet2012 "
                                         r"--file_format=array_record"):
        I.make_image_datasets(cfg, global_batch_size=2, seed=0)
    assert not os.listdir(tmp_path)


def test_grayscale_folder_decodes_as_rgb_and_as_gray(jpeg_root):
    path = os.path.join(jpeg_root, "train", "n00", "img0.JPEG")
    assert Image.open(path).mode == "L"
    assert I.decode_image(path, 3).mode == "RGB" and I.decode_image(path, 1).mode == "L"


# --- transforms -----------------------------------------------------------------------------------


def _photo(rng, size=(48, 40), mode="RGB"):
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(arr).convert(mode)


def test_random_resized_crop(rng):
    img = _photo(rng)
    out = T.random_resized_crop(img, 24, np.random.default_rng(1))
    assert out.size == (24, 24) and out.mode == "RGB"
    same = T.random_resized_crop(img, 24, np.random.default_rng(1))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(same))
    # scale 1 and ratio = the image's own: the whole image, i.e. a plain bicubic resize.
    square = _photo(rng, (30, 30))
    full = T.random_resized_crop(square, 16, np.random.default_rng(2), scale=(1, 1), ratio=(1, 1))
    np.testing.assert_array_equal(np.asarray(full), np.asarray(square.resize((16, 16), Image.BICUBIC)))


def test_flip(rng):
    img = _photo(rng)
    flipped = T.random_flip(img, np.random.default_rng(0), p=1.0)
    np.testing.assert_array_equal(np.asarray(flipped), np.asarray(img)[:, ::-1])
    np.testing.assert_array_equal(np.asarray(T.random_flip(img, np.random.default_rng(0), p=0.0)), np.asarray(img))


def test_rand_augment_magnitudes_and_ops(rng):
    # torchvision RandAugment(num_ops=2, magnitude=9, num_magnitude_bins=31) at bin 9, written out.
    want = {"ShearX": 0.3 * 9 / 30, "TranslateX": 150 / 331 * 40 * 9 / 30, "TranslateY": 150 / 331 * 48 * 9 / 30,
            "Rotate": 30 * 9 / 30, "Brightness": 0.9 * 9 / 30, "Posterize": 7, "Solarize": 255 - 255 * 9 / 30}
    for name, value in want.items():
        assert abs(T.RAND_AUGMENT_OPS[name][0](31, 40, 48)[9] - value) < 1e-9, name
    assert len(T.RAND_AUGMENT_OPS) == 14
    for mode in ("RGB", "L"):
        img = _photo(rng, mode=mode)
        for name, (mags, _, op) in T.RAND_AUGMENT_OPS.items():
            out = op(img, float(mags(31, 40, 48)[9]))
            assert out.size == img.size and out.mode == mode, name
        a = T.rand_augment(img, np.random.default_rng(5))
        b = T.rand_augment(img, np.random.default_rng(5))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    changed = sum(not np.array_equal(np.asarray(T.rand_augment(img, np.random.default_rng(s))), np.asarray(img))
                  for s in range(10))
    assert changed >= 5
    with pytest.raises(ValueError, match="magnitude=31"):
        T.rand_augment(img, np.random.default_rng(0), magnitude=31)


def test_normalize_and_random_erasing(rng):
    img = _photo(rng)
    x = T.to_normalized_array(img, T.IMAGENET_MEAN, T.IMAGENET_STD)
    want = (np.asarray(img, np.float64) / 255 - np.asarray(T.IMAGENET_MEAN)) / np.asarray(T.IMAGENET_STD)
    np.testing.assert_allclose(x, want, atol=1e-6)
    assert x.dtype == np.float32 and x.shape == (40, 48, 3)
    np.testing.assert_array_equal(T.random_erasing(x, np.random.default_rng(0), p=0.0), x)
    for seed in range(5):
        erased = T.random_erasing(x, np.random.default_rng(seed), p=1.0)
        changed = np.any(erased != x, axis=-1)
        rows, cols = np.nonzero(changed)
        box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
        assert changed.sum() == box  # one rectangle
        assert 0.02 * 40 * 48 * 0.9 <= box <= 40 * 48 / 3 * 1.1


def test_mixup_and_cutmix(rng):
    images = rng.standard_normal((6, 8, 8, 3)).astype(np.float32)
    labels = rng.integers(0, 5, 6)
    hot = T.smooth_one_hot(labels, 5, 0.1)
    np.testing.assert_allclose(hot.sum(1), 1.0, atol=1e-6)
    assert np.isclose(hot.max(), 0.92) and np.isclose(hot.min(), 0.02)
    for seed in range(6):
        mixed, targets = T.mixup_cutmix(images, labels, np.random.default_rng(seed), num_classes=5)
        np.testing.assert_allclose(targets.sum(1), 1.0, atol=1e-6)
        # lambda from the targets (example 0 mixed with example 5)
        if labels[0] == labels[5]:
            continue
        lam = (targets[0, labels[0]] - 0.02) / 0.9
        from_flip = np.all(mixed[0] == images[5], axis=-1)
        if from_flip.any() or np.all(mixed[0] == images[0]):  # CutMix: a pasted box of area 1 - lam
            assert np.isclose(from_flip.mean(), 1 - lam, atol=1e-6)
        else:  # Mixup: a convex blend
            np.testing.assert_allclose(mixed[0], lam * images[0] + (1 - lam) * images[5], atol=1e-5)
    plain, t = T.mixup_cutmix(images, labels, np.random.default_rng(0), num_classes=5, mixup_alpha=0, cutmix_alpha=0)
    np.testing.assert_array_equal(plain, images)
    np.testing.assert_array_equal(t, hot)


def test_eval_resize_crop(rng):
    img = _photo(rng, (300, 400))  # width 300, height 400
    out = T.eval_resize_crop(img, 224)
    assert out.size == (224, 224)
    want = img.resize((256, 341), Image.BICUBIC).crop((16, 58, 240, 282))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    for r in (28, 42, 56, 84, 384):
        assert T.eval_resize_crop(img, r).size == (r, r)
    small = _photo(rng, (28, 28), "L")
    np.testing.assert_array_equal(np.asarray(T.eval_resize_crop(small, 28, 1.0)), np.asarray(small))


def test_tiny_image_is_upscaled_with_a_warning_naming_it(tmp_path, caplog, monkeypatch):
    """A 1x1 image (a placeholder from a broken download) becomes a 16x16 example, and the log
    names the file; images at least half the training size pass silently."""
    import logging  # pylint: disable=g-import-not-at-top

    monkeypatch.setitem(I._TINY_WARNINGS, "left", 10)  # pylint: disable=protected-access
    tiny, fine = tmp_path / "tiny.png", tmp_path / "fine.png"
    Image.new("RGB", (1, 1), (200, 10, 10)).save(tiny)
    Image.new("RGB", (8, 9), (200, 10, 10)).save(fine)
    cfg = _plain(_folder_cfg(str(tmp_path)))
    with caplog.at_level(logging.WARNING):
        ex = I.train_example((str(fine), 0), np.random.default_rng(0), cfg)
        assert not caplog.records
        ex = I.train_example((str(tiny), 0), np.random.default_rng(0), cfg)
        ev = I.eval_example((str(tiny), 0), cfg, 16, 2)
    assert ex["image"].shape == ev["image"].shape == (16, 16, 3)
    assert f"{tiny} is 1x1 px, upscaled more than 2x to data.image_size=16" in caplog.text


def test_validation_folder_missing_a_training_class_is_a_loud_warning(tmp_path, caplog):
    import logging  # pylint: disable=g-import-not-at-top

    for split, classes in (("train", ("cat", "dog", "emu")), ("val", ("cat",))):
        for c in classes:
            (tmp_path / split / c).mkdir(parents=True)
            Image.new("RGB", (20, 20), (1, 2, 3)).save(tmp_path / split / c / "a.JPEG")
    with caplog.at_level(logging.WARNING):
        _, _, info = I.make_image_datasets(_folder_cfg(str(tmp_path)), global_batch_size=2, seed=0)
    assert info.num_classes == 3
    assert "has no folder for 2 of the 3 training classes (dog, emu): eval top-1 covers only the other 1" \
        in caplog.text
