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

from labkit.zoo import presets
from labkit.errors import ConfigError
from labkit.train.imagecache import cached_image_folder

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
TINY_TEXT = DATA_DIR / "tiny_corpus.txt"
TINY_IMAGES = DATA_DIR / "tiny_images"
#: Food-11 training split size (the NYU lab's data): synthetic images use it for epoch projections.
FOOD11_TRAIN_IMAGES = 9866
SYNTHETIC_SEQUENCES = 8192


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
    """Weight of the MoE load-balancing loss (`labkit.zoo.moe.balance_loss`) added to the training loss."""

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
        out = model(inputs)  # MoE: + the routers' load-balancing loss (labkit.zoo.moe, notebook 09)
        from labkit.zoo.moe import balance_loss
        aux = balance_loss(out.router_logits, top_k=self.moe_top_k, batch=inputs.shape[0])
        return self.criterion(out.logits, targets) + self.aux_loss_coef * aux


def make_task(cfg) -> Task:
    """The task of a resolved TrainConfig's model."""
    if cfg.kind == "llm":
        from labkit.zoo.models import llm_config
        from labkit.zoo.moe import moe_facts
        config = llm_config(cfg.run.model)
        moe = moe_facts(config)
        return Task("llm", config.vocab_size, cfg.run.seq_len, moe_top_k=moe["top_k"], aux_loss_coef=moe["aux_coef"])
    return Task("vision", presets.VISION_PRESETS[cfg.run.model]["num_classes"])


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
    from labkit.zoo.fetch import jsonl_text

    # .jsonl: an instruction set (labkit.zoo.fetch.TEXT_SETS), one '### Instruction / Response' text per record
    text = jsonl_text(path) if path.suffix == ".jsonl" else path.read_text(encoding="utf-8")
    from labkit.zoo.models import checkpoint_dir

    folder = checkpoint_dir(model, weights=False)
    if folder is not None and (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer
        return torch.tensor(AutoTokenizer.from_pretrained(folder)(text)["input_ids"], dtype=torch.long)
    if vocab < 256:
        raise ConfigError(f"model vocabulary {vocab} < 256 cannot hold byte tokens of {path}; use data='synthetic'")
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def image_folder(root: Path, image_size: int, num_classes: int, *, workers: int = 0):
    """An ImageFolder with deterministic resize + center crop (no random augmentation, so runs compare),
    decoded once into a uint8 tensor cache (labkit.train.imagecache: the loader must not be the bottleneck)."""
    ds = cached_image_folder(root, image_size, workers=workers)
    if len(ds.classes) > num_classes:
        raise ConfigError(f"{root} has {len(ds.classes)} classes but the model predicts {num_classes}; "
                          "use a model with at least that many outputs (resnet50 has 1000)")
    return ds


def build_datasets(cfg, task: Task) -> tuple[Dataset, Dataset | None]:
    """(train, held-out) data sets for cfg.run.data: 'synthetic', 'tiny' or a local path."""
    source = cfg.run.data
    if source == "tiny":
        source = str(TINY_TEXT if task.kind == "llm" else TINY_IMAGES)
    from labkit.zoo.fetch import TEXT_SETS, text_path
    if task.kind == "llm" and source in TEXT_SETS:  # e.g. 'dolly' from the HF cache (`labkit fetch dolly`)
        source = str(text_path(source))
    if task.kind == "vision" and source == "food11":  # where `labkit fetch food11` put it
        from labkit.zoo import food11
        if not food11.is_ready(food11.default_dir()):
            raise ConfigError(f"data='food11': Food-11 is not in {food11.default_dir()}; run `labkit fetch food11` "
                              "(or set LABKIT_FOOD11 to the folder that holds it)")
        source = str(food11.default_dir())
    held = max(cfg.run.eval_batches, 1) * cfg.optim.batch
    if source == "synthetic":
        if task.kind == "llm":
            make = lambda n, off: SyntheticTokens(n, cfg.run.seq_len, task.num_classes, seed=cfg.run.seed, offset=off)  # noqa: E731
            return make(SYNTHETIC_SEQUENCES, 0), make(held, SYNTHETIC_SEQUENCES)
        make = lambda n, off: SyntheticImages(n, cfg.run.image_size, task.num_classes, seed=cfg.run.seed, offset=off)  # noqa: E731
        return make(FOOD11_TRAIN_IMAGES, 0), make(held, FOOD11_TRAIN_IMAGES)
    path = Path(source).expanduser()
    if task.kind == "llm":
        if not path.is_file():
            raise ConfigError(f"data={cfg.run.data!r}: an LLM reads a text or .jsonl file; give its path, 'tiny', "
                              f"'synthetic' or {', '.join(TEXT_SETS)} (`labkit fetch NAME`)")
        tokens = tokenize_text(path, cfg.run.model, task.num_classes)
        cut = int(len(tokens) * 0.9)  # last 10 % held out for evaluation
        return TokenSequences(tokens[:cut], cfg.run.seq_len), TokenSequences(tokens[cut:], cfg.run.seq_len)
    if not path.is_dir():
        raise ConfigError(f"data={cfg.run.data!r}: an image model reads an ImageFolder directory "
                          "(class sub-folders; scripts/fetch_food11.sh makes one), 'tiny' or 'synthetic'")
    # Food-11 layout: training/ validation/ evaluation/, each with class_00 .. class_10.
    train_dir = path / "training" if (path / "training").is_dir() else path
    val_dir = path / "validation" if (path / "validation").is_dir() else None
    workers = cfg.run.workers or 0
    train = image_folder(train_dir, cfg.run.image_size, task.num_classes, workers=workers)
    return train, image_folder(val_dir, cfg.run.image_size, task.num_classes, workers=workers) if val_dir else None


# ------------------------------------------------------------------------------------------ sharding
class _StepIndices(Sampler):
    """This rank's sample indices for every step from `start_step` on, epoch after epoch, without end.

    One DataLoader reads them for the whole run, so its worker processes live as long as the run
    (a loader rebuilt per epoch restarts its workers: a stall at every epoch boundary). Each epoch
    contributes whole local batches only, so batch k of the loader is exactly step k's share.
    """

    def __init__(self, sampler: DistributedSampler, local_batch: int, steps_per_epoch: int, start_step: int):
        self.sampler, self.local_batch, self.steps_per_epoch, self.start_step = \
            sampler, local_batch, steps_per_epoch, start_step

    def __iter__(self):
        step = self.start_step
        while True:
            epoch, offset = divmod(step, self.steps_per_epoch)
            self.sampler.set_epoch(epoch)  # resume mid-epoch without reading data
            yield from list(self.sampler)[offset * self.local_batch: self.steps_per_epoch * self.local_batch]
            step += self.steps_per_epoch - offset


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
        sampler = DistributedSampler(self.dataset, num_replicas=self.dp_size, rank=self.dp_rank,
                                     shuffle=True, seed=self.seed)
        steps = _StepIndices(sampler, self.local_batch, self.steps_per_epoch, self.start_step)
        loader = DataLoader(self.dataset, batch_size=self.local_batch, sampler=steps, drop_last=True,
                            num_workers=self.workers, pin_memory=self.pin_memory)
        yield from loader


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
