"""Food-11 (the NYU course's image set) on a node: where it lives, and fetching it (`labkit fetch food11`).

Food-11 (EPFL MMSPG; Singla et al. 2016) has 16,643 photos in 11 classes, split into training/
(9,866), validation/ (3,430) and evaluation/ (3,347). The archive names files "<class>_<n>.jpg" in
flat split folders; `organize` moves them into class_00 .. class_10 sub-folders, the layout
torchvision's ImageFolder reads. This is the Python equivalent of scripts/fetch_food11.sh (same URL,
same `FOOD11_URL` override, same layout), with a progress bar and no curl/unzip needed.
Introduced in notebook 00_setup (what is there) and 02_single_gpu (the data).
"""
from __future__ import annotations

import os
import shutil
import urllib.request
import zipfile
from pathlib import Path

from labkit.errors import ConfigError

URL = "https://nyu.box.com/shared/static/m5kvcl25hfpljul3elhu6xz8y2w61op4.zip"
SPLITS = ("training", "validation", "evaluation")
CLASSES = ("Bread", "Dairy product", "Dessert", "Egg", "Fried food", "Meat", "Noodles/Pasta", "Rice",
           "Seafood", "Soup", "Vegetable/Fruit")


def default_dir() -> Path:
    """`LABKIT_FOOD11` if set, else ~/Food-11 (scripts/fetch_food11.sh's default destination)."""
    return Path(os.environ.get("LABKIT_FOOD11") or "~/Food-11").expanduser()


def is_ready(root: str | os.PathLike) -> bool:
    """True when `root` holds training/ and validation/ in the class_NN layout, with images in them."""
    root = Path(root)
    for split in ("training", "validation"):
        classes = sorted((root / split).glob("class_*")) if (root / split).is_dir() else []
        if not classes or not any(next(c.iterdir(), None) is not None for c in classes):
            return False
    return True


def organize(root: str | os.PathLike) -> int:
    """Move each split's flat '<class>_<n>.jpg' files into class_NN folders; returns the files moved."""
    root, moved = Path(root), 0
    for split in SPLITS:
        folder = root / split
        if not folder.is_dir():
            raise ConfigError(f"{folder} is missing: the Food-11 archive was not unpacked into {root}; "
                              "delete the folder and run `labkit fetch food11` again")
        for file in sorted(p for p in folder.iterdir() if p.is_file()):
            index = file.name.split("_", 1)[0]
            if not index.isdigit() or int(index) >= len(CLASSES):
                continue
            target = folder / f"class_{int(index):02d}"
            target.mkdir(exist_ok=True)
            file.rename(target / file.name)
            moved += 1
    return moved


def _download(url: str, dest: Path) -> None:
    """`url` to `dest` with a tqdm progress bar (file:// works too: tests and local mirrors)."""
    from tqdm import tqdm

    part = dest.with_suffix(".part")
    try:
        with urllib.request.urlopen(url) as response, open(part, "wb") as out:  # noqa: S310 (fixed URL or user's)
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc="Food-11") as bar:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise ConfigError(f"could not download Food-11 from {url} ({exc}); check the network, or set "
                          "FOOD11_URL to a mirror") from exc
    part.rename(dest)


def fetch(dest: str | os.PathLike | None = None, *, url: str | None = None,
          image_size: int | None = 224) -> tuple[Path, str]:
    """Download, unpack and organize Food-11 into `dest` (default `default_dir()`), then decode it once
    into the tensor cache at `image_size` (the GPU profiles' 224 px; None: skip); (path, what happened)."""
    dest = Path(dest).expanduser() if dest else default_dir()
    if is_ready(dest):
        _decode_once(dest, image_size)
        return dest, "already there"
    dest.mkdir(parents=True, exist_ok=True)
    if not all((dest / s).is_dir() for s in SPLITS):
        archive = dest / "Food-11.zip"
        _download(url or os.environ.get("FOOD11_URL") or URL, archive)
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(dest)
        archive.unlink()
        if (dest / "Food-11" / "training").is_dir():  # some mirrors wrap the splits in Food-11/
            for item in (dest / "Food-11").iterdir():
                shutil.move(str(item), dest / item.name)
            (dest / "Food-11").rmdir()
    moved = organize(dest)
    _decode_once(dest, image_size)
    return dest, f"downloaded and organized ({moved} images)"


def _decode_once(root: Path, image_size: int | None) -> None:
    """Fill labkit's uint8 tensor cache for the splits a run reads (labkit.train.imagecache)."""
    if image_size is None:
        return
    from labkit.train.imagecache import cached_image_folder

    workers = max(1, (os.cpu_count() or 2) // 2)
    for split in ("training", "validation"):
        print(f"decoding {root / split} once at {image_size} px into the tensor cache", flush=True)
        cached_image_folder(root / split, image_size, workers=workers)
