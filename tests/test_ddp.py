"""DDP through the one loop: `labkit train --strategy ddp --nproc 2` equals `--strategy single` loss for loss.

Two real 2-rank gloo launches (module-scoped, shared by the tests): the plain command of the issue,
and one with gradient accumulation (DDP's no_sync path) that also checkpoints, so a single process
can resume a checkpoint written by two ranks (DCP reshards).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from click.testing import CliRunner

from labkit import results
from labkit.cli.train import command
from labkit.zoo.models import build_model, count_params
from labkit.train import run

STEPS = 8
COMMON = ["--model", "tiny-llama", "--profile", "smoke", "--steps", str(STEPS)]


def cli_train(args: list[str]) -> str:
    res = CliRunner().invoke(command, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run("single", "tiny-llama", steps=STEPS, out=str(tmp_path_factory.mktemp("single")), progress=False)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    cli_train(["--strategy", "ddp", *COMMON, "--nproc", "2", "--out", str(out)])
    return results.load(out)[-1]


@pytest.fixture(scope="module")
def ddp_accum(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_accum")
    cli_train(["--strategy", "ddp", *COMMON, "--nproc", "2", "--accum", "2", "--checkpoint-every", "4",
               "--out", str(out)])
    return out, results.load(out)[-1]


@pytest.mark.slow
def test_ddp_losses_fall_and_equal_single_process(single, ddp):
    assert ddp.strategy == "ddp" and ddp.world_size == 2 and ddp.steps == STEPS
    assert np.mean(ddp.losses[-3:]) < np.mean(ddp.losses[:3])
    np.testing.assert_allclose(ddp.losses, single.losses, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_ddp_record_schema_has_one_entry_per_rank(single, ddp):
    record = results.RunRecord.from_dict(dataclasses.asdict(ddp))  # round-trips through the schema
    assert record.profile == "smoke" and record.model == "tiny-llama" and record.device == "cpu"
    assert record.dtype == "float32" and record.global_batch == 8
    n_params = count_params(build_model("tiny-llama"))
    assert record.trainable_params == n_params
    for field in ("peak_bytes", "param_bytes", "grad_bytes", "optimizer_bytes"):
        assert len(getattr(record, field)) == 2
    # A DDP replica holds the full model: 4 bytes per fp32 parameter, the same on every rank and as one process.
    assert record.param_bytes == [4 * n_params] * 2 == single.param_bytes * 2
    assert record.grad_bytes == record.param_bytes
    assert all(o >= 2 * p for o, p in zip(record.optimizer_bytes, record.param_bytes))  # AdamW: 2 moments
    assert all(peak >= p + g for peak, p, g in zip(record.peak_bytes, record.param_bytes, record.grad_bytes))
    assert record.step_time_s > 0 and record.samples_per_s == pytest.approx(8 / record.step_time_s)
    assert record.tokens_per_s == pytest.approx(record.samples_per_s * 32)
    assert record.train.micro_batch == 4 and record.train.dp_size == 2
    # The ring all-reduce of the fp32 gradients, 2 (N-1)/N x their bytes; one process sends nothing.
    assert record.comm.total == record.comm.all_reduce == record.grad_bytes[0] and single.comm.total == 0


@pytest.mark.slow
def test_ddp_with_accumulation_uses_no_sync_and_still_equals_single(single, ddp_accum):
    _, record = ddp_accum
    assert record.train.micro_batch == 2 and record.train.accum == 2
    np.testing.assert_allclose(record.losses, single.losses, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_single_process_resumes_a_two_rank_checkpoint(single, ddp_accum):
    out, _ = ddp_accum
    resumed = run("single", "tiny-llama", steps=STEPS, out=str(out), resume=True, checkpoint_every=4,
                  progress=False)
    assert resumed.train.resumed_from == 4
    np.testing.assert_allclose(resumed.losses, single.losses, rtol=1e-4, atol=1e-5)
