"""Preflight must fail a broken node (issue 38, G5): wrong all-reduce data, bad ECC / row remaps / Xid,
MIG or exclusive compute mode, foreign processes, a GPU that throttles once hot.

The readers are pure functions over `nvidia-smi` / kernel-log text (fake output below, in the formats of
`nvidia-smi --format=csv,noheader`); the value check runs a real gloo all-reduce with a corrupting hook.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labkit.course import node_health, node_probes, preflight
from labkit.errors import ConfigError
from labkit.profiles import get_profile

GOOD = "0, NVIDIA A100 80GB PCIe, GPU-aaa, 0, Disabled, Default\n1, NVIDIA A100 80GB PCIe, GPU-bbb, 0, Disabled, Default\n"
BAD = ("0, NVIDIA A100 80GB PCIe, GPU-aaa, 2, Disabled, Default\n"
       "1, NVIDIA A100 80GB PCIe, GPU-bbb, 0, Enabled, Exclusive_Process\n"
       "2, NVIDIA A100 80GB PCIe, GPU-ccc, 0, Disabled, Default\n"
       "3, Tesla V100-PCIE-32GB, GPU-ddd, [N/A], [N/A], Default\n")
ROWS = "GPU-aaa, 0, 0, No, No\nGPU-bbb, 3, 0, No, No\nGPU-ccc, 0, 1, Yes, No\n"
APPS = "GPU-aaa, 4242, /usr/bin/python3, 30000 MiB\nGPU-bbb, 777, labkit-self, 1 MiB\n"
DMESG = ("[  12.3] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15\n"
         "[ 812.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python3, Graphics Exception\n"
         "[ 913.5] NVRM: Xid (PCI:0000:5e:00): 79, pid=0, GPU has fallen off the bus.\n")


def test_a_healthy_node_passes():
    gpus = node_health.parse_gpus(GOOD)
    readings = node_health.judge(gpus, node_health.parse_remapped("GPU-aaa, 0, 0, No, No\n"), [], [])
    assert [r["ok"] for r in readings] == [True, True, True]
    assert "compute mode Default" in readings[0]["detail"]


def test_each_fault_fails_its_gpu():
    readings = node_health.judge(node_health.parse_gpus(BAD), node_health.parse_remapped(ROWS),
                                 node_health.parse_apps(APPS, own_pids={777}), node_health.parse_xids(DMESG))
    by_name = {r["name"]: r for r in readings}
    assert "2 uncorrected ECC" in by_name["health 0"]["detail"] and not by_name["health 0"]["ok"]
    assert "MIG mode on" in by_name["health 1"]["detail"] and "Exclusive_Process" in by_name["health 1"]["detail"]
    assert "1 uncorrectable" in by_name["health 2"]["detail"] and "pending=True" in by_name["health 2"]["detail"]
    assert by_name["health 3"]["ok"]  # [N/A] fields (no ECC on the card) are not faults
    assert not by_name["gpu processes"]["ok"] and "pid 4242" in by_name["gpu processes"]["detail"]
    assert "777" not in by_name["gpu processes"]["detail"]  # the preflight's own process is not foreign
    assert not by_name["xid"]["ok"] and "79 (GPU fell off the bus)" in by_name["xid"]["detail"]


def test_a_program_fault_xid_is_listed_not_failed():
    readings = node_health.judge([], {}, [], node_health.parse_xids(DMESG.splitlines()[1]))
    assert readings == [{"name": "xid", "ok": True, "detail": "kernel log: Xid 13 (a program fault)", "fix": ""}]


def test_health_readings_become_preflight_checks():
    checks = preflight.health_checks(node_health.judge(node_health.parse_gpus(BAD), {}, [], []))
    assert [c.status for c in checks][:2] == ["failed", "failed"] and checks[0].kind == "health" and checks[0].fix


# ----------------------------------------------------------------------------- the all-reduce's value
@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def corrupting_all_reduce(tensor, group=None):
    """A real gloo all-reduce on a path that flips one element: fast, and wrong."""
    dist.all_reduce(tensor, group=group)
    tensor[7] += 1


def test_an_all_reduce_that_returns_wrong_data_is_caught(one_rank):
    t = torch.empty(1024)
    assert node_probes._median_allreduce(t, None, t.device, repeats=2)[1] == 0
    seconds, wrong = node_probes._median_allreduce(t, None, t.device, repeats=2, collective=corrupting_all_reduce)
    assert wrong == 1 and seconds > 0


def test_a_pair_with_wrong_data_fails_the_preflight_at_any_speed():
    row = {"ranks": [0, 1], "bytes": 2**28, "seconds": 0.01, "algbw_GBps": 500.0, "busbw_GBps": 500.0}
    probes = {"allreduce": [{**row, "wrong_elements": 3}], "comm": [], "matmul": []}
    check = preflight.probe_checks(probes, get_profile("a100x4"))[0]
    assert check.status == "failed" and "3 element(s)" in check.detail
    assert preflight.probe_checks({**probes, "allreduce": [row]}, get_profile("a100x4"))[0].status == "ok"


# ----------------------------------------------------------------------------------------- burn-in
def test_burn_in_fails_a_gpu_that_slows_down_once_hot():
    hot = {"rank": 1, "seconds": 60, "windows_tflops": [250.0, 240.0, 180.0]}
    steady = {"rank": 0, "seconds": 60, "windows_tflops": [250.0, 245.0, 240.0]}
    checks = preflight.health_checks(node_health.judge_burn_ins([steady, hot], "fix it"), "probe")
    assert [c.status for c in checks] == ["ok", "failed"] and "72%" in checks[1].detail


def test_burn_in_runs_and_is_bounded():
    result = node_health.burn_in(torch.device("cpu"), "none", 0.05, window_s=0.02)
    assert result["windows_tflops"] and all(w > 0 for w in result["windows_tflops"])
    with pytest.raises(ConfigError, match="0 \\(none\\) to 60"):
        node_health.check_burn_in(600)


def test_the_cli_takes_a_bounded_burn_in():
    from click.testing import CliRunner

    from labkit.cli.preflight import command

    assert "--burn-in" in CliRunner().invoke(command, ["--help"]).output
    result = CliRunner().invoke(command, ["--profile", "smoke", "--burn-in", "600"])
    assert result.exit_code == 2 and "600" in result.output  # refused before anything runs
