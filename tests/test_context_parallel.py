"""Context parallelism (labkit.parallel.context): the online-softmax merge against full attention, and
`labkit train --strategy context-parallel` on 2 gloo ranks against the single-process run."""
from __future__ import annotations

import pytest
import torch

from labkit.errors import ConfigError


def _full_attention(q, k, v, scale, causal=True):
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def test_merge_of_two_key_blocks_equals_softmax_over_all_keys():
    from labkit.parallel.context import block_attention, merge_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    k2, v2 = torch.randn(2, 3, 7, 8, generator=g), torch.randn(2, 3, 7, 8, generator=g)
    a = block_attention(q, k, v, scale=0.3, causal=False)
    b = block_attention(q, k2, v2, scale=0.3, causal=False)
    out, lse = merge_attention(*a, *b)
    keys, values = torch.cat((k, k2), dim=2), torch.cat((v, v2), dim=2)
    torch.testing.assert_close(out, _full_attention(q, keys, values, 0.3, causal=False))
    torch.testing.assert_close(lse, torch.logsumexp((q @ keys.transpose(-2, -1)) * 0.3, dim=-1))
    # order does not matter (the ring visits blocks in a rank-dependent order)
    torch.testing.assert_close(merge_attention(*b, *a)[0], out)


def test_blockwise_causal_attention_equals_full_causal_attention():
    """What each rank of a 4-rank ring computes: its diagonal block causal, earlier blocks in full."""
    from labkit.parallel.context import block_attention, merge_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 4, generator=g) for _ in range(3))
    full = _full_attention(q, k, v, 0.5)
    qs, ks, vs = q.chunk(4, 2), k.chunk(4, 2), v.chunk(4, 2)
    for r in range(4):
        out, lse = block_attention(qs[r], ks[r], vs[r], scale=0.5, causal=True)
        for j in range(r):
            out, lse = merge_attention(out, lse, *block_attention(qs[r], ks[j], vs[j], scale=0.5, causal=False))
        torch.testing.assert_close(out, full.chunk(4, 2)[r])


def test_a_wrong_merge_is_caught():
    """The check above fails for the classic mistake (averaging the two partial outputs)."""
    from labkit.parallel.context import block_attention

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 4, 4, generator=g) for _ in range(3))
    a = block_attention(q, k[:, :, :2], v[:, :, :2], scale=1.0, causal=False)
    b = block_attention(q, k[:, :, 2:], v[:, :, 2:], scale=1.0, causal=False)
    assert not torch.allclose((a[0] + b[0]) / 2, _full_attention(q, k, v, 1.0, causal=False))


def test_check_refuses_what_it_cannot_run():
    from labkit.train.api import make_config

    with pytest.raises(ConfigError, match="not an LLM"):
        make_config("context-parallel", "tiny-resnet", nproc=2)
    with pytest.raises(ConfigError, match="equal chunks"):
        make_config("context-parallel", "tiny-llama", nproc=2, seq_len=33)


@pytest.mark.slow
def test_context_parallel_through_the_training_loop(tmp_path, warm_ranks):
    from labkit.train import run

    common = dict(profile="smoke", steps=3, out=str(tmp_path), eval_batches=1, progress=False)
    single = run("single", "tiny-llama", **common)
    record = run("context-parallel", "tiny-llama", nproc=2, stream=False, **common)
    assert record.losses == pytest.approx(single.losses, rel=1e-5)
    assert record.context.cp == 2 and record.train.dp_size == 1
    assert record.train.eval_loss == pytest.approx(single.train.eval_loss, rel=1e-5)
    assert record.context.ring_kv_bytes_per_layer_per_sample > 0


def test_estimate_with_cp_is_a_trace_of_the_shorter_chunk_plus_the_ring_blocks():
    """Validated against a trace like the other axes: a cp=2 GPU runs the seq/2 tokens of its chunk
    (traced on fake tensors), plus the K/V blocks it received from the other rank."""
    from labkit.memory.estimate import MemoryConfig, estimate
    from labkit.memory.params import model_spec
    from labkit.memory.dry_run import trace

    cp = estimate(MemoryConfig(model="tiny-llama", precision="fp32", batch=2, seq=64, cp=2, gpus=2))
    chunk = trace(MemoryConfig(model="tiny-llama", precision="fp32", batch=2, seq=32))
    a = model_spec("tiny-llama").arch
    ring = 2 * 2 * 32 * a["kv_heads"] * a["head_dim"] * 4 * a["layers"]  # K and V, b=2, 32 tokens, fp32
    assert cp.activations - ring == pytest.approx(chunk.activations, rel=0.15)
    assert cp.model_states == estimate(MemoryConfig(model="tiny-llama", precision="fp32")).model_states
    with pytest.raises(ConfigError, match="equal chunks"):
        estimate(MemoryConfig(model="tiny-llama", batch=1, seq=63, cp=2))
    with pytest.raises(ConfigError, match=r"cp\(2\)"):
        MemoryConfig(model="tiny-llama", cp=2, gpus=4)


def test_plan_tries_context_parallel_where_it_splits_the_sequence():
    from labkit.parallel import planner

    long = planner.plan(planner.PlanRequest(model="llama3-8b", gpus=8, gpus_per_node=8, seq=32768, batch=8))
    with_cp = [o for o in long.fits + long.too_big if o.cp > 1]
    assert with_cp and all(o.comm_bytes["cp"] > 0 and o.dp * o.tp * o.pp * o.cp == 8 for o in with_cp)
    # one 32k-token sequence split over cp=8: its activations shrink ~8x (plus the ring blocks)
    from labkit.memory.estimate import MemoryConfig, estimate

    whole = estimate(MemoryConfig(model="llama3-8b", batch=1, seq=32768, checkpointing="full"))
    eighth = estimate(MemoryConfig(model="llama3-8b", batch=1, seq=32768, checkpointing="full", cp=8))
    assert eighth.activations < whole.activations / 4
    split = planner.evaluate(planner.PlanRequest(model="llama3-8b", gpus=8, gpus_per_node=8, seq=32768, batch=1),
                             1, 1, 1, 0, 1, cp=8)
    assert split.cp == 8 and "cp=8" in split.layout and split.comm_s["cp"] > 0
    short = planner.plan(planner.PlanRequest(model="llama3-8b", gpus=8, gpus_per_node=8))
    assert {o.cp for o in short.fits + short.too_big} > {1}  # issue 42: cp wherever it splits the sequence
