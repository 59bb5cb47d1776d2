"""Vision data without adapters: the cifar10 component's `transform` nodes, and Dataset classes
such as torchvision's ImageFolder or CIFAR10 as `data.train` / `data.val` nodes.

torchvision's wheel may not load beside this CPU torch ("operator torchvision::nms does not
exist"); the tests that import it skip with that reason, and the same paths are tested with
transforms and a folder-of-images Dataset of our own, which behave as torchvision's do.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from conftest import compose_config, run_cli, train_in_process
from helpers import ok
from ringtrain.config.schema import validate
from ringtrain.data.cifar10 import CIFAR10Images, scale_images, write_fake_cifar10
from ringtrain.errors import UserError


class FlipLeftRight:
    """uint8 (C, H, W) -> uint8, mirrored: like torchvision.transforms.v2.RandomHorizontalFlip(p=1)."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        assert image.dtype == torch.uint8 and image.shape == (3, 32, 32)
        return image.flip(-1)


class CropToFloat:
    """uint8 (C, H, W) -> float (C, size, size) in [0, 1]: a crop, then ToDtype(float32, scale=True)."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image[:, : self.size, : self.size].float() / 255


class ToList:
    """A transform that ends in something other than a tensor (a PIL-only pipeline would)."""

    def __call__(self, image: torch.Tensor) -> list:
        return image.tolist()


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cifar")
    write_fake_cifar10(root, n_train_per_batch=16, n_test=16, seed=1)
    return root


def test_cifar10_transforms_see_each_uint8_image_and_set_the_models_input_size(cifar_root):
    plain = CIFAR10Images(str(cifar_root))
    data = CIFAR10Images(str(cifar_root), transform=FlipLeftRight(), val_transform=None)
    cropped = CIFAR10Images(str(cifar_root), transform=CropToFloat(16), val_transform=CropToFloat(16))
    assert plain.dims == data.dims == {"in_features": 3072, "num_classes": 10}
    assert cropped.dims == {"in_features": 3 * 16 * 16, "num_classes": 10}  # known before setup()
    for component in (plain, data, cropped):
        component.setup()
    images, labels = plain.train.images, plain.train.labels
    assert not hasattr(data.train, "get_batch") and hasattr(data.val, "get_batch")  # per image: a DataLoader
    image, label = data.train[5]
    assert torch.equal(image, scale_images(images[5:6].flip(-1), normalize=True)[0]) and label == labels[5]
    image, _ = cropped.val[3]  # a float result is the input as it is: no second scaling
    assert torch.equal(image, plain.val.images[3, :, :16, :16].float() / 255)
    assert len(data.train) == 80 and len(cropped.val) == 16


def test_a_transform_the_data_cannot_use_is_one_line_before_any_work(cifar_root):
    with pytest.raises(UserError, match=r"data.transform returned a list, not a tensor; .*drop ToTensor"):
        CIFAR10Images(str(cifar_root), transform=ToList())
    with pytest.raises(UserError, match=r"data.transform and data.val_transform give inputs of different sizes"):
        CIFAR10Images(str(cifar_root), transform=CropToFloat(16))
    with pytest.raises(UserError, match=r"data.val_transform=3 is not callable"):
        CIFAR10Images(str(cifar_root), val_transform=3)


def test_an_mlp_trains_on_transformed_cifar10_through_workers(cifar_root, tmp_path):
    node = f"{{_target_: {__name__}.CropToFloat, size: 16}}"
    result = train_in_process([
        "model=mlp", "data=cifar10", f"data.root={cifar_root}", f"data.transform={node}", f"data.val_transform={node}",
        "model.hidden_sizes=[8]", "trainer.batch_size=16", "trainer.max_steps=6", "trainer.num_workers=2",
    ], tmp_path / "run")
    weights = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["model"]
    first = next(v for k, v in weights.items() if k.endswith("weight"))
    assert result.steps == 6 and first.shape == (8, 3 * 16 * 16)  # in_features from the transform


FOLDERS = '''
"""A folder of images as torchvision's ImageFolder reads one: root/<class>/<image>, classes
sorted by name; items are (transform(image), class index). Images are .pt uint8 tensors here
(PIL files in torchvision's); the class is the user's, ringtrain knows it only by its path."""
from pathlib import Path

import torch
from torch.utils.data import Dataset


class FolderOfImages(Dataset):
    def __init__(self, root, transform=None):
        self.classes = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
        self.samples = [(f, i) for i, c in enumerate(self.classes) for f in sorted((Path(root) / c).glob("*.pt"))]
        self.transform = transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        file, label = self.samples[index]
        image = torch.load(file, weights_only=True)
        return (self.transform(image) if self.transform else image), label


class Scale:
    def __call__(self, image):
        return image.float() / 255
'''

FOLDER_DATA = '''
# @package _global_
# Two Dataset nodes and the sizes they give the model: no adapter, no data component.
defaults:
  - override /task: classification
data:
  train: {_target_: vision_pkg.folders.FolderOfImages, root: images/train, transform: {_target_: vision_pkg.folders.Scale}}
  val: {_target_: vision_pkg.folders.FolderOfImages, root: images/val, transform: {_target_: vision_pkg.folders.Scale}}
  dims: {in_features: 48, num_classes: 3}
'''


def write_image_folders(project: Path) -> None:
    """Three classes of 3x4x4 images, each a noisy constant colour, for train and val."""
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 40), ("val", 12)):
        for label, colour in enumerate(("red", "green", "blue")):
            folder = project / "images" / split / colour
            folder.mkdir(parents=True)
            for i in range(count):
                image = torch.randint(0, 60, (3, 4, 4), generator=generator, dtype=torch.uint8)
                image[label] += 180
                torch.save(image, folder / f"{i}.pt")


def test_dataset_nodes_like_image_folder_train_with_no_adapter_from_yaml_alone(tmp_path):
    """A user's config dir outside the repository: data.train/data.val are Dataset classes of an
    ImageFolder's shape, each with its transform node; ringtrain batches (tensor, int) items."""
    project = tmp_path / "project"
    (project / "vision_pkg").mkdir(parents=True)
    (project / "vision_pkg" / "__init__.py").write_text("")
    (project / "vision_pkg" / "folders.py").write_text(textwrap.dedent(FOLDERS))
    (project / "my_conf" / "data").mkdir(parents=True)
    (project / "my_conf" / "data" / "folders.yaml").write_text(textwrap.dedent(FOLDER_DATA))
    write_image_folders(project)
    ok(run_cli(["--config-dir", "my_conf", "data=folders", "model=mlp", "model.hidden_sizes=[16]", "optimizer=adam",
                "optimizer.lr=0.01", "trainer.batch_size=8", "trainer.max_steps=30", "trainer.num_workers=2",
                "hydra.run.dir=run"], cwd=project))
    state = torch.load(project / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["data_dims"] == {"in_features": 48, "num_classes": 3}
    import json

    metrics = json.loads((project / "run" / "metrics.json").read_text())["final"]
    assert metrics["val/acc"] == 1.0  # the colours are easy: it learned them


def _torchvision():
    """torchvision, or a skip naming why it does not load here."""
    try:
        import torchvision
    except Exception as err:  # ModuleNotFoundError, or "operator torchvision::nms does not exist"
        pytest.skip(f"torchvision does not load beside this torch ({type(err).__name__}: {err})")
    return torchvision


def test_torchvision_image_folder_and_transforms_as_data_nodes(tmp_path):
    _torchvision()
    from PIL import Image

    for split in ("train", "val"):
        for label, colour in enumerate(((255, 0, 0), (0, 255, 0))):
            folder = tmp_path / split / str(label)
            folder.mkdir(parents=True)
            for i in range(8):
                Image.new("RGB", (8, 8), colour).save(folder / f"{i}.png")
    transform = "{_target_: torchvision.transforms.ToTensor}"
    run = validate(compose_config([
        "model=mlp", "task=classification", "~data",
        f"+data.train={{_target_: torchvision.datasets.ImageFolder, root: {tmp_path / 'train'}, transform: {transform}}}",
        f"+data.val={{_target_: torchvision.datasets.ImageFolder, root: {tmp_path / 'val'}, transform: {transform}}}",
        "+data.dims={in_features: 192, num_classes: 2}", "trainer.batch_size=4", "trainer.max_steps=4",
    ]))
    from ringtrain.run import train_rank

    result = train_rank(run, str(tmp_path / "run"))
    assert result.steps == 4
