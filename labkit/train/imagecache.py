"""Decode once: an ImageFolder resized to the lab's image size, kept as one uint8 tensor file.

Decoding and resizing Food-11's JPEGs every epoch runs ~600 images/s on 4 loader workers, while
bf16 ResNet-50 on one A100 trains 2000+ images/s: the loader is the bottleneck and every lever of
notebook 02 looks useless. So the photos are decoded, resized (shorter side) and center-cropped ONCE
into a (N, 3, S, S) uint8 tensor -- 9,866 x 3 x 224 x 224 = 1.5 GB for Food-11's training split --
saved under the labkit cache and memory-mapped by every rank (one copy in the page cache per node).
A sample is then a slice, a cast and a normalize. No random augmentation: runs of different
strategies must see the same pixels to compare losses (labkit.train.data). Introduced in 02_single_gpu.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from labkit.zoo.cache import cache_root

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class CachedImages(Dataset):
    """(normalized float image (3, S, S), label) from a uint8 tensor (N, 3, S, S) and labels (N,)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, classes: list[str]):
        self.images, self.labels, self.classes = images, labels, classes
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.images[i].float().div_(255.0)
        return (x - self.mean) / self.std, int(self.labels[i])


def _folder(root: Path, image_size: int):
    """ImageFolder yielding uint8 (3, S, S): resize the shorter side to S, center-crop S x S."""
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.Resize(image_size), transforms.CenterCrop(image_size),
                             transforms.PILToTensor()])
    return datasets.ImageFolder(str(root), transform=tf)


def cache_file(root: Path, image_size: int, samples: list) -> Path:
    """Where the tensors of `root` at `image_size` live; the name changes when the files change."""
    key = hashlib.sha256("\n".join(f"{Path(p).relative_to(root)}\t{c}" for p, c in samples).encode()).hexdigest()
    return cache_root() / "images" / f"{root.name}-{key[:12]}-{image_size}px.pt"


def decode(root: Path, image_size: int, *, workers: int = 0) -> dict:
    """Decode every image of `root` once (in `workers` processes): {'images', 'labels', 'classes'}."""
    folder = _folder(root, image_size)
    loader = DataLoader(folder, batch_size=64, num_workers=workers, shuffle=False)
    images, labels = [], []
    for x, y in loader:  # x: (B, 3, S, S) uint8
        images.append(x)
        labels.append(y)
    return {"images": torch.cat(images), "labels": torch.cat(labels), "classes": folder.classes}


def cached_image_folder(root: str | os.PathLike, image_size: int, *, workers: int = 0) -> CachedImages:
    """The images of ImageFolder `root` at `image_size`, decoded on first use and memory-mapped after.

    Ranks that start together decode once: the first takes a file lock and decodes, the others wait
    for it and read the file. The file is written under a temporary name and renamed, so no reader
    ever sees half of it.
    """
    import fcntl

    from torchvision.datasets import ImageFolder

    root = Path(root).resolve()
    path = cache_file(root, image_size, ImageFolder(str(root)).samples)  # lists files, decodes nothing
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.is_file():
            data = decode(root, image_size, workers=workers)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            torch.save(data, tmp)
            os.replace(tmp, path)
    data = torch.load(path, mmap=True, weights_only=True)
    return CachedImages(data["images"], data["labels"], list(data["classes"]))
