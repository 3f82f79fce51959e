"""The single-process reference the model-parallel tests compare against (tiny-llama, plain AdamW)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

BATCH, SEQ, LR = 8, 32, 3e-3


def token_batches(seed: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` (inputs, targets) pairs of random tokens, (BATCH, SEQ) each."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(256, (BATCH, SEQ), generator=g), torch.randint(256, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


def reference_losses(batches) -> list[float]:
    """Per-step losses of tiny-llama (seed 0) trained on `batches` in one process."""
    from labkit.models import build_llm

    model = build_llm("tiny-llama", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    out = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x).logits.flatten(0, -2), y.flatten())
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def spawn_two_ranks(worker, tmp_path_factory, name: str) -> list[dict]:
    """Run `worker(rank, port, out_dir)` on 2 spawned gloo ranks; each writes out_dir/rank<r>.json."""
    import json

    import torch.multiprocessing as mp

    from labkit.launch import free_port

    out = tmp_path_factory.mktemp(name)
    mp.spawn(worker, args=(free_port(), str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
