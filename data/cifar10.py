"""CIFAR-10 from torchvision's on-disk format, without torchvision.

    python train.py data=cifar10 data.root=~/datasets            # cifar-10-batches-py inside
    python train.py data=cifar10 data.root=~/datasets data.download=true

`<root>/cifar-10-batches-py/` holds data_batch_1..5 (50000 training images), test_batch
(10000, used for validation) and batches.meta (the class names), as the authors publish them
(https://www.cs.toronto.edu/~kriz/cifar.html) and torchvision unpacks them: Python pickles of
dicts with b"data", uint8 (N, 3072) rows of 1024 red, 1024 green and 1024 blue pixels, and
b"labels", N ints in 0..9.

Unpickling a file runs whatever code the file names, and that is the format: put only files
you trust under `root` (the official archive, which `download=True` checks by its md5).

All images stay in memory as one uint8 tensor (150 MB for the full set) and become float32
per batch: scaled to [0, 1] and, with `normalize`, shifted and scaled per channel by the
training set's mean and standard deviation. `transform` (training) and `val_transform`
(validation) pass each image through a callable first, such as a torchvision.transforms.v2
pipeline from a config node (data/transformed.py); the model's `in_features` follows its output.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import torch
from torch.utils.data import Dataset

from ringtrain.data import DataError, DataModule
from ringtrain.data.transformed import TransformedImages, transformed_size

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
FOLDER = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
META_FILE = "batches.meta"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_SHAPE = (3, 32, 32)
PIXELS = 3 * 32 * 32

# Per-channel mean and standard deviation of the 50000 training images, scaled to [0, 1]
# (the std, not the 0.2023/0.1994/0.2010 that some tutorials copy).
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
_MEAN, _STD = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)


class CIFAR10(Dataset):
    """The training batches (train=True) or the test batch: (image (3, 32, 32) float32, label int64)."""

    def __init__(self, root: str | os.PathLike, train: bool = True, normalize: bool = True):
        folder = Path(root).expanduser() / FOLDER
        self.train = train
        self.normalize = normalize
        batches = [read_batch(folder / name) for name in (TRAIN_FILES if train else (TEST_FILE,))]
        self.images = torch.cat([images for images, _ in batches])  # (N, 3, 32, 32) uint8
        self.labels = torch.cat([labels for _, labels in batches])  # (N,) int64
        self.classes = read_class_names(folder / META_FILE)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._to_float(self.images[index].unsqueeze(0))[0], self.labels[index]

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._to_float(self.images[indices]), self.labels[indices]

    def _to_float(self, images: torch.Tensor) -> torch.Tensor:
        return scale_images(images, self.normalize)


def scale_images(images: torch.Tensor, normalize: bool) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> float32 in [0, 1], normalized per channel when `normalize`."""
    images = images.float().div_(255)
    if normalize:
        images = images.sub_(_MEAN).div_(_STD)
    return images


@dataclass
class CIFAR10Data:
    """What `cifar10` builds: the two splits and the model sizes they dictate."""

    train: CIFAR10
    val: CIFAR10  # the test batch
    dims: dict[str, int]  # {"in_features": 3072, "num_classes": 10}
    vocab: None = None


def cifar10(root: str, download: bool = False, normalize: bool = True) -> CIFAR10Data:
    """CIFAR-10 under `root`, fetched first when `download` and it is not there yet."""
    if not root:
        raise DataError(f"data.root is not set; pass the directory that holds {FOLDER} (or should, with data.download=true)")
    folder = Path(root).expanduser() / FOLDER
    missing = missing_files(folder)
    if missing and download:
        download_cifar10(root)
        missing = missing_files(folder)
    if missing:
        raise DataError(
            f"data.root={root!r}: no CIFAR-10 in {folder} (missing {missing[0]}); pass data.download=true "
            f"(needs network) or put the extracted {FOLDER} folder there"
        )
    return CIFAR10Data(
        train=CIFAR10(root, train=True, normalize=normalize),
        val=CIFAR10(root, train=False, normalize=normalize),
        dims={"in_features": PIXELS, "num_classes": len(CLASSES)},
    )


