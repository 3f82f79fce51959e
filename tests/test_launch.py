"""labkit.runtime.launch: real 2-rank gloo jobs under torchrun (targets in tests/_launch_targets.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import TESTS_DIR, command_line, live_children, stream_text
from labkit.runtime import launch
from labkit.errors import ConfigError, LaunchError

#: This file tests the launch students get: ranks start cold (tests/conftest.py `_cold_ranks`).
COLD_RANKS = True

TARGET = "_launch_targets"


@pytest.fixture
def pid_dir(tmp_path):
    path = tmp_path / "pids"
    path.mkdir()
    return path


@pytest.fixture
def log_dir(tmp_path):
    return str(tmp_path / "logs")  # not the default temporary folder: tests leave nothing in /tmp


@pytest.fixture
def target_env(pid_dir):
    """Environment for the ranks: the targets importable, each rank writes its pid to `pid_dir`."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])),
            "LABKIT_TEST_PID_DIR": str(pid_dir)}


#: Launcher tests that exercise process handling; test_launch_load.py reruns them under a CPU hog.
REPEAT = range(int(os.environ.get("LABKIT_LAUNCH_REPEAT", "1")))
#: Generous deadline for a condition about processes on a busy 2-core machine (not a timing claim).
SLOW_S = 180
#: The issue's promise: after an interrupt or the launcher's death, every rank is gone within this.
GONE_S = 10
NOISE = "is an Enum subclass"  # torchao's import-time deprecation, logged by torch's pytree


def rank_pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(pid_dir.glob("rank*.pid")) if p.read_text().strip()]


