"""Context-parallel variants (labkit.parallel.context_variants) and MoE capacity (labkit.zoo.moe): pure checks, then
ONE 2-rank gloo job for both against one device (sequence parallelism rides on tests/test_tensor.py's job)."""
from __future__ import annotations

import pytest
import torch

from labkit.errors import ConfigError


def test_zigzag_gives_each_rank_one_chunk_from_each_end_and_equal_causal_work():
    from labkit.parallel.context_variants import causal_pairs, imbalance, positions

    assert positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert positions(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([positions(24, 3, r, "zigzag") for r in range(3)]).tolist()) == list(range(24))
    contiguous, zigzag = causal_pairs(64, 4, "contiguous"), causal_pairs(64, 4, "zigzag")
    assert sum(contiguous) == sum(zigzag) == 64 * 65 // 2
    assert len(set(zigzag)) == 1 and imbalance(zigzag) == 1.0
    assert imbalance(contiguous) > 1.5  # the last rank sees every earlier key
    with pytest.raises(ConfigError, match="multiple of 8"):
        positions(12, 4, 0, "zigzag")


def test_masked_attention_over_shuffled_positions_is_causal_attention():
    from labkit.parallel.context_variants import masked_attention, positions

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 4, generator=g) for _ in range(3))
    full = torch.arange(16)
    ref, _, work = masked_attention(q, k, v, full, full, scale=0.5)
    want = torch.softmax((q @ k.transpose(-2, -1) * 0.5).masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1),
                                                                      float("-inf")), -1) @ v
    torch.testing.assert_close(ref, want)
    assert work == 2 * 16 * 17 // 2
    pos = positions(16, 2, 1, "zigzag")
    out, _, _ = masked_attention(q[:, :, pos], k, v, pos, full, scale=0.5)
    torch.testing.assert_close(out, want[:, :, pos])


def test_kv_bytes_ulysses_falls_with_cp_and_the_ring_does_not():
    from labkit.parallel.context_variants import kv_bytes

    kw = dict(seq=8192, heads=32, kv_heads=8, head_dim=128)
    ring = [kv_bytes("ring", n=n, **kw) for n in (2, 4, 8)]
    ulysses = [kv_bytes("ulysses", n=n, **kw) for n in (2, 4, 8)]
    assert ring[0] < ring[1] < ring[2]  # (n-1)/n of the whole K/V
    assert ulysses[0] > ulysses[1] > ulysses[2]
    assert kv_bytes("allgather_kv", n=4, **kw) == ring[1]
    with pytest.raises(ConfigError, match="ulysses"):
        kv_bytes("tree", n=2, **kw)


def test_capacity_drops_what_exceeds_it_first_come_first_served():
    from labkit.zoo.moe import expert_capacity, keep_within_capacity

    assert expert_capacity(tokens=8, experts=4, top_k=2, capacity_factor=1.0) == 4
    assert expert_capacity(tokens=8, experts=4, top_k=2, capacity_factor=1.25) == 5
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # expert 0 is chosen 4 times
    keep = keep_within_capacity(ids, 4, capacity=2)
    assert keep.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    assert keep_within_capacity(ids, 4, None).all()
    with pytest.raises(ConfigError, match="capacity_factor"):
        expert_capacity(8, 4, 2, 0.0)


def _on_two_ranks(out_dir):
    import torch.distributed as dist

    from labkit.zoo import moe
    from labkit.parallel import context_variants

    rank = dist.get_rank()
    return {"cp": context_variants.compare_rank(rank, 2), "moe": moe.dispatch_rank(rank, 2)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from _reference import spawn_two_ranks

    return spawn_two_ranks(_on_two_ranks, tmp_path_factory, "variants")


@pytest.mark.slow
def test_every_cp_variant_equals_one_device_and_zigzag_balances(two_ranks):
    cp = [r["cp"] for r in two_ranks]
    assert set(cp[0]) == {f"{v}/{s}" for v in ("ring", "allgather_kv", "ulysses") for s in ("contiguous", "zigzag")}
    assert max(c[k]["max_diff"] for c in cp for k in c) < 1e-5
    work = {k: [c[k]["pairs"] for c in cp] for k in cp[0]}
    assert work["ring/contiguous"][1] > 2 * work["ring/contiguous"][0]
    assert work["ring/zigzag"][0] == work["ring/zigzag"][1] == work["allgather_kv/zigzag"][0]
    assert work["ulysses/contiguous"][0] == work["ulysses/contiguous"][1]


@pytest.mark.slow
def test_dispatch_drops_tokens_under_capacity_and_dropless_is_imbalanced(two_ranks):
    moe = [r["moe"] for r in two_ranks]
    dropless = [m["dropless"]["received_rows"] for m in moe]
    assert sum(dropless) == 2 * 256 * 2  # every routed copy arrives somewhere
    assert dropless[0] > dropless[1]  # the skewed router favours the experts of rank 0
    assert all(m["dropless"]["dropped"] == 0 for m in moe)
    drops = [moe[0][k]["dropped"] for k in ("cf=1", "cf=1.25", "cf=2")]
    assert drops[0] > drops[1] > drops[2] >= 0 and drops[0] > 0.05


def test_load_bars_draws_one_bar_per_rank_and_series():
    import matplotlib

    matplotlib.use("Agg")
    from labkit.parallel.context_variants import SPLITS, causal_pairs
    from labkit.viz.balance import load_bars

    fig = load_bars({s: causal_pairs(64, 4, s) for s in SPLITS}, ylabel="pairs")
    ax = fig.axes[0]
    assert len(ax.patches) == 8 and [t.get_text() for t in ax.get_xticklabels()] == [f"rank {r}" for r in range(4)]
    assert sorted(p.get_height() for p in ax.patches[:4]) == sorted(causal_pairs(64, 4, "contiguous"))
