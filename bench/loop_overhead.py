"""How much does labkit's loop cost over a plain PyTorch loop? Prints labkit step time / plain step time.

Same model, data, optimizer and batch; both medians exclude the first two steps (warm-up, and the
steps in which labkit measures FLOPs and memory). Goal: <= 1.03. The two loops alternate for
`--rounds` rounds and each keeps its best (lowest) median, the usual guard against other processes
on a shared machine slowing one of them down.

    python bench/loop_overhead.py [--model tiny-resnet] [--profile smoke] [--steps 30] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from labkit.zoo.models import build_model  # noqa: E402
from labkit.train import run  # noqa: E402
from labkit.train.api import make_config  # noqa: E402
from labkit.train.data import StepLoader, build_datasets, make_task  # noqa: E402

WARMUP = 2


def plain_step_time(model_name: str, profile: str, steps: int) -> float:
    """The textbook loop: zero_grad, forward, loss, backward, step."""
    cfg = make_config("single", model_name, profile=profile, steps=steps)
    device = torch.device("cuda" if cfg.run.profile != "smoke" and torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.run.seed)
    model = build_model(model_name, seed=cfg.run.seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=0.0)
    train_set, _ = build_datasets(cfg, make_task(cfg))
    batches = iter(StepLoader(train_set, global_batch=cfg.optim.batch, dp_rank=0, dp_size=1, seed=cfg.run.seed,
                              workers=cfg.run.workers))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        opt.zero_grad(set_to_none=True)
        out = model(x)
        logits = out.logits if hasattr(out, "logits") else out
        F.cross_entropy(logits.flatten(0, -2).float(), y.flatten()).backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-resnet")
    parser.add_argument("--profile", default="smoke")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    plain, labkit = [], []
    with tempfile.TemporaryDirectory() as out:
        for i in range(args.rounds):
            order = (plain, labkit) if i % 2 == 0 else (labkit, plain)
            for times in order:
                if times is plain:
                    plain.append(plain_step_time(args.model, args.profile, args.steps))
                else:
                    record = run("single", args.model, profile=args.profile, steps=args.steps, out=out,
                                 warmup_steps=WARMUP, eval_batches=0, progress=True)
                    labkit.append(record.step_time_s)
    print("per round, plain:", [round(t * 1e3, 1) for t in plain], "labkit:", [round(t * 1e3, 1) for t in labkit])
    ratio = min(labkit) / min(plain)
    print(f"{args.model} ({args.profile}): labkit {min(labkit) * 1e3:.1f} ms/step, plain torch "
          f"{min(plain) * 1e3:.1f} ms/step, ratio {ratio:.3f} (goal <= 1.03; best of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