def running(pid: int) -> bool:
    """True if `pid` is a live process (a zombie waiting for a reaper counts as dead)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(condition, timeout_s: float, what: str) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout_s` (never a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} (waited {timeout_s:g} s)")
        time.sleep(0.1)




def assert_nothing_left(pid_dir: Path, others: tuple[int, ...] = (), within_s: float = SLOW_S) -> None:
    pids = rank_pids(pid_dir)
    assert len(pids) == 2, "both ranks should have started and written their pid"
    wait_for(lambda: not [p for p in (*pids, *others) if running(p)] and not live_children(), within_s,
             f"processes left: ranks {[p for p in pids if running(p)]}, others {[p for p in others if running(p)]}, "
             f"children {[c.pid for c in live_children()]}")


# ---------------------------------------------------------------- pure parts
def test_single_node_command_uses_loopback_static_rendezvous():
    cmd = launch.torchrun_command("pkg.mod", ["--x", 1], nproc=2, log_dir="/tmp/l", run_id="r", port=12345)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    joined = " ".join(cmd)
    assert "--nproc-per-node 2" in joined and "--master-addr 127.0.0.1 --master-port 12345" in joined
    assert "--log-dir /tmp/l --redirects 3" in joined and "--rdzv-backend" not in joined
    assert cmd[-5:] == ["-m", launch.RANK_ENTRY, "pkg.mod", "--x", "1"]  # ranks run behind rank_guard


def test_multi_node_command_passes_rendezvous_through():
    cmd = " ".join(launch.torchrun_command("m", [], nproc=4, nnodes=2, node_rank=1,
                                           rdzv_endpoint="head:29500", log_dir="/tmp/l", run_id="r"))
    assert "--nnodes 2 " in cmd and "--node-rank 1 --rdzv-backend static --rdzv-endpoint head:29500" in cmd
    assert "--master-port" not in cmd


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(nproc=0), "nproc=0"),
    (dict(nproc=2, nnodes=2), "rdzv_endpoint"),
    (dict(nproc=2, timeout_s=0), "timeout_s=0"),
    (dict(nproc=2, nnodes=2, node_rank=2, rdzv_endpoint="h:1"), "node_rank=2"),
])
def test_bad_arguments_are_config_errors(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        launch.run("m", [], **kwargs)


def test_cpu_heavy_runs_get_cores_per_rank_threads(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert launch.cpu_threads(2, cpu_heavy=True) == 4 and launch.cpu_threads(16, cpu_heavy=True) == 1
    assert launch.cpu_threads(2, cpu_heavy=False) == 1
    assert launch._child_env(None, 4)["OMP_NUM_THREADS"] == "4"
    assert launch._child_env({"OMP_NUM_THREADS": "2"}, 4)["OMP_NUM_THREADS"] == "2"  # an explicit env wins
    assert launch._child_env(None)["OMP_NUM_THREADS"] == "1"


def test_cpu_heavy_strategies_are_real_strategy_names():
    from labkit import parallel

    for name in launch.CPU_HEAVY_STRATEGIES:
        parallel.strategy_class(name)  # raises for an unknown name


def test_free_port_can_be_bound():
    import socket

    port = launch.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# ---------------------------------------------------------------- real runs
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raise", "raise_record"])
def test_failing_rank_stops_the_job_and_reports_its_traceback(mode, target_env, pid_dir, log_dir):
    with pytest.raises(LaunchError) as info:
        launch.run(TARGET, [mode], nproc=2, env=target_env, timeout_s=SLOW_S, stream=False, log_dir=log_dir)
    err = info.value
    assert err.rank == 1
    assert "rank 1" in str(err) and "rank 1 exploded on purpose" in str(err)
    assert "Traceback" in err.traceback and "ValueError: rank 1 exploded on purpose" in err.traceback
    assert "Connection closed" not in err.traceback  # rank 0's follow-on error is not the one reported
    assert "did not finish within" not in str(err)  # the failure stopped the job, not the timeout
    assert_nothing_left(pid_dir)


def rank0_printed(log_dir: str, text: str) -> bool:
    return any(text in p.read_text() for p in Path(log_dir).glob("*/attempt_*/0/stdout.log"))


def clock_starts_when_hanging(real_wait, pid_dir: Path, log_dir: str | None = None):
    """`real_wait(..., timeout_s)` once rank 1 of `hang` ignores SIGTERM (and rank 0 printed its sum): a
    timeout test's short clock starts there, not at the launch (the ranks' `import torch` takes a minute
    under load), so the timeout is seconds, not a minute of waiting."""
    def wait(owner, *args):
        *rest, timeout_s = args
        wait_for(lambda: (pid_dir / "hanging").exists() and (log_dir is None or rank0_printed(log_dir, "sum=3")),
                 SLOW_S, "rank 1 of `hang` did not start hanging")
        return real_wait(owner, *rest, timeout_s)
    return wait


@pytest.mark.slow
def test_timeout_kills_every_rank(target_env, pid_dir, log_dir, monkeypatch):
    # rank 1 ignores SIGTERM and sleeps; rank 0 waits for it in a barrier: only the timeout ends this.
    monkeypatch.setattr(launch, "_wait", clock_starts_when_hanging(launch._wait, pid_dir, log_dir))
    with pytest.raises(LaunchError, match=r"timeout_s=3 ") as info:
        launch.run(TARGET, ["hang"], nproc=2, env=target_env, timeout_s=3, stream=False, log_dir=log_dir)
    assert info.value.rank is None
    assert "rank 0 of 2: sum=3" in info.value.output
    assert_nothing_left(pid_dir)


@pytest.mark.slow
def test_success_streams_rank0_output_after_a_taken_port_and_drops_import_noise(target_env, pid_dir, log_dir,
                                                                                 monkeypatch, capsys):
    # Two test workers launching at once can both be handed one port by free_port(); the second store fails,
    # before any rank starts: it is retried on a new one, and that launch is an ordinary success. One launch
    # for three checks: the retry, rank 0's live output, and (target `noisy`) third-party import noise
    # dropped from every rank's output while our own warnings stay.
    import socket

    real = launch.free_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        first = iter([taken.getsockname()[1]])
        monkeypatch.setattr(launch, "free_port", lambda host="127.0.0.1": next(first, None) or real(host))
        result = launch.run(TARGET, ["noisy"], nproc=2, env=target_env, log_dir=log_dir, timeout_s=SLOW_S)
    assert next(first, None) is None  # the taken port was tried
    assert result.returncode == 0
    assert "rank 0 of 2: sum=3" in result.output
    assert "rank 1" not in result.output  # only rank 0 is shown ...
    assert "rank 1 of 2: sum=3" in (Path(result.log_dir) / "1" / "stdout.log").read_text()  # ... all are logged
    assert "rank 0 of 2: sum=3" in capsys.readouterr().out
    rank1 = (Path(result.log_dir) / "1" / "stderr.log").read_text()
    for text in (result.output, rank1):
        assert NOISE not in text
        assert "a warning of our own stays visible" in text
    assert_nothing_left(pid_dir)


_LAUNCHERS: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_launcher_outlives_its_test():
    """A failed test must not leave its launcher's tree behind for the next tests to trip over."""
    yield
    while _LAUNCHERS:
        proc = _LAUNCHERS.pop()
        if proc.poll() is None:
            launch.kill_tree(proc, grace_s=0.5)
        if proc.stdout is not None and not proc.stdout.closed:
            proc.stdout.close()
        proc.wait()


