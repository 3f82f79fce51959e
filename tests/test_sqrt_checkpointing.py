"""The sqrt(n) checkpointing rule that notebook 02 states, measured on a real chain of layers."""
from __future__ import annotations

import pytest

from labkit.memory.sqrt_checkpointing import measure_segments


def test_sqrt_n_segments_use_the_least_memory_and_far_less_than_no_checkpointing():
    rows = {r.segments: r.peak_bytes for r in measure_segments(64, width=128, batch=256)}
    assert set(rows) == {0, 2, 8, 32, 64}
    assert min(rows, key=rows.get) == 8  # k = sqrt(64)
    assert rows[8] < 0.6 * rows[0]  # every activation kept vs sqrt(n) boundaries + one segment
    assert rows[2] > rows[8] and rows[64] > rows[8]  # too few segments: long recompute; too many: many boundaries


def test_without_checkpointing_memory_grows_linearly_with_depth():
    one = measure_segments(16, width=128, batch=256, segments=(0,))[0].peak_bytes
    four = measure_segments(64, width=128, batch=256, segments=(0,))[0].peak_bytes
    assert 3.5 < four / one < 4.5


def test_a_segment_count_outside_the_chain_is_refused():
    with pytest.raises(ValueError, match="segments=9"):
        measure_segments(8, segments=(9,))


def test_saved_bytes_sees_a_checkpointed_block_keep_only_its_input():
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from labkit.memory.sqrt_checkpointing import saved_bytes

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).requires_grad_(False)
    x = torch.randn(32, 64, requires_grad=True)
    out, plain = saved_bytes(block, x)
    out2, kept = saved_bytes(checkpoint, block, x, use_reentrant=False)
    assert torch.equal(out, out2)
    assert kept == x.numel() * 4  # only the input
    assert plain > 4 * kept  # input, the hidden pre- and post-GELU, the weights
