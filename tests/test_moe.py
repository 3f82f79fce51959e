"""tiny-moe: the model, its load-balancing loss, its memory estimate (against a real measured step)
and the planner's expert-parallel layouts."""
from __future__ import annotations

import pytest
import torch

from labkit.errors import ConfigError


def test_tiny_moe_is_a_mixtral_whose_count_the_estimator_knows():
    from labkit.memory.params import model_spec
    from labkit.zoo.models import build_model, count_params

    model = build_model("tiny-moe")
    assert type(model).__name__ == "MixtralForCausalLM"
    spec = model_spec("tiny-moe")
    assert count_params(model) == spec.params == 156_480
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert spec.expert_params == experts == 98_304
    assert spec.arch["experts"] == 4 and spec.arch["top_k"] == 2


def test_balance_loss_is_one_for_a_uniform_router_and_grows_when_the_load_concentrates():
    from labkit.zoo.moe import balance_loss

    uniform = torch.zeros(2 * 8, 4)  # (B*T, E): every expert equally likely
    assert float(balance_loss([uniform], top_k=2, batch=2)) == pytest.approx(1.0)
    skewed = torch.zeros(16, 4)
    skewed[:, 0] = 5.0  # everyone prefers expert 0
    assert float(balance_loss([skewed], top_k=2, batch=2)) > 1.5


def test_balance_loss_is_a_mean_over_sequences():
    """What makes data- and expert-parallel runs equal the single run: the batch's loss is the mean
    of its halves' losses (a batch-wide Switch loss would not be)."""
    from labkit.zoo.moe import balance_loss

    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(4 * 6, 4, generator=g) for _ in range(2)]  # 2 layers, B=4, T=6
    whole = balance_loss(logits, top_k=2, batch=4)
    halves = [balance_loss([lg[:12] for lg in logits], top_k=2, batch=2),
              balance_loss([lg[12:] for lg in logits], top_k=2, batch=2)]
    torch.testing.assert_close(whole, (halves[0] + halves[1]) / 2)


def test_the_training_loss_adds_the_weighted_balance_loss():
    import torch.nn.functional as F

    from labkit.zoo.models import build_model
    from labkit.zoo.moe import balance_loss
    from labkit.train.api import make_config
    from labkit.train.data import make_task

    task = make_task(make_config("single", "tiny-moe", profile="smoke"))
    assert task.moe_top_k == 2 and task.aux_loss_coef == pytest.approx(0.01)
    model = build_model("tiny-moe")
    x = torch.randint(256, (2, 16))
    out = model(x)
    expected = F.cross_entropy(out.logits.flatten(0, 1), x.flatten()) + 0.01 * balance_loss(
        out.router_logits, top_k=2, batch=2)
    torch.testing.assert_close(task.loss(model, x, x), expected)


@pytest.mark.parametrize("precision,batch,seq", [("fp32", 2, 32), ("mixed-bf16", 4, 64)])
def test_estimate_agrees_with_a_measured_step(precision, batch, seq):
    from labkit.memory.estimate import MemoryConfig, estimate
    from labkit.memory.measure import measure

    cfg = MemoryConfig(model="tiny-moe", precision=precision, batch=batch, seq=seq)
    est, real = estimate(cfg), measure(cfg, device="cpu")
    assert est.model_states == pytest.approx(real.model_states, rel=0.02)
    assert est.activations == pytest.approx(real.activations, rel=0.15)


def test_trace_refuses_moe_routing_and_names_measure():
    from labkit.memory.estimate import MemoryConfig
    from labkit.memory.dry_run import trace

    with pytest.raises(ConfigError, match="labkit memory measure"):
        trace(MemoryConfig(model="tiny-moe", precision="fp32", batch=2, seq=32))


def test_plan_tries_expert_parallel_only_for_moe_models():
    from labkit.parallel import planner

    moe = planner.plan(planner.PlanRequest(model="tiny-moe", gpus=4, gpus_per_node=4))
    assert {o.ep for o in moe.fits} == {1, 2, 4}
    with_ep = next(o for o in moe.fits if o.ep == 2)
    assert "ep=2" in with_ep.layout and with_ep.comm_bytes["ep"] > 0
    dense = planner.plan(planner.PlanRequest(model="tiny-llama", gpus=4, gpus_per_node=4))
    assert {o.ep for o in dense.fits} == {1}
    with pytest.raises(ConfigError, match="experts"):
        planner.check_layout(planner.PlanRequest(model="llama2-7b", gpus=8, gpus_per_node=8), 8, 1, 1, ep=2)
