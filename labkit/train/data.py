"""Data for the training loop: the task (what the loss is), the data sets, and per-step sharding.

Sharding rule (the contract in `labkit.parallel`): the GLOBAL batch of step k is the same samples for
any data-parallel size. `DistributedSampler(shuffle=True, seed)` permutes the data set identically on
every rank and hands rank r the positions r, r + W, r + 2W, ...; cutting each rank's list into
batches of B / W makes the union over ranks of batch k exactly permutation[k*B : (k+1)*B]. So runs of
different strategies see the same samples per step and their losses compare one to one.
Introduced in notebook 02_single_gpu (data) and 03_ddp (DistributedSampler).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from labkit import presets
from labkit.errors import ConfigError

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
TINY_TEXT = DATA_DIR / "tiny_corpus.txt"
TINY_IMAGES = DATA_DIR / "tiny_images"
#: Food-11 training split size (the NYU lab's data): synthetic images use it for epoch projections.
FOOD11_TRAIN_IMAGES = 9866
SYNTHETIC_SEQUENCES = 8192
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Task:
    """What one sample is and how the loss is computed: 'vision' (image, label) or 'llm' (tokens)."""

    kind: str
    num_classes: int
    """Classes (vision) or vocabulary size (llm)."""
    seq_len: int = 0
    """Tokens per sequence (llm); 0 for images."""
    moe_top_k: int = 0
    """Experts per token of a mixture-of-experts LLM (tiny-moe); 0 for a dense model."""
    aux_loss_coef: float = 0.0
    """Weight of the MoE load-balancing loss (`labkit.moe.balance_loss`) added to the training loss."""

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len if self.kind == "llm" else 0

    def logits(self, model, inputs: torch.Tensor) -> torch.Tensor:
        """(B, C) class logits or (B, T, V) next-token logits; HF models return an output object."""
        out = model(inputs)
        return out.logits if hasattr(out, "logits") else out

    def criterion(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over samples (vision) or over every predicted token (llm), in fp32."""
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())

    def loss(self, model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not self.moe_top_k:
            return self.criterion(self.logits(model, inputs), targets)
        out = model(inputs)  # MoE: + the routers' load-balancing loss (labkit.moe, notebook 09)
        from labkit.moe import balance_loss
        aux = balance_loss(out.router_logits, top_k=self.moe_top_k, batch=inputs.shape[0])
        return self.criterion(out.logits, targets) + self.aux_loss_coef * aux


def make_task(cfg) -> Task:
    """The task of a resolved TrainConfig's model."""
    if cfg.kind == "llm":
        from labkit.models import llm_config
        from labkit.moe import moe_facts
        config = llm_config(cfg.model)
        moe = moe_facts(config)
        return Task("llm", config.vocab_size, cfg.seq_len, moe_top_k=moe["top_k"], aux_loss_coef=moe["aux_coef"])
    return Task("vision", presets.VISION_PRESETS[cfg.model]["num_classes"])


# ------------------------------------------------------------------------------------------ data sets
class SyntheticImages(Dataset):
    """Deterministic learnable images: a fixed low-frequency pattern per class plus per-sample noise.

    Sample i depends only on (seed, i), so any rank builds it identically and nothing is stored.
    """

    def __init__(self, n: int, image_size: int, num_classes: int, *, seed: int = 0, offset: int = 0):
        self.n, self.size, self.classes, self.seed, self.offset = n, image_size, num_classes, seed, offset
        g = torch.Generator().manual_seed(seed)
        coarse = torch.randn(num_classes, 3, 4, 4, generator=g)
        self.patterns = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=False)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.offset + i)
        label = int(torch.randint(self.classes, (1,), generator=g))
        # Noise at 1/4 resolution, upsampled: 16x cheaper to draw for 224 px images.
        low = max(1, self.size // 4)
        noise = F.interpolate(torch.randn(1, 3, low, low, generator=g), size=(self.size, self.size))[0]
        return self.patterns[label] + noise, label


class SyntheticTokens(Dataset):
    """Deterministic learnable sequences: token t+1 = token t + stride (mod vocab), per-sample stride."""

    def __init__(self, n: int, seq_len: int, vocab: int, *, seed: int = 0, offset: int = 0):
        self.n, self.seq_len, self.vocab, self.seed, self.offset = n, seq_len, vocab, seed, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.offset + i)
        start = torch.randint(self.vocab, (1,), generator=g)
        stride = torch.randint(1, 8, (1,), generator=g)
        tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab  # (T+1,)
        return tokens[:-1], tokens[1:]