class CIFAR10Images(DataModule):
    """CIFAR-10 as a data component: `data=cifar10 data.root=<dir> [data.download=true]`.

    The download, when asked for, happens in `prepare_data()`, which ringtrain runs on one
    process per machine before the others read the files (LightningDataModule's contract).
    """

    def __init__(self, root: str, download: bool = False, normalize: bool = True,
                 transform: Callable | None = None, val_transform: Callable | None = None) -> None:
        self.root, self.download, self.normalize = root, download, normalize
        self.transforms = {"transform": transform, "val_transform": val_transform}
        if not root:
            raise DataError(f"data.root is not set; pass the directory that holds {FOLDER} (or should, with data.download=true)")
        missing = missing_files(Path(root).expanduser() / FOLDER)
        if missing and not download:
            raise DataError(
                f"data.root={root!r}: no CIFAR-10 in {Path(root).expanduser() / FOLDER} (missing {missing[0]}); pass "
                f"data.download=true (needs network) or put the extracted {FOLDER} folder there"
            )
        sizes = {PIXELS if fn is None else transformed_size(fn, IMAGE_SHAPE, self._scale, f"data.{key}")
                 for key, fn in self.transforms.items()}
        if len(sizes) > 1:
            raise DataError(f"data.transform and data.val_transform give inputs of different sizes "
                            f"{sorted(sizes)}; make both end at the same image size")
        self.dims = {"in_features": sizes.pop(), "num_classes": len(CLASSES)}

    def _scale(self, images: torch.Tensor) -> torch.Tensor:
        return scale_images(images, self.normalize)

    def prepare_data(self) -> None:
        if self.download and missing_files(Path(self.root).expanduser() / FOLDER):
            download_cifar10(self.root)

    def setup(self) -> None:
        data = cifar10(self.root, download=False, normalize=self.normalize)
        self.train, self.val = (
            split if fn is None else TransformedImages(split.images, split.labels, fn, self._scale, f"data.{key}")
            for split, (key, fn) in zip((data.train, data.val), self.transforms.items())
        )


def missing_files(folder: Path) -> list[str]:
    return [name for name in (*TRAIN_FILES, TEST_FILE, META_FILE) if not (folder / name).is_file()]


