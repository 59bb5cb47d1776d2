"""CIFAR-10 in torchvision's on-disk format: a small fake set in the real format, no network."""
from __future__ import annotations

import hashlib
import io
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from ringtrain.data import DataError
from ringtrain.data.cifar10 import CIFAR10, CLASSES, FOLDER, MEAN, STD, cifar10, download_cifar10, write_fake_cifar10


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_fake_cifar10(tmp_path, n_train_per_batch=12, n_test=7, seed=3)
    return tmp_path


def raw_batches(root: Path, names: list[str]) -> tuple[np.ndarray, list[int]]:
    """Pixels and labels read straight from the pickles, the way the format documents them."""
    pixels, labels = [], []
    for name in names:
        with open(root / FOLDER / name, "rb") as handle:
            batch = pickle.load(handle, encoding="bytes")
        pixels.append(batch[b"data"])
        labels += batch[b"labels"]
    return np.concatenate(pixels), labels


def test_images_and_labels_are_the_files_pixels_scaled(root):
    pixels, labels = raw_batches(root, [f"data_batch_{i}" for i in range(1, 6)])
    train = CIFAR10(root, train=True, normalize=False)
    assert len(train) == 60 and train.labels.tolist() == labels and train.labels.dtype == torch.int64
    assert sorted(labels[:12]) == sorted(i % 10 for i in range(12))  # every class, shuffled
    for i in (0, 13, 59):
        image, label = train[i]
        assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and label.item() == labels[i]
        # Row layout: 1024 red, then 1024 green, then 1024 blue values, each 32 x 32 row-major.
        assert image[1, 2, 5].item() == pytest.approx(pixels[i, 1024 + 2 * 32 + 5] / 255)
        assert torch.equal(image, torch.from_numpy(pixels[i].reshape(3, 32, 32)).float() / 255)
    assert train.classes == list(CLASSES)


def test_normalisation_uses_the_per_channel_statistics(root):
    plain = CIFAR10(root, train=False, normalize=False)
    normalised = CIFAR10(root, train=False, normalize=True)
    assert len(normalised) == 7
    for channel in range(3):
        expected = (plain[4][0][channel] - MEAN[channel]) / STD[channel]
        assert torch.allclose(normalised[4][0][channel], expected, atol=1e-6)
    black = torch.zeros(3, 32, 32, dtype=torch.uint8)
    normalised.images[0] = black  # a black image lands at -mean/std in every channel
    assert normalised[0][0][:, 0, 0].tolist() == pytest.approx([-m / s for m, s in zip(MEAN, STD)], abs=1e-6)


def test_batches_equal_the_stacked_items(root):
    train = CIFAR10(root)
    indices = torch.tensor([59, 0, 7, 7, 31])
    images, labels = train.get_batch(indices)
    assert images.shape == (5, 3, 32, 32) and labels.tolist() == [train[i][1].item() for i in indices.tolist()]
    assert torch.equal(images, torch.stack([train[i][0] for i in indices.tolist()]))


def test_the_builder_gives_train_test_and_the_model_sizes(root):
    data = cifar10(str(root))
    assert (len(data.train), len(data.val)) == (60, 7) and data.vocab is None
    assert data.dims == {"in_features": 3072, "num_classes": 10}
    assert data.val.labels.tolist() == raw_batches(root, ["test_batch"])[1]


def test_missing_files_say_where_it_looked_and_both_fixes(tmp_path, root):
    with pytest.raises(DataError) as error:
        cifar10(str(tmp_path / "elsewhere"))
    message = str(error.value)
    assert "\n" not in message and message == (
        f"data.root={str(tmp_path / 'elsewhere')!r}: no CIFAR-10 in {tmp_path / 'elsewhere' / FOLDER} "
        f"(missing data_batch_1); pass data.download=true (needs network) or put the extracted {FOLDER} folder there"
    )
    (root / FOLDER / "data_batch_3").unlink()
    with pytest.raises(DataError, match=r"\(missing data_batch_3\); pass data.download=true"):
        cifar10(str(root))
    with pytest.raises(DataError, match="data.root is not set"):
        cifar10("")


def test_a_damaged_batch_is_refused_in_one_line(root):
    (root / FOLDER / "test_batch").write_bytes(b"not a pickle at all")
    with pytest.raises(DataError, match="test_batch is not a readable CIFAR-10 pickle .*replace it with the original file"):
        cifar10(str(root))
    with open(root / FOLDER / "test_batch", "wb") as handle:
        pickle.dump({b"data": np.zeros((3, 100), dtype=np.uint8), b"labels": [0, 1, 2]}, handle)
    with pytest.raises(DataError, match=r"b'data' must be uint8 \(N, 3072\)"):
        cifar10(str(root))


def make_archive(path: Path, source_root: Path, extra: tuple[str, bytes] | None = None) -> str:
    """A .tar.gz laid out like the official one; returns its md5."""
    with tarfile.open(path, "w:gz") as tar:
        tar.add(source_root / FOLDER, arcname=FOLDER)
        if extra is not None:
            info = tarfile.TarInfo(extra[0])
            info.size = len(extra[1])
            tar.addfile(info, io.BytesIO(extra[1]))
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_download_checks_the_md5_and_unpacks_into_root(tmp_path, root):
    archive = tmp_path / "cifar.tar.gz"
    md5 = make_archive(archive, root)
    target = tmp_path / "fresh"
    with pytest.raises(DataError, match=f"md5 {md5}, expected 0123; try again"):
        download_cifar10(target, url=archive.as_uri(), md5="0123")
    assert not (target / FOLDER).exists()
    assert download_cifar10(target, url=archive.as_uri(), md5=md5) == target / FOLDER
    assert torch.equal(cifar10(str(target)).train.images, cifar10(str(root)).train.images)
    assert sorted(p.name for p in target.iterdir()) == [FOLDER]  # no archive or scratch left behind


@pytest.mark.parametrize("member", ["../escape.txt", "/abs/escape.txt", f"{FOLDER}/../../escape.txt"])
def test_download_refuses_members_that_leave_the_folder(tmp_path, root, member):
    archive = tmp_path / "evil.tar.gz"
    md5 = make_archive(archive, root, extra=(member, b"gotcha"))
    with pytest.raises(DataError, match="has an unsafe member .*not extracting it"):
        download_cifar10(tmp_path / "target", url=archive.as_uri(), md5=md5)
    assert not list(tmp_path.rglob("escape.txt")) and not (tmp_path / "target" / FOLDER).exists()


def test_a_failed_fetch_is_one_line_with_the_fix(tmp_path):
    with pytest.raises(DataError) as error:
        download_cifar10(tmp_path, url=(tmp_path / "absent.tar.gz").as_uri())
    assert "\n" not in str(error.value)
    assert str(error.value).startswith("data.download=true could not fetch file://")
    assert str(error.value).endswith(f"check the network or put the extracted {FOLDER} folder in {tmp_path}")


def test_a_dataloader_with_two_workers_matches_get_batch(root):
    train = CIFAR10(root)
    images, labels = zip(*DataLoader(train, batch_size=8, num_workers=2))
    expected = train.get_batch(torch.arange(len(train)))
    assert torch.equal(torch.cat(images), expected[0]) and torch.equal(torch.cat(labels), expected[1])
