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
    from labkit.zoo.models import build_llm

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


def _rank_main(rank: int, port: int, out_dir: str, results) -> None:
    """One spawned rank: join a 2-rank gloo group, write results(out_dir) to out_dir/rank<r>.json."""
    import json
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = results(out_dir)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(result, fh)
    finally:
        dist.destroy_process_group()


def spawn_two_ranks(results, tmp_path_factory, name: str) -> list[dict]:
    """Run `results(out_dir) -> dict` on 2 spawned gloo ranks; the per-rank dicts, rank order."""
    import json

    import torch.multiprocessing as mp

    from labkit.runtime.launch import free_port

    out = tmp_path_factory.mktemp(name)
    mp.spawn(_rank_main, args=(free_port(), str(out), results), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
