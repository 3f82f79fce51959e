"""labkit.optim: the optimizer factory behind --optimizer (8-bit and paged AdamW via bitsandbytes)."""
from __future__ import annotations

import pytest
import torch

from labkit import optim
from labkit.errors import ConfigError
from labkit.train.metrics import tensor_bytes

CPU = torch.device("cpu")


def _params(shape=(128, 64), seed=0):
    torch.manual_seed(seed)
    return torch.nn.Parameter(torch.randn(*shape))


def _steps(param, opt, n=10):
    for i in range(n):
        param.grad = torch.sin(3 * param.detach() + i)  # a deterministic, non-trivial gradient
        opt.step()


def _state_bytes(opt) -> int:
    return tensor_bytes([v for s in opt.state.values() for v in s.values()], CPU)[0]


def test_unknown_optimizer_lists_the_valid_names():
    with pytest.raises(ConfigError, match="adamw-8bit.*paged-adamw-8bit"):
        optim.build_optimizer("adam9", [_params()], 1e-3)


def test_no_trainable_parameters_is_an_error_that_says_why():
    with pytest.raises(ConfigError, match="no trainable parameters"):
        optim.build_optimizer("adamw", [], 1e-3)


@pytest.mark.parametrize("name", sorted(optim.OPTIMIZERS))
def test_every_optimizer_steps_and_reports_its_name(name):
    p = _params()
    before = p.detach().clone()
    opt = optim.build_optimizer(name, [p], 1e-2)
    _steps(p, opt, 2)
    assert not torch.equal(before, p.detach())
    assert optim.optimizer_name(opt) == name
    assert optim.facts(opt).name == name


def test_adamw_8bit_follows_adamw_with_a_quarter_of_the_state():
    # Dettmers et al. 2022: block-wise 8-bit moments track 32-bit Adam closely.
    p8, p32 = _params(), _params()
    o8 = optim.build_optimizer("adamw-8bit", [p8], 1e-2)
    o32 = optim.build_optimizer("adamw", [p32], 1e-2)
    _steps(p8, o8)
    _steps(p32, o32)
    moved = (p32.detach() - _params().detach()).abs().max()
    assert (p8.detach() - p32.detach()).abs().max() < 0.05 * moved
    assert _state_bytes(o8) < 0.3 * _state_bytes(o32)
    assert optim.state_bits(o8) == {"8": p8.numel()}
    assert optim.state_bits(o32) == {"32": p32.numel()}


def test_small_tensors_keep_32bit_state_below_min_8bit_size():
    small = _params((8, 64))  # 512 elements < 4096: bitsandbytes keeps fp32 moments
    opt = optim.build_optimizer("adamw-8bit", [small], 1e-2)
    _steps(small, opt, 1)
    assert optim.state_bits(opt) == {"32": small.numel()}
    lowered = optim.build_optimizer("adamw-8bit", [small], 1e-2, min_8bit_size=256)
    _steps(small, lowered, 1)
    assert optim.state_bits(lowered) == {"8": small.numel()}


def test_paged_state_is_reported_honestly_on_cpu():
    p = _params()
    opt = optim.build_optimizer("paged-adamw-8bit", [p], 1e-2)
    _steps(p, opt, 1)
    assert optim.OPTIMIZERS["paged-adamw-8bit"].paged
    assert optim.is_paged(opt) is False  # no CUDA unified memory: bitsandbytes falls back
    assert optim.state_bits(opt) == {"8": p.numel()}


def test_default_adamw_matches_the_harness_default():
    # `--optimizer adamw` must be the same update as the harness's built-in AdamW(weight_decay=0).
    p1, p2 = _params(), _params()
    _steps(p1, optim.build_optimizer("adamw", [p1], 1e-2))
    _steps(p2, torch.optim.AdamW([p2], lr=1e-2, weight_decay=0.0))
    assert torch.equal(p1.detach(), p2.detach())


def test_train_config_rejects_unknown_optimizer():
    from labkit.train.config import TrainConfig
    with pytest.raises(ConfigError, match="unknown optimizer 'adam9'"):
        TrainConfig.of(strategy="single", model="tiny-llama", optimizer="adam9")


def test_full_finetune_with_8bit_adam_through_the_loop(tmp_path):
    from labkit.train.api import run

    common = dict(profile="smoke", steps=4, out=str(tmp_path), progress=False, eval_batches=0)
    ref = run("single", "tiny-llama", **common)
    eight = run("single", "tiny-llama", optimizer="adamw-8bit", **common)
    assert eight.optim.name == "adamw-8bit"
    assert ref.optim.name == "adamw"
    # tensors >= 4096 elements (embedding, head, q/o, MLP) get 8-bit state: most of tiny-llama
    bits = eight.optim.state_bits
    assert bits["8"] > 0.9 * eight.trainable_params
    assert eight.optimizer_bytes[0] < 0.4 * ref.optimizer_bytes[0]
    assert eight.losses[-1] < eight.losses[0]
