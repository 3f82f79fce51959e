"""ParallelDims: validated once, registry names as presets, the mesh it builds on 2 gloo ranks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from _reference import spawn_two_ranks
from labkit import parallel
from labkit.errors import ConfigError
from labkit.parallel.dims import PRESETS, ParallelDims

WORLDS = (1, 2, 4, 8)


@pytest.mark.parametrize("fields,match", [
    (dict(tp=0), r"tp=0; every parallel degree must be a positive integer \(use tp=1"),
    (dict(pp=2.0), r"pp=2.0; every parallel degree"),
    (dict(cp=True), r"cp=True; every parallel degree"),
    (dict(dp_shard=4, ep=3), r"ep=3 must divide dp=4: .*use an ep that divides 4"),
])
def test_bad_degrees_name_the_value_and_the_fix(fields, match):
    with pytest.raises(ConfigError, match=match):
        ParallelDims(**fields)


def test_the_product_must_be_the_world_and_the_error_names_it():
    with pytest.raises(ConfigError, match=r"tp\(8\) \* pp\(8\) \* dp\(8\) = 512 != gpus\(64\).*e\.g\. dp=1"):
        ParallelDims(dp_shard=8, tp=8, pp=8).check_world(64, label="gpus")
    assert ParallelDims(dp_replicate=2, dp_shard=4, tp=8).check_world(64).dp_size == 8


def test_preset_errors_name_the_fix():
    with pytest.raises(ConfigError, match="do not split into 3 nodes"):
        ParallelDims.from_world("fsdp-hybrid", 8, nnodes=3)
    with pytest.raises(ConfigError, match="do not form whole TP groups of 3; use --nproc 3 per node"):
        ParallelDims.from_world("tensor-fsdp", 8, tp=3)
    with pytest.raises(ConfigError, match="'single' runs 1 process, not 2"):
        ParallelDims.from_world("single", 2)
    with pytest.raises(ConfigError, match="unknown ParallelDims preset 'dpp'"):
        ParallelDims.from_world("dpp", 2)


def test_every_registry_name_is_a_preset():
    assert set(PRESETS) == set(parallel.STRATEGIES)


def _before(name: str, world: int, nproc: int) -> tuple[int, list[int]]:
    """(dp size, dp rank of each rank) as each strategy computed them before ParallelDims."""
    if name == "single":
        return 1, [0]
    if name == "tensor":
        return 1, [0] * world
    if name == "tensor-fsdp":
        tp = max(1, min(nproc, world))
        return world // tp, [r // tp for r in range(world)]
    if name.startswith("pipeline") or name == "context-parallel":
        return 1, [0] * world
    return world, list(range(world))


@pytest.mark.parametrize("name,world", [(n, w) for n in sorted(parallel.STRATEGIES) for w in WORLDS
                                        if n != "single" or w == 1])  # 'single' refuses > 1 rank (above)
def test_presets_agree_with_what_each_strategy_did_before(name, world):
    nnodes = 2 if world >= 4 else 1  # tensor-fsdp: TP inside a node of world / 2 ranks
    cfg = SimpleNamespace(run=SimpleNamespace(strategy=name), launch=SimpleNamespace(nproc=world // nnodes, nnodes=nnodes),
                          tp=None)
    dims = ParallelDims.for_config(cfg, world)
    dp, ranks = _before(name, world, cfg.launch.nproc)
    assert dims.world_size == world
    assert (dims.dp_size, [dims.dp_rank(r) for r in range(world)]) == (dp, ranks)
    assert parallel.strategy_class(name).dp_size_for(cfg, world) == dp


@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_meshes_keep_their_shapes(world):
    from labkit.parallel import fsdp

    assert fsdp.mesh_shape(fsdp.VARIANTS["fsdp"], world) == ((world,), ("dp_shard",))
    assert fsdp.mesh_shape(fsdp.VARIANTS["fsdp-no-shard"], world) == ((world, 1), ("dp_replicate", "dp_shard"))
    assert fsdp.mesh_shape(fsdp.VARIANTS["fsdp-hybrid"], world) == ((1, world), ("dp_replicate", "dp_shard"))
    if world > 1:
        shape = fsdp.mesh_shape(fsdp.VARIANTS["fsdp-hybrid"], world, nnodes=2)
        assert shape == ((2, world // 2), ("dp_replicate", "dp_shard"))


def test_mesh_dims_must_cover_the_world():
    dims = ParallelDims(dp_shard=2, tp=4)
    assert dims.mesh_shape() == ((2, 4), ("dp_shard", "tp"))
    with pytest.raises(ConfigError, match=r"do not cover the 8 ranks"):
        dims.mesh_shape(("tp",))


def test_estimator_and_planner_use_the_same_dims():
    from labkit.parallel import planner
    from labkit.memory.estimate import MemoryConfig

    cfg = MemoryConfig(model="llama2-7b", zero=3, zero_group=4, dp=8, tp=2, gpus=16)
    assert cfg.dims == ParallelDims(dp_replicate=2, dp_shard=4, tp=2)
    assert planner.layout_dims(8, 2, 1, zero=0) == ParallelDims(dp_replicate=8, tp=2)
    with pytest.raises(ConfigError, match="ep=3 must divide dp=4"):
        MemoryConfig(model="tiny-moe", dp=4, ep=3)


def _mesh_facts(out_dir: str) -> dict:
    """On each of 2 gloo ranks: the meshes tensor-fsdp and fsdp-no-shard build, and dp rank/size from them."""
    import torch.distributed as dist

    from labkit.parallel.dims import dp_of_mesh

    rank = dist.get_rank()
    tp = ParallelDims.from_world("tensor-fsdp", 2, tp=2)  # (dp_shard 1, tp 2)
    ddp = ParallelDims.from_world("ddp", 2)
    no_shard = ParallelDims.from_world("fsdp-no-shard", 2)
    mesh_tp = tp.build_mesh("cpu", ("dp_shard", "tp"))
    mesh_ddp = ddp.build_mesh("cpu")
    mesh_ns = no_shard.build_mesh("cpu", ("dp_replicate", "dp_shard"))
    return {"tp_names": list(mesh_tp.mesh_dim_names), "tp_shape": list(mesh_tp.shape),
            "tp_group_size": mesh_tp["tp"].size(), "tp_dp": list(dp_of_mesh(mesh_tp)),
            "tp_dp_arith": [tp.dp_rank(rank), tp.dp_size],
            "ddp_dp": list(dp_of_mesh(mesh_ddp)), "ddp_dp_arith": [ddp.dp_rank(rank), ddp.dp_size],
            "ns_shape": list(mesh_ns.shape), "ns_dp": list(dp_of_mesh(mesh_ns))}


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_mesh_built_on_two_gloo_ranks(tmp_path_factory):
    ranks = spawn_two_ranks(_mesh_facts, tmp_path_factory, "dims")
    for rank, facts in enumerate(ranks):
        assert facts["tp_names"] == ["dp_shard", "tp"] and facts["tp_shape"] == [1, 2]
        assert facts["tp_group_size"] == 2
        assert facts["tp_dp"] == facts["tp_dp_arith"] == [0, 1]  # both TP ranks read the same samples
        assert facts["ddp_dp"] == facts["ddp_dp_arith"] == [rank, 2]
        assert facts["ns_shape"] == [2, 1] and facts["ns_dp"] == [rank, 2]