def start_launcher(target_env, log_dir, mode="hang") -> subprocess.Popen:
    """A Python process whose main thread sits in `launch.run` (as a terminal's or a kernel's does).

    SIGINT raises KeyboardInterrupt in it as in a terminal or a Jupyter kernel, even when the suite
    itself was started from a background job (which leaves SIGINT ignored in every child)."""
    code = textwrap.dedent(f"""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from labkit.runtime import launch
        try:
            launch.run({TARGET!r}, [{mode!r}], nproc=2, timeout_s=600, log_dir={log_dir!r})
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **target_env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _LAUNCHERS.append(proc)
    return proc


def wait_for_ranks(pid_dir: Path, proc: subprocess.Popen) -> None:
    wait_for(lambda: len(rank_pids(pid_dir)) == 2 or proc.poll() is not None, SLOW_S, "the ranks did not start")
    assert proc.poll() is None, proc.communicate()[0]


@pytest.mark.slow
@pytest.mark.parametrize("attempt", REPEAT)
def test_keyboard_interrupt_kills_every_rank(attempt, target_env, pid_dir, log_dir):
    proc = start_launcher(target_env, log_dir)
    wait_for_ranks(pid_dir, proc)
    descendants = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGINT)  # what Jupyter's interrupt button sends to the kernel
    # rank 1 ignores SIGTERM: the launcher must escalate, and still hand control back promptly.
    wait_for(lambda: proc.poll() is not None, GONE_S, "the launcher did not return after SIGINT")
    assert "interrupted" in proc.communicate()[0]
    assert_nothing_left(pid_dir, tuple(descendants), within_s=GONE_S)


@pytest.mark.slow
@pytest.mark.parametrize("attempt", REPEAT)
def test_killed_launcher_takes_torchrun_and_ranks_with_it(attempt, target_env, pid_dir, log_dir):
    proc = start_launcher(target_env, log_dir)
    wait_for_ranks(pid_dir, proc)
    descendants = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert len(descendants) >= 3, "torchrun and two ranks"
    proc.kill()  # SIGKILL: no handler runs (a kernel restart, an ssh drop)
    proc.wait()
    assert_nothing_left(pid_dir, tuple(descendants), within_s=GONE_S)


@pytest.mark.slow
def test_killed_cli_leaves_no_rank(tmp_path):
    cmd = [sys.executable, "-m", "labkit", "train", "--strategy", "ddp", "--model", "tiny-resnet", "--nproc", "2",
           "--steps", "100000", "--out", str(tmp_path / "runs")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "cli.log", "w"))
    try:
        def ranks() -> list[psutil.Process]:
            return [c for c in psutil.Process(proc.pid).children(recursive=True)
                    if launch.RANK_ENTRY in command_line(c)]
        # >= 2: forked data-loader workers of a rank share its command line
        wait_for(lambda: len(ranks()) >= 2 or proc.poll() is not None, SLOW_S, "the CLI's ranks did not start")
        assert proc.poll() is None, (tmp_path / "cli.log").read_text()[-2000:]
        descendants = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(descendants) >= 3, "torchrun and two ranks"
    finally:
        proc.kill()
        proc.wait()
    wait_for(lambda: not [p for p in descendants if running(p)], GONE_S,
             f"torchrun or ranks outlived the killed CLI: {[p for p in descendants if running(p)]}")


@pytest.mark.slow
def test_killed_caller_of_accelerate_launch_leaves_no_rank(tmp_path):
    code = (f"from labkit.parallel import accelerate_fsdp\n"
            f"accelerate_fsdp.run('fsdp', 'tiny-llama', steps=100000, out={str(tmp_path / 'runs')!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def ranks() -> list[psutil.Process]:
            return [c for c in psutil.Process(proc.pid).children(recursive=True)
                    if "labkit.parallel.accelerate_fsdp" in command_line(c)]
        # >= 3: accelerate launch itself (its command line names the module too) and two ranks
        wait_for(lambda: len(ranks()) >= 3 or proc.poll() is not None, SLOW_S, "accelerate's ranks did not start")
        assert proc.poll() is None, "the run ended before it could be killed"
        descendants = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(descendants) >= 3
    finally:
        proc.kill()
        proc.wait()
    wait_for(lambda: not [p for p in descendants if running(p)], GONE_S,
             f"accelerate or its ranks outlived the killed caller: {[p for p in descendants if running(p)]}")


@pytest.mark.slow
def test_killed_kernel_leaves_no_rank(target_env, pid_dir, log_dir):
    from jupyter_client.manager import KernelManager

    from conftest import KERNEL

    km = KernelManager(kernel_name=KERNEL)
    km.start_kernel(env={**os.environ, **target_env})
    try:
        client = km.client()
        client.start_channels()
        client.wait_for_ready(timeout=SLOW_S)
        client.execute(f"from labkit.runtime import launch\n"
                       f"launch.run({TARGET!r}, ['hang'], nproc=2, timeout_s=600, log_dir={log_dir!r})")
        kernel_pid = km.provisioner.process.pid
        wait_for(lambda: len(rank_pids(pid_dir)) == 2, SLOW_S, "the kernel's ranks did not start")
        descendants = [c.pid for c in psutil.Process(kernel_pid).children(recursive=True)]
        os.kill(kernel_pid, signal.SIGKILL)  # what a kernel restart or "shut down kernel" ends with
        client.stop_channels()
    finally:
        km.shutdown_kernel(now=True)
    assert_nothing_left(pid_dir, tuple(descendants), within_s=GONE_S)


@pytest.mark.slow
@pytest.mark.parametrize("attempt", REPEAT)
def test_two_nodes_meet_and_node0_holds_rank0(attempt, target_env, pid_dir, log_dir):
    # Two launcher calls = two "nodes" of one rank each on this machine, as `labkit launch emit` runs them.
    # Node 1 starts first (lower pid): with c10d rendezvous it would become global rank 0.
    from concurrent.futures import ThreadPoolExecutor

    endpoint = f"127.0.0.1:{launch.free_port()}"

    def node(rank: int):
        return launch.run(TARGET, ["ok"], nproc=1, nnodes=2, node_rank=rank, rdzv_endpoint=endpoint,
                          env=target_env, timeout_s=SLOW_S, stream=False, log_dir=log_dir)

    with ThreadPoolExecutor(2) as pool:
        other, head = pool.map(node, [1, 0])
    assert "rank 0 of 2: sum=3" in head.output and "rank 1 of 2: sum=3" in other.output
    assert Path(head.log_dir).parts[-3] == "node0" and Path(other.log_dir).parts[-3] == "node1"
    assert_nothing_left(pid_dir)


@pytest.mark.slow
def test_notebook_drops_import_noise_and_shows_rank0_output_in_its_cell(run_cells, target_env, log_dir):
    # one kernel for both checks (a kernel is a Python process importing labkit)
    env = {k: v for k, v in target_env.items() if k == "PYTHONPATH"}
    nb = run_cells("import labkit\nimport peft\nprint('imported')",
                   f"from labkit.runtime import launch\n"
                   f"result = launch.run({TARGET!r}, ['ok'], nproc=2, env={env!r}, timeout_s=120,\n"
                   f"                    log_dir={log_dir!r})\n"
                   f"print('returncode', result.returncode)")
    text = stream_text(nb.cells[0])
    assert "imported" in text and NOISE not in text
    text = stream_text(nb.cells[1])
    assert "rank 0 of 2: sum=3" in text and "returncode 0" in text


# ---------------------------------------------------------------- labkit launch emit
TRAIN_ARGS = ["--strategy", "ddp", "--profile", "a100x4", "--note", "it's $HOME"]


def expand(command: str, env: dict[str, str]) -> list[str]:
    """The argv `labkit` receives when bash runs `command` with `env` (labkit stubbed to print its args)."""
    stub = "labkit() { printf '%s\\n' \"$@\"; }; export -f labkit; "
    out = subprocess.run(["bash", "-c", stub + command], env={"PATH": os.environ["PATH"], **env},
                         capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def test_emit_slurm_runs_labkit_train_on_every_node_with_rendezvous():
    from labkit.cli.launch import slurm_script

    script = slurm_script(TRAIN_ARGS, nodes=2, gpus_per_node=4, job_name="ddp-run", time="02:30:00")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in ("--job-name=ddp-run", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4",
                      "--time=02:30:00"):
        assert f"#SBATCH {directive}" in lines
    assert any(line.startswith("export HEAD_NODE=$(scontrol show hostnames") for line in lines)
    srun = [line for line in lines if line.startswith("srun ")]
    assert len(srun) == 1 and srun[0].startswith("srun --nodes=2 --ntasks-per-node=1 bash -c ")
    # what node 1 of 2 actually runs once srun starts the task there
    argv = expand(srun[0].removeprefix("srun --nodes=2 --ntasks-per-node=1 "),
                  {"SLURM_NODEID": "1", "SLURM_NNODES": "2", "HEAD_NODE": "gpu-node-a", "HOME": "/root"})
    assert argv == ["train", *TRAIN_ARGS, "--nproc", "4", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                    "gpu-node-a:29500"]


def test_emit_k8s_is_a_pytorchjob_with_master_and_workers():
    import yaml

    from labkit.cli.launch import k8s_manifest

    job = yaml.safe_load(k8s_manifest(["train", *TRAIN_ARGS], nodes=3, gpus_per_node=4, job_name="ddp-run"))
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob", "ddp-run")
    assert job["spec"]["nprocPerNode"] == "4"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert {role: s["replicas"] for role, s in specs.items()} == {"Master": 1, "Worker": 2}
    container = specs["Worker"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["command"][:2] == ["bash", "-c"]
    argv = expand(container["command"][2], {"RANK": "2", "MASTER_ADDR": "ddp-run-master-0",
                                            "MASTER_PORT": "23456", "HOME": "/root"})
    assert argv == ["train", *TRAIN_ARGS, "--nproc", "4", "--nnodes", "3", "--node-rank", "2", "--rdzv-endpoint",
                    "ddp-run-master-0:23456"]


def test_emit_k8s_single_node_has_no_workers():
    import yaml

    from labkit.cli.launch import k8s_manifest

    job = yaml.safe_load(k8s_manifest(["--strategy", "ddp"], nodes=1, gpus_per_node=2))
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(time="2h"), "time='2h'"),
    (dict(job_name="My Job"), "job name 'My Job'"),
    (dict(train_args=["--nnodes", "4"]), "--nnodes"),
    (dict(train_args=["--nproc=4"]), "--gpus-per-node"),
])
def test_emit_rejects_bad_input(kwargs, fragment):
    from labkit.cli.launch import slurm_script

    kwargs = {"train_args": ["--strategy", "ddp"], "nodes": 2, "gpus_per_node": 4, **kwargs}
    with pytest.raises(ConfigError, match=fragment):
        slurm_script(kwargs.pop("train_args"), **kwargs)


def test_emit_cli_writes_the_file(tmp_path):
    from labkit.cli import main

    out = tmp_path / "job.sbatch"
    with pytest.raises(SystemExit) as info:
        main(["launch", "emit", "slurm", "--nodes", "2", "--gpus-per-node", "4", "--out", str(out),
              "--", "--strategy", "ddp"])
    assert info.value.code == 0
    assert "#SBATCH --nodes=2" in out.read_text()