def read_batch(file: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (N, 3, 32, 32) uint8, labels (N,) int64) of one pickled batch."""
    batch = _unpickle(file)
    data, labels = batch.get(b"data"), batch.get(b"labels")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != PIXELS:
        raise DataError(f"{file} is not a CIFAR-10 batch: b'data' must be uint8 (N, {PIXELS}); replace it with the original file")
    if labels is None or len(labels) != len(data):
        raise DataError(f"{file} is not a CIFAR-10 batch: it needs one label per image; replace it with the original file")
    labels = torch.as_tensor(np.asarray(labels, dtype=np.int64))
    if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < len(CLASSES):
        raise DataError(f"{file} has labels outside 0..9; replace it with the original file")
    images = torch.from_numpy(np.ascontiguousarray(data)).view(len(data), *IMAGE_SHAPE)
    return images, labels


def read_class_names(file: Path) -> list[str]:
    names = _unpickle(file).get(b"label_names")
    if not isinstance(names, list) or len(names) != len(CLASSES):
        raise DataError(f"{file} is not CIFAR-10's batches.meta (it needs 10 b'label_names'); replace it with the original file")
    return [name.decode("utf-8") if isinstance(name, bytes) else str(name) for name in names]


def _unpickle(file: Path) -> dict:
    # encoding="bytes": the files come from Python 2, whose str keys load as bytes.
    try:
        with file.open("rb") as handle:
            content = pickle.load(handle, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as err:
        raise DataError(f"{file} is not a readable CIFAR-10 pickle ({err}); replace it with the original file") from None
    if not isinstance(content, dict):
        raise DataError(f"{file} is not a CIFAR-10 pickle (it holds a {type(content).__name__}, not a dict)")
    return content


def download_cifar10(root: str | os.PathLike, url: str = CIFAR10_URL, md5: str = CIFAR10_MD5) -> Path:
    """Fetch the archive, check its md5 and unpack it into `root`; returns the folder.

    Everything happens in a temporary directory inside `root` and the folder is renamed into
    place at the end, so an interrupted download never leaves a half-written data set (and a
    second process that got there first wins without harm)."""
    root_path = Path(root).expanduser()
    root_path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root_path, prefix=".cifar10-download-") as scratch:
        archive = Path(scratch) / "cifar-10-python.tar.gz"
        try:
            with urllib.request.urlopen(url, timeout=60) as response, archive.open("wb") as out:
                shutil.copyfileobj(response, out, 1 << 20)
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise DataError(
                f"data.download=true could not fetch {url} ({reason}); check the network or put the "
                f"extracted {FOLDER} folder in {root_path}"
            ) from None
        digest = _md5_of(archive)
        if digest != md5:
            raise DataError(
                f"data.download=true fetched {url} with md5 {digest}, expected {md5}; try again, or fetch "
                f"and extract it by hand into {root_path}"
            )
        extract_safely(archive, Path(scratch))
        unpacked = Path(scratch) / FOLDER
        if not unpacked.is_dir():
            raise DataError(f"{url} holds no {FOLDER} folder; fetch and extract CIFAR-10 by hand into {root_path}")
        target = root_path / FOLDER
        try:
            os.replace(unpacked, target)
        except OSError as err:
            if missing_files(target):  # not another process's complete copy: a real failure
                raise DataError(
                    f"data.download=true could not move the data set into {target} ({err}); "
                    f"remove the incomplete {target} and try again"
                ) from None
    return root_path / FOLDER


def extract_safely(archive: Path, destination: Path) -> None:
    """Unpack a tar archive, refusing any member that could land outside `destination`:
    absolute paths, `..` parts, links and device files."""
    with tarfile.open(archive, "r:*") as tar:
        members = tar.getmembers()
        for member in members:
            parts = PurePosixPath(member.name).parts
            if member.name.startswith(("/", "\\")) or PurePosixPath(member.name).is_absolute() or ".." in parts:
                raise DataError(f"{archive} has an unsafe member {member.name!r} (absolute or with '..'); not extracting it")
            if not (member.isfile() or member.isdir()):
                raise DataError(f"{archive} has a member {member.name!r} that is not a plain file or folder; not extracting it")
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4/3.10.12: the library's own check as well
            tar.extractall(destination, members=members, filter="data")
        else:
            tar.extractall(destination, members=members)


def _md5_of(file: Path) -> str:
    digest = hashlib.md5()
    with file.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_fake_cifar10(
    root: str | os.PathLike, n_train_per_batch: int = 20, n_test: int = 20, seed: int = 0
) -> Path:
    """Write a small CIFAR-10 in the real on-disk format (five training batches, a test batch,
    batches.meta; random pixels, labels cycling through the classes in a random order), for
    tests and demos without the 170 MB download. Returns the cifar-10-batches-py folder."""
    folder = Path(root) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(seed)

    def batch(count: int, label: str) -> dict:
        labels = generator.permutation(np.arange(count) % len(CLASSES)).tolist()
        return {
            b"batch_label": label.encode(),
            b"labels": labels,
            b"data": generator.integers(0, 256, (count, PIXELS), dtype=np.uint8),
            b"filenames": [f"fake_{i}.png".encode() for i in range(count)],
        }

    files = {name: batch(n_train_per_batch, f"training batch {i} of 5") for i, name in enumerate(TRAIN_FILES, 1)}
    files[TEST_FILE] = batch(n_test, "testing batch 1 of 1")
    files[META_FILE] = {
        b"num_cases_per_batch": n_train_per_batch,
        b"label_names": [name.encode() for name in CLASSES],
        b"num_vis": PIXELS,
    }
    for name, content in files.items():
        with (folder / name).open("wb") as handle:
            pickle.dump(content, handle, protocol=2)  # the protocol the original files use
    return folder
