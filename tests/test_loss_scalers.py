"""fp16 loss scaling: DeepSpeed's scaler (zero) and torch's GradScaler (ddp, fsdp) skip the same steps (issue 38, G6).

Notebook 05 compares ZeRO's losses with DDP's step for step. On an fp16 node (v100x4, t4x2) a step whose
scaled gradients overflow fp16 is skipped; if the two scalers skip different steps the losses part. The CPU
runs bf16, so no rehearsal sees it: here both REAL scalers get one sequence of gradient sizes, overflow
decided the same way (scale x gradient as an fp16 number is inf), and must skip the same steps.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labkit.runtime import device as devices
from labkit.parallel import zero

FP16_MAX_OK = 0.5  # x 2^16 = 32768: fits fp16 (max 65504)


def _sequence() -> list[float]:
    """Gradient sizes: a spike (step 5), then a size that overflows only at the un-halved scale (hysteresis);
    2000 clean steps (6..2005), then on step 2006 a size that overflows only once the scaler doubled after
    exactly 2000 clean steps (the window); more spikes after it."""
    return [FP16_MAX_OK] * 5 + [4.0, 1.5] + [0.2] * 1999 + [1.5, 0.2, 0.2, 8.0, 3.0, 0.2]


def _overflows(scale: float, size: float) -> bool:
    return bool(torch.tensor(scale * size).half().isinf())


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """DeepSpeed's scaler asks deepspeed.comm for its rank: a 1-rank gloo group, wrapped by DeepSpeed
    without its shared-memory op (a C++ build of a minute where none is cached; one rank needs no shm)."""
    import deepspeed.comm
    import deepspeed.ops

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "s"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", False)
        deepspeed.comm.init_distributed("gloo", auto_mpi_discovery=False)  # wraps the group above
    yield
    dist.destroy_process_group()


def deepspeed_skips(fp16: dict, sizes: list[float]) -> list[int]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.precision_config import get_float16_config

    scaler = DynamicLossScaler(**get_float16_config({"fp16": fp16}).dynamic_loss_scale_args())
    skipped = []
    for step, size in enumerate(sizes):
        overflow = _overflows(scaler.cur_scale, size)
        if overflow:  # DeepSpeed's engine skips every overflowing step, hysteresis or not
            skipped.append(step)
        scaler.update_scale(overflow)
    return skipped


def grad_scaler_skips(sizes: list[float]) -> list[int]:
    """torch's GradScaler as labkit's loop builds it; the gradient passes through fp16 as a real one does."""
    p = torch.nn.Parameter(torch.zeros(1))
    p.register_hook(lambda grad: grad.half().float())  # an fp16 gradient: inf past 65504
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = devices.grad_scaler(torch.device("cpu"))
    skipped = []
    for step, size in enumerate(sizes):
        opt.zero_grad()
        before = p.detach().clone()
        scaler.scale((p * size).sum()).backward()
        scaler.step(opt)
        scaler.update()
        if torch.equal(before, p.detach()):
            skipped.append(step)
    return skipped


def test_zero_skips_the_steps_grad_scaler_skips(one_rank):
    sizes = _sequence()
    ours = deepspeed_skips({"enabled": True, **zero.FP16_LOSS_SCALE}, sizes)
    assert ours == grad_scaler_skips(sizes)
    assert len(ours) >= 3  # the sequence really overflows, before and after a doubling


@pytest.mark.parametrize("change", [{}, {"hysteresis": 2}, {"loss_scale_window": 2000}],
                         ids=["deepspeed-defaults", "hysteresis-2", "window-2000"])
def test_other_settings_skip_other_steps(one_rank, change):
    """Why the config sets each: DeepSpeed's defaults (hysteresis 2, window 1000), or either setting alone
    off by one, part from GradScaler."""
    sizes = _sequence()
    fp16 = {"enabled": True, "loss_scale": 0, **({**zero.FP16_LOSS_SCALE, **change} if change else {})}
    assert deepspeed_skips(fp16, sizes) != grad_scaler_skips(sizes)


def test_the_zero_config_carries_the_scaler_settings():
    from labkit.train.api import make_config

    cfg = make_config("zero2", "tiny-llama", nproc=2, amp="fp16").resolve()
    fp16 = zero.ds_config(cfg, 2, False, dp=2, hidden=64, numel=1000)["fp16"]
    assert fp16["enabled"] and fp16["hysteresis"] == 1 and fp16["loss_scale_window"] == 1999
