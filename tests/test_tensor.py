"""Tensor parallelism (labkit.parallel.tensor): 2 gloo ranks against the single-process reference.

One spawned 2-rank job (module fixture) trains tiny-llama 3 steps under each variant on the same
batches -- TP, TP + sequence parallel, 2-D meshes (1, 2) and (2, 1), and a deliberately wrong plan --
and reports losses, local parameter counts and the collectives of the first step (CommDebugMode).
One `labkit train --strategy tensor-fsdp` run checks the hook inside the real training loop.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from _reference import BATCH, LR, SEQ, spawn_two_ranks, token_batches
from _reference import reference_losses as _reference_losses
from labkit.errors import ConfigError

STEPS = 3
VARIANTS = ("tp", "tp-sp", "2d-1x2", "2d-2x1", "wrong")


def batches():
    return token_batches(1, STEPS)


def reference_losses() -> list[float]:
    return _reference_losses(batches())


def _build(variant: str):
    """The parallelized model and the (dp_rank, dp_size) its rank trains as."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from labkit.zoo.models import build_llm
    from labkit.parallel import tensor as T

    model = build_llm("tiny-llama", seed=0)
    rank = dist.get_rank()
    if variant.startswith("2d"):
        dp, tp = (1, 2) if variant == "2d-1x2" else (2, 1)
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        return T.apply_tensor_fsdp(model, mesh), rank // tp, dp
    mesh = init_device_mesh("cpu", (2,))
    if variant == "wrong":  # the layers' plan without the embedding / LM head split
        for layer in model.model.layers:
            parallelize_module(layer, mesh, T.layer_plan())
        return model, 0, 1
    return T.apply_tensor(model, mesh, sequence_parallel=variant == "tp-sp"), 0, 1


