"""Food-11 on a node: fetch + organize (a tiny generated archive over file://), the decode-once uint8
tensor cache, and one DataLoader whose workers live for the whole run (issue 14, finding 14)."""
from __future__ import annotations

import zipfile

import pytest
import torch

from labkit.zoo import food11
from labkit.train import imagecache
from labkit.train.data import StepLoader

SPLIT_SIZES = {"training": 12, "validation": 4, "evaluation": 2}


def _jpegs(root, classes: int = 3):
    """Food-11's archive layout: flat split folders of '<class>_<n>.jpg' (random 40x30 photos)."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split, count in SPLIT_SIZES.items():
        (root / split).mkdir(parents=True)
        for n in range(count):
            pixels = torch.randint(0, 256, (30, 40, 3), generator=g, dtype=torch.uint8).numpy()
            Image.fromarray(pixels).save(root / split / f"{n % classes}_{n}.jpg", quality=90)
    return root


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))


def test_fetch_downloads_unpacks_and_organizes_then_knows_it_is_there(tmp_path):
    flat = _jpegs(tmp_path / "archive" / "Food-11")  # some mirrors wrap the splits in Food-11/
    archive = tmp_path / "food11.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for file in sorted(flat.rglob("*.jpg")):
            zf.write(file, file.relative_to(flat.parent))
    dest = tmp_path / "Food-11"
    path, what = food11.fetch(dest, url=archive.as_uri(), image_size=16)
    assert path == dest and what == "downloaded and organized (18 images)"
    caches = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "images").glob("*-16px.pt"))
    assert caches == ["training", "validation"]  # decoded once, at fetch time
    assert food11.is_ready(dest)
    assert sorted(p.name for p in (dest / "training").iterdir()) == ["class_00", "class_01", "class_02"]
    assert len(list((dest / "training" / "class_01").glob("*.jpg"))) == 4
    assert food11.fetch(dest, url="file:///nowhere.zip") == (dest, "already there")


def test_a_failed_download_is_one_clear_error(tmp_path):
    from labkit.errors import ConfigError

    with pytest.raises(ConfigError, match="FOOD11_URL"):
        food11.fetch(tmp_path / "Food-11", url=(tmp_path / "missing.zip").as_uri(), image_size=None)
    assert not list((tmp_path / "Food-11").glob("*.part"))


def test_the_tensor_cache_decodes_once_and_matches_the_pil_pipeline(tmp_path, monkeypatch):
    from torchvision import datasets, transforms

    root = _jpegs(tmp_path / "f")
    food11.organize(root)
    cached = imagecache.cached_image_folder(root / "training", 24)
    files = list((tmp_path / "cache" / "images").glob("training-*-24px.pt"))
    assert len(files) == 1 and cached.images.dtype == torch.uint8 and cached.images.shape == (12, 3, 24, 24)
    tf = transforms.Compose([transforms.Resize(24), transforms.CenterCrop(24), transforms.ToTensor(),
                             transforms.Normalize(imagecache.IMAGENET_MEAN, imagecache.IMAGENET_STD)])
    reference = datasets.ImageFolder(str(root / "training"), transform=tf)
    for i in (0, 5, 11):
        x, y = cached[i]
        x_ref, y_ref = reference[i]
        assert y == y_ref and torch.allclose(x, x_ref, atol=1e-5)

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded again")

    monkeypatch.setattr(imagecache, "decode", no_decode)
    again = imagecache.cached_image_folder(root / "training", 24)  # read from the file
    assert torch.equal(again.images, cached.images)
    (root / "training" / "class_00" / "0_0.jpg").unlink()  # the files changed: a new cache, not a stale one
    with pytest.raises(AssertionError, match="decoded again"):
        imagecache.cached_image_folder(root / "training", 24)


def test_one_loader_serves_every_epoch_with_workers_and_resumes_mid_epoch():
    data = torch.utils.data.TensorDataset(torch.arange(10), torch.arange(10))  # 2 steps per epoch of 4
    def steps(workers, start=0, count=7):
        it = iter(StepLoader(data, global_batch=4, dp_rank=0, dp_size=1, seed=3, workers=workers,
                             start_step=start))
        return [next(it)[0].tolist() for _ in range(count)]

    plain = steps(0)
    assert steps(2) == plain  # worker processes change nothing
    assert steps(0, start=3, count=4) == plain[3:]  # resume mid-epoch
    assert len(set(plain[0] + plain[1])) == 8 and plain[:2] != plain[2:4]  # no repeats in an epoch; reshuffled


def test_resnet_trains_on_food11_where_fetch_put_it_and_gpu_profiles_say_so(tmp_path, monkeypatch, capsys):
    from labkit.zoo import fetch
    from labkit.errors import ConfigError
    from labkit.profiles import get_profile
    from labkit.train import run

    monkeypatch.setenv("LABKIT_FOOD11", str(tmp_path / "f"))
    assert fetch.image_data(get_profile("a100x4")) == "synthetic"
    common = dict(data="food11", batch=4, steps=5, out=str(tmp_path / "runs"), progress=False, eval_batches=1)
    with pytest.raises(ConfigError, match="labkit fetch food11"):
        run("single", "tiny-resnet", **common)
    food11.organize(_jpegs(tmp_path / "f"))
    assert fetch.image_data(get_profile("a100x4")) == "food11" and fetch.image_data(get_profile("smoke")) == "synthetic"
    assert "data: Food-11 from" in capsys.readouterr().out
    record = run("single", "tiny-resnet", workers=1, **common)  # 12 images: 5 steps of 4 cross an epoch
    assert record.train.dataset_size == 12 and record.train.eval_loss is not None