class TokenSequences(Dataset):
    """Consecutive non-overlapping windows of a token stream: inputs tokens[s:s+T], targets shifted by one."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int):
        window = self.tokens[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


def tokenize_text(path: Path, model: str, vocab: int) -> torch.Tensor:
    """Token ids of a text file: the checkpoint's tokenizer when it has one, else UTF-8 bytes (vocab >= 256)."""
    text = path.read_text(encoding="utf-8")
    if (Path(model) / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer
        return torch.tensor(AutoTokenizer.from_pretrained(model)(text)["input_ids"], dtype=torch.long)
    if vocab < 256:
        raise ConfigError(f"model vocabulary {vocab} < 256 cannot hold byte tokens of {path}; use data='synthetic'")
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def image_folder(root: Path, image_size: int, num_classes: int):
    """torchvision ImageFolder with deterministic resize + center crop (no random augmentation, so runs compare)."""
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.Resize(image_size), transforms.CenterCrop(image_size),
                             transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    ds = datasets.ImageFolder(str(root), transform=tf)
    if len(ds.classes) > num_classes:
        raise ConfigError(f"{root} has {len(ds.classes)} classes but the model predicts {num_classes}; "
                          "use a model with at least that many outputs (resnet50 has 1000)")
    return ds


def build_datasets(cfg, task: Task) -> tuple[Dataset, Dataset | None]:
    """(train, held-out) data sets for cfg.data: 'synthetic', 'tiny' or a local path."""
    source = cfg.data
    if source == "tiny":
        source = str(TINY_TEXT if task.kind == "llm" else TINY_IMAGES)
    held = max(cfg.eval_batches, 1) * cfg.batch
    if source == "synthetic":
        if task.kind == "llm":
            make = lambda n, off: SyntheticTokens(n, cfg.seq_len, task.num_classes, seed=cfg.seed, offset=off)  # noqa: E731
            return make(SYNTHETIC_SEQUENCES, 0), make(held, SYNTHETIC_SEQUENCES)
        make = lambda n, off: SyntheticImages(n, cfg.image_size, task.num_classes, seed=cfg.seed, offset=off)  # noqa: E731
        return make(FOOD11_TRAIN_IMAGES, 0), make(held, FOOD11_TRAIN_IMAGES)
    path = Path(source).expanduser()
    if task.kind == "llm":
        if not path.is_file():
            raise ConfigError(f"data={cfg.data!r}: an LLM reads a text file; give its path, 'tiny' or 'synthetic'")
        tokens = tokenize_text(path, cfg.model, task.num_classes)
        cut = int(len(tokens) * 0.9)  # last 10 % held out for evaluation
        return TokenSequences(tokens[:cut], cfg.seq_len), TokenSequences(tokens[cut:], cfg.seq_len)
    if not path.is_dir():
        raise ConfigError(f"data={cfg.data!r}: an image model reads an ImageFolder directory "
                          "(class sub-folders; scripts/fetch_food11.sh makes one), 'tiny' or 'synthetic'")
    # Food-11 layout: training/ validation/ evaluation/, each with class_00 .. class_10.
    train_dir = path / "training" if (path / "training").is_dir() else path
    val_dir = path / "validation" if (path / "validation").is_dir() else None
    train = image_folder(train_dir, cfg.image_size, task.num_classes)
    return train, image_folder(val_dir, cfg.image_size, task.num_classes) if val_dir else None


# ------------------------------------------------------------------------------------------ sharding
class _EpochSlice(Sampler):
    """This rank's sample indices of one epoch from position `start` on (resume mid-epoch without reading data)."""

    def __init__(self, sampler: DistributedSampler, epoch: int, start: int, count: int):
        self.sampler, self.start, self.count = sampler, start, count
        sampler.set_epoch(epoch)

    def __iter__(self):
        return iter(list(self.sampler)[self.start: self.start + self.count])

    def __len__(self) -> int:
        return self.count


class StepLoader:
    """Yields (inputs, targets) = this dp rank's share of the global batch, for steps start, start+1, ..."""

    def __init__(self, dataset: Dataset, *, global_batch: int, dp_rank: int, dp_size: int, seed: int,
                 workers: int = 0, start_step: int = 0, pin_memory: bool = False):
        if len(dataset) < global_batch:
            raise ConfigError(f"the data set has {len(dataset)} samples, fewer than one global batch of "
                              f"{global_batch}; lower --batch or use more data")
        self.dataset, self.global_batch, self.seed, self.workers = dataset, global_batch, seed, workers
        self.dp_rank, self.dp_size, self.start_step, self.pin_memory = dp_rank, dp_size, start_step, pin_memory
        self.local_batch = global_batch // dp_size
        # Only full global batches, so the padding DistributedSampler adds never reaches a step.
        self.steps_per_epoch = len(dataset) // global_batch

    def __iter__(self):
        step = self.start_step
        while True:
            epoch, offset = divmod(step, self.steps_per_epoch)
            sampler = DistributedSampler(self.dataset, num_replicas=self.dp_size, rank=self.dp_rank,
                                         shuffle=True, seed=self.seed)
            todo = self.steps_per_epoch - offset
            part = _EpochSlice(sampler, epoch, offset * self.local_batch, todo * self.local_batch)
            loader = DataLoader(self.dataset, batch_size=self.local_batch, sampler=part, drop_last=True,
                                num_workers=self.workers, pin_memory=self.pin_memory)
            for batch in loader:
                yield batch
                step += 1


def rank_indices(n: int, *, global_batch: int, dp_size: int, step: int = 0, seed: int = 0) -> list[list[int]]:
    """The sample indices each dp rank trains on at `step` (what DistributedSampler hands out)."""
    class _Index(Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return i, i

    out = []
    for rank in range(dp_size):
        loader = StepLoader(_Index(), global_batch=global_batch, dp_rank=rank, dp_size=dp_size, seed=seed,
                            start_step=step)
        out.append(next(iter(loader))[0].tolist())
    return out


def eval_batches(dataset: Dataset | None, *, global_batch: int, dp_rank: int, dp_size: int, count: int):
    """Up to `count` held-out batches of this dp rank (fixed order), or [] without a held-out set."""
    if dataset is None or count == 0 or len(dataset) < global_batch:
        return []
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=global_batch // dp_size, sampler=sampler, drop_last=True)
    out = []
    for batch in loader:
        if len(out) == min(count, len(dataset) // global_batch):
            break
        out.append(batch)
    return out


def split_micro(inputs: torch.Tensor, targets: torch.Tensor, accum: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`accum` equal micro-batches of a local batch (views, no copy)."""
    return list(zip(inputs.chunk(accum), targets.chunk(accum)))
