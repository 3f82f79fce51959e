"""Expert parallelism (labkit.parallel.expert): the routing on one rank, the estimator's ep axis, and
`labkit train --strategy expert-parallel --model tiny-moe` on 2 gloo ranks against `single`."""
from __future__ import annotations

import pytest
import torch

from labkit.errors import ConfigError


def test_dispatch_and_combine_on_one_rank_equal_the_hf_experts():
    """The sort / all-to-all / weighted combine with a 1-rank group reproduces Mixtral's own layer."""
    import torch.distributed as dist

    from labkit.zoo.models import build_model
    from labkit.parallel.expert import apply_expert_parallel

    reference = build_model("tiny-moe").model.layers[0].mlp.experts
    model = build_model("tiny-moe")
    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        apply_expert_parallel(model, dist.group.WORLD)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(10, 64, generator=g)
        idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(10)])  # (N, k) distinct experts
        w = torch.rand(10, 2, generator=g)
        torch.testing.assert_close(model.model.layers[0].mlp.experts(x, idx, w), reference(x, idx, w))
    finally:
        dist.destroy_process_group()
    assert model.labkit_ep == {"ep": 1, "experts_per_rank": 4, "moe_layers": 2}


def test_check_refuses_what_it_cannot_run():
    from labkit.train.api import make_config

    with pytest.raises(ConfigError, match="use --model tiny-moe"):
        make_config("expert-parallel", "tiny-llama", nproc=2)
    with pytest.raises(ConfigError, match="4 experts do not split over 3"):
        make_config("expert-parallel", "tiny-moe", nproc=3, batch=12)
    with pytest.raises(ConfigError, match="experts"):
        make_config("context-parallel", "tiny-moe", nproc=2)


def test_estimator_divides_expert_states_by_ep_only():
    from labkit.memory.estimate import MemoryConfig, estimate
    from labkit.memory.params import model_spec

    spec = model_spec("tiny-moe")
    base = MemoryConfig(model="tiny-moe", precision="fp32", dp=2)
    plain, ep2 = estimate(base), estimate(base.replace(ep=2))
    saved = spec.expert_params // 2  # half the experts leave each GPU
    assert plain.weights - ep2.weights == pytest.approx(4 * saved, abs=2)
    assert plain.optimizer - ep2.optimizer == pytest.approx(8 * saved, abs=2)
    # ZeRO-3 already shards every parameter over the dp ranks: ep changes nothing there
    assert estimate(base.replace(zero=3, ep=2)).model_states == pytest.approx(
        estimate(base.replace(zero=3)).model_states, abs=4)
    with pytest.raises(ConfigError, match="has none"):
        estimate(MemoryConfig(model="tiny-llama", dp=2, ep=2))
    with pytest.raises(ConfigError, match="must divide dp"):
        MemoryConfig(model="tiny-moe", dp=2, ep=4)


@pytest.mark.slow
def test_expert_parallel_through_the_training_loop(tmp_path, warm_ranks):
    """Loss for loss equal to single; each rank holds half the expert bytes, as the estimator says;
    its checkpoint (expert shards saved as DTensors) resumes in a single process."""
    from labkit.memory.estimate import MemoryConfig, estimate
    from labkit.memory.params import model_spec
    from labkit.train import run

    common = dict(profile="smoke", steps=3, eval_batches=1, progress=False)
    single = run("single", "tiny-moe", out=str(tmp_path / "single"), **common)
    record = run("expert-parallel", "tiny-moe", nproc=2, stream=False, out=str(tmp_path / "ep"),
                 checkpoint_every=2, **common)
    assert record.losses == pytest.approx(single.losses, rel=1e-5)
    assert record.train.eval_loss == pytest.approx(single.train.eval_loss, rel=1e-5)
    experts_fp32 = 4 * model_spec("tiny-moe").expert_params
    assert record.expert.expert_param_bytes == experts_fp32 // 2
    assert record.expert.ep == 2 and record.expert.experts_per_rank == 2
    assert single.param_bytes[0] - record.param_bytes[0] == experts_fp32 // 2
    est = estimate(MemoryConfig(model="tiny-moe", precision="fp32", dp=2, ep=2))
    for measured in record.param_bytes:
        assert measured == pytest.approx(est.weights, rel=0.02)

    resumed = run("single", "tiny-moe", out=str(tmp_path / "ep"), resume=True, **common)
    assert resumed.train.resumed_from == 2
    assert resumed.losses[2] == pytest.approx(single.losses[2], rel=1e-5)
