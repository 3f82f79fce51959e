"""`labkit bench comm` (labkit.profiling.commbench): nccl-tests' bus-bandwidth factors, sizes, the measurement file
and its reader, and one real 2-rank gloo run through the CLI."""
from __future__ import annotations

import json

import pytest

from labkit import cli
from labkit.profiling import commbench
from labkit.errors import ConfigError


@pytest.mark.parametrize("n, all_reduce, gather", [(2, 1.0, 0.5), (4, 1.5, 0.75), (8, 1.75, 0.875)])
def test_bus_factors_follow_nccl_tests(n, all_reduce, gather):
    assert commbench.bus_factor("all_reduce", n) == pytest.approx(all_reduce)  # 2 (n-1)/n
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert commbench.bus_factor(op, n) == pytest.approx(gather)  # (n-1)/n
    assert commbench.bus_factor("broadcast", n) == 1.0


def test_bandwidths_of_one_measurement():
    row = commbench.measurement("all_reduce", 2 * 10**9, 0.5, 4, "nccl")
    assert row.algbw_gbps == pytest.approx(4.0)  # 2 GB in 0.5 s
    assert row.busbw_gbps == pytest.approx(6.0)  # x 2 (4-1)/4


def test_sizes_parse_and_refuse_what_does_not_split():
    assert commbench.parse_sizes("64K,1K,1M", 2) == [1024, 65536, 2**20]
    with pytest.raises(ConfigError, match="multiple of 32 B"):
        commbench.parse_sizes("100", 8)
    with pytest.raises(ConfigError, match="write sizes like"):
        commbench.parse_sizes("1 MB!", 2)
    with pytest.raises(ConfigError, match="unknown collective"):
        commbench.bus_factor("all_reduce_fast", 2)


def test_reader_uses_the_largest_size_and_is_none_without_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_RUNS", str(tmp_path / "empty"))
    assert commbench.load_measured_bandwidth() is None
    rows = [commbench.measurement("all_reduce", s, t, 2, "gloo") for s, t in ((1024, 1e-4), (2**20, 1e-3))]
    commbench.save(rows + [commbench.measurement("broadcast", 2**22, 1e-3, 2, "gloo")], tmp_path, warmup=1, iters=2)
    monkeypatch.setenv("LABKIT_RUNS", str(tmp_path))  # the results root: where 09 writes it and 03 reads it
    got = commbench.load_measured_bandwidth()
    assert got.bytes == 2**20 and got.busbw == pytest.approx(rows[1].busbw_gbps * 1e9)
    assert commbench.load_measured_bandwidth(backend="nccl") is None
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="rerun `labkit bench comm`"):
        commbench.load_measured_bandwidth(tmp_path / "bad.json")


def test_a_gpu_nodes_defaults_measure_every_gpu_up_to_1_gib(monkeypatch):
    """Issue 25 (14): 2 ranks and 16 MiB read a busbw far below the link; on a node the defaults are every
    GPU and nccl-tests' sizes. The launch is replaced: what is tested is what would be launched."""
    from labkit.cli import bench

    launched = []
    monkeypatch.setattr("labkit.runtime.launch.run", lambda module, args, nproc, **kw: launched.append((nproc, args)))
    monkeypatch.setattr(commbench, "load", lambda path: path)
    for gpus, nproc, top in ((4, 4, "1G"), (8, 8, "1G"), (1, 2, "16M"), (0, 2, "16M")):
        monkeypatch.setattr(bench, "gpu_count", lambda: gpus)
        bench.run_comm()
        ranks, args = launched.pop()
        assert ranks == nproc and args[args.index("--sizes") + 1].split(",")[-1] == top, (gpus, ranks, args)
    assert max(commbench.parse_sizes(commbench.GPU_SIZES, 8)) >= 2**30


def test_a_short_gpu_measurement_says_it_is_below_the_plateau(tmp_path):
    rows = [commbench.measurement("all_reduce", 16 * 2**20, 1e-3, 2, "nccl")]
    commbench.save(rows, tmp_path, warmup=1, iters=2)
    got = commbench.load_measured_bandwidth(tmp_path / commbench.FILE_NAME)
    assert "below the bandwidth plateau" in got.source and "every GPU, up to 1 GiB" in got.source


def test_one_rank_is_refused_before_launch(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "comm", "--nproc", "1"])
    assert info.value.code == 2 and "at least 2 ranks" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_comm_cli_on_two_gloo_ranks(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "comm", "--nproc", "2", "--json", "--sizes", "1K,64K", "--warmup", "1", "--iters", "3",
                  "--out", str(tmp_path), "--plot", str(tmp_path / "bw.png")])
    assert info.value.code == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["op"], r["bytes"]) for r in rows} == {(op, s) for op in commbench.OPS for s in (1024, 65536)}
    for r in rows:
        assert r["seconds"] > 0 and r["algbw_gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * commbench.bus_factor(r["op"], 2))
    assert (tmp_path / "bw.png").stat().st_size > 0
    assert commbench.load_measured_bandwidth(tmp_path / commbench.FILE_NAME).backend == "gloo"