def _train(variant: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel

    from labkit.parallel import tensor as T

    model, dp_rank, dp_size = _build(variant)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, counts = [], None
    for i, (x, y) in enumerate(batches()):
        x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
        opt.zero_grad()

        def step():
            with loss_parallel():
                loss = F.cross_entropy(model(x).logits.flatten(0, -2), y.flatten())
                loss.backward()
            return loss

        box = {}
        if i == 0:
            counts = T.count_collectives(lambda: box.setdefault("loss", step()))
        else:
            box["loss"] = step()
        opt.step()
        loss = box["loss"].full_tensor() if hasattr(box["loss"], "full_tensor") else box["loss"].detach()
        dist.all_reduce(loss)  # mean over ranks: the dp average (TP ranks hold the same value)
        losses.append(loss.item() / dist.get_world_size())
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    return {"losses": losses, "local_params": local, "collectives": counts}


def _results(out_dir: str) -> dict:
    """One rank's share of the module fixture (runs inside the 2-rank group); also notebook 07's
    sequence-parallel comparison (labkit.parallel.sequence), in the same job."""
    from labkit.parallel import sequence

    return {**{v: _train(v) for v in VARIANTS}, "sp_compare": sequence.compare_rank(dist_rank(), 2)}


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn_two_ranks(_results, tmp_path_factory, "tp"), reference_losses()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["tp", "tp-sp", "2d-1x2", "2d-2x1"])
def test_losses_match_single_process(two_ranks, variant):
    ranks, ref = two_ranks
    assert ranks[0][variant]["losses"] == pytest.approx(ref, rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_each_rank_holds_about_half_the_parameters(two_ranks):
    from labkit.zoo.models import build_llm, count_params

    ranks, _ = two_ranks
    full = count_params(build_llm("tiny-llama"))
    for r in ranks:
        # only the norms (3 x 64 of 106,816) stay replicated
        assert r["tp"]["local_params"] / full == pytest.approx(0.5, abs=0.005)
        assert r["2d-1x2"]["local_params"] / full == pytest.approx(0.5, abs=0.005)


@pytest.mark.slow
@pytest.mark.parametrize("variant,sp", [("tp", False), ("tp-sp", True)])
def test_collectives_match_the_design(two_ranks, variant, sp):
    from labkit.parallel.tensor import expected_collectives

    ranks, _ = two_ranks
    for r in ranks:
        assert r[variant]["collectives"] == expected_collectives(2, sequence_parallel=sp)


@pytest.mark.slow
def test_a_wrong_plan_fails_the_collective_check(two_ranks):
    from labkit.parallel.tensor import expected_collectives

    ranks, _ = two_ranks
    assert ranks[0]["wrong"]["collectives"] != expected_collectives(2)


def test_expected_collectives_follow_the_layer_count():
    from labkit.parallel.tensor import expected_collectives

    assert expected_collectives(2) == {"all_reduce": 19}
    assert expected_collectives(32)["all_reduce"] - expected_collectives(31)["all_reduce"] == 7  # 2 fwd + 5 bwd
    # Megatron-LM's fused q,k,v and gate,up GEMMs: one f and one g per half-layer (Shoeybi et al. 2019, Fig. 4)
    assert expected_collectives(32, fused=True)["all_reduce"] - expected_collectives(31, fused=True)["all_reduce"] == 4
    assert expected_collectives(2, sequence_parallel=True) == {"all_gather": 10, "reduce_scatter": 10,
                                                              "all_reduce": 3}


@pytest.mark.parametrize("op, name", [
    ("_c10d_functional.all_reduce", "all_reduce"), ("c10d.allreduce_", "all_reduce"),
    ("_c10d_functional.all_gather_into_tensor", "all_gather"), ("c10d._allgather_base_", "all_gather"),
    ("c10d._reduce_scatter_base_", "reduce_scatter"), ("_c10d_functional.reduce_scatter_tensor", "reduce_scatter")])
def test_functional_and_c10d_collectives_count_under_one_name(op, name):
    from labkit.parallel.tensor import collective_name

    assert collective_name(op) == name


def test_tp_degree_must_divide_the_heads():
    from labkit.train.api import make_config

    with pytest.raises(ConfigError, match="num_attention_heads=4"):
        make_config("tensor", "tiny-llama", nproc=3)
    with pytest.raises(ConfigError, match="not an LLM"):
        make_config("tensor-fsdp", "tiny-resnet", nproc=2)


@pytest.mark.slow
def test_tensor_fsdp_through_the_training_loop(tmp_path, warm_ranks):
    from labkit.train import run

    common = dict(profile="smoke", steps=3, out=str(tmp_path), eval_batches=1, progress=False)
    single = run("single", "tiny-llama", **common)
    record = run("tensor-fsdp", "tiny-llama", nproc=2, stream=False, **common)
    assert record.losses == pytest.approx(single.losses, rel=1e-5)
    assert record.tensor.mesh == [1, 2] and record.train.dp_size == 1
    assert max(record.param_bytes) / single.param_bytes[0] == pytest.approx(0.5, abs=0.005)
    assert record.tensor.collectives_first_step["all_reduce"] == 19
    assert record.train.eval_loss == pytest.approx(single.train.eval_loss, rel=1e-5)


@pytest.mark.slow
def test_sequence_parallel_equals_one_device_with_reduce_scatters_and_less_saved(two_ranks):
    """labkit.parallel.sequence.compare_rank (notebook 07): DTensor's SP plan and plain TP beside one device."""
    sp = two_ranks[0][0]["sp_compare"]
    for v in ("tp", "tp+sp"):
        assert sp[v]["loss_diff"] < 1e-5 and sp[v]["grad_diff"] < 1e-5
    assert "reduce_scatter" not in sp["tp"]["forward"]
    assert sp["tp+sp"]["forward"]["reduce_scatter"] == sp["tp+sp"]["forward"]["all_gather"] > 0
    assert sp["tp+sp"]["saved_bytes"] < sp["tp"]["saved_bytes"] < sp["single"]["saved_bytes"]
