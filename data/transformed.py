"""Image data sets with a transform: each uint8 image through a callable, one at a time.

    data=cifar10 data.transform._target_=torchvision.transforms.v2.RandomHorizontalFlip

`TransformedImages` wraps a split whose images are in memory as one uint8 (N, C, H, W) tensor
(data/cifar10.py's). Each image goes to `transform` as a uint8 (C, H, W) tensor, what
torchvision.transforms.v2 works on (RandomCrop, RandomHorizontalFlip, ToDtype, Normalize, ...;
any callable will do). A uint8 result is then scaled as the split scales its images; a float
result is the model's input as it is (the transform scaled it itself).

The split has no `get_batch`: a transform works image by image, so batches come from torch's
DataLoader and its workers (`trainer.num_workers`), each worker seeded from the run's seed and
epoch (trainer/loop/loaders.py), so random augmentations repeat from run to run.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import Dataset

from ringtrain.data import DataError

Scale = Callable[[torch.Tensor], torch.Tensor]  # uint8 (N, C, H, W) -> float (N, C, H, W)


class TransformedImages(Dataset):
    """(transform(images[i]), labels[i]) for a uint8 (N, C, H, W) `images` tensor."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Callable, scale: Scale,
                 key: str = "data.transform"):
        self.images, self.labels, self.transform, self.scale, self.key = images, labels, transform, scale, key

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_transform(self.transform, self.images[index], self.scale, self.key), self.labels[index]


def apply_transform(transform: Callable, image: torch.Tensor, scale: Scale, key: str) -> torch.Tensor:
    """The model's input for one uint8 (C, H, W) image."""
    out = transform(image)
    if not isinstance(out, torch.Tensor):
        raise DataError(
            f"{key} returned a {type(out).__name__}, not a tensor; it is given a uint8 (C, H, W) tensor and must "
            f"return one (torchvision.transforms.v2 works on tensors; drop ToTensor and other PIL-only steps)"
        )
    return scale(out.unsqueeze(0))[0] if out.dtype == torch.uint8 else out


def transformed_size(transform: Callable, shape: tuple[int, ...], scale: Scale, key: str) -> int:
    """The number of values of one model input, from the transform of a blank image (a
    transform may crop or resize): the `in_features` a model needs, known before any data."""
    if not callable(transform):
        raise DataError(f"{key}={transform!r} is not callable; give a transform node (a _target_ such as "
                        f"torchvision.transforms.v2.RandomHorizontalFlip) or null")
    try:
        return apply_transform(transform, torch.zeros(shape, dtype=torch.uint8), scale, key).numel()
    except DataError:
        raise
    except Exception as err:  # the user's callable raised: name it and what it was given
        raise DataError(f"{key} failed on a uint8 {tuple(shape)} image ({type(err).__name__}: "
                        f"{' '.join(str(err).split())[:200]}); it must take a uint8 (C, H, W) tensor") from None
