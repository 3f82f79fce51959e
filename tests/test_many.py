"""Several runs in one torchrun launch (labkit.train.many.run_many) on 2 gloo ranks.

ddp and fsdp on tiny-llama, 3 steps, fp32, same seed and batches: two records, in the order asked,
each from its own strategy, with equal losses (FSDP is DDP's arithmetic, sharded). A `before` hook
named by import path (fsdp's wrap study, one policy) runs on every rank first, in the same job.
"""
from __future__ import annotations

import json

import pytest

from labkit.errors import ConfigError

STEPS = 3


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from labkit.train import run_many

    out = tmp_path_factory.mktemp("many")
    records = run_many(["ddp", ("fsdp", {"seed": 0})], "tiny-llama", nproc=2, out=str(out), steps=STEPS,
                       progress=False, stream=False,
                       before=("labkit.parallel.studies:wrap_study_rank",
                               {"policies": {"root": {"wrap": "root"}}, "out": str(out / "hook.json")}))
    return out, records


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_two_records_in_order_with_equal_losses(launched):
    _, (ddp, fsdp) = launched
    assert (ddp.strategy, fsdp.strategy) == ("ddp", "fsdp")
    assert ddp.world_size == fsdp.world_size == 2
    assert len(ddp.losses) == len(fsdp.losses) == STEPS
    assert fsdp.losses == pytest.approx(ddp.losses, rel=1e-4)
    assert ddp.train.run_id != fsdp.train.run_id


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_before_hook_ran_in_the_same_job(launched):
    out, _ = launched
    rows = json.loads((out / "hook.json").read_text())
    assert [r["policy"] for r in rows] == ["root"]
    assert rows[0]["units"] == 1  # root wrap: the whole model is one FSDP unit


def test_bad_hook_path_fails_before_launch(tmp_path):
    from labkit.train.many import run_many

    with pytest.raises(ConfigError, match="package.module:function"):
        run_many(["ddp"], "tiny-llama", nproc=2, out=str(tmp_path), before=("labkit.nope:fn", {}))


def test_no_runs_and_no_hook_is_an_error(tmp_path):
    from labkit.train.many import run_many

    with pytest.raises(ConfigError, match="no runs"):
        run_many([], "tiny-llama", nproc=2, out=str(tmp_path))
