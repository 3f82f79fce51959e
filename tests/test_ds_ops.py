"""DeepSpeed's CPU ops built ahead (`make ds-ops`, labkit/parallel/ds_ops.py) are the ones the runtime loads."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.parallel import ds_ops

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_runtime_loads_the_ops_built_ahead_without_rebuilding(tmp_path):
    """Build into a folder, then load as DeepSpeed's runtime does (DeepSpeedCPUAdam's own import path and
    the communication backend's builder): nothing is compiled again (same sources and flags)."""
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or ROOT / "build" / "torch_extensions")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), "DS_ACCELERATOR": "cpu"}
    ahead = subprocess.run([sys.executable, "-m", "labkit.parallel.ds_ops"], env=env, capture_output=True,
                           text=True, timeout=1800)
    assert ahead.returncode == 0 and "cpu_adam" in ahead.stdout and "shm_comm" in ahead.stdout, \
        ahead.stdout + ahead.stderr
    libraries = sorted(cache.glob("*/*.so"))
    assert {p.parent.name for p in libraries} >= {"cpu_adam", "deepspeed_shm_comm"}
    before = {p: p.stat().st_mtime_ns for p in libraries}
    runtime = ("from deepspeed.ops.op_builder import CPUAdamBuilder\n"
               "from deepspeed.comm.torch import build_shm_op\n"
               "CPUAdamBuilder().load(verbose=False)\n"
               "assert build_shm_op() is not None\n")
    load = subprocess.run([sys.executable, "-c", runtime], env=env, capture_output=True, text=True, timeout=1800)
    assert load.returncode == 0, load.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in libraries} == before, "the runtime rebuilt an op built ahead"


def test_a_gpu_node_builds_nothing(monkeypatch, capsys):
    monkeypatch.setattr(ds_ops, "has_nvidia_gpu", lambda: True)
    monkeypatch.setattr(ds_ops, "build", lambda *a: pytest.fail("built CPU ops on a GPU node"))
    assert ds_ops.main() == 0
    assert "GPU node" in capsys.readouterr().out


def test_the_wrong_accelerator_is_one_line_naming_the_fix(monkeypatch, capsys):
    from labkit.errors import ConfigError

    def wrong(*_):
        raise ConfigError("DeepSpeed chose accelerator 'cuda': ... DS_ACCELERATOR=cpu")

    monkeypatch.setattr(ds_ops, "has_nvidia_gpu", lambda: False)
    monkeypatch.setattr(ds_ops, "build", wrong)
    assert ds_ops.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DS_ACCELERATOR=cpu" in err


def test_labkit_finds_the_ops_make_lab_built_when_run_outside_make(tmp_path, monkeypatch):
    """`labkit check` / `labkit train` typed in a terminal (TORCH_EXTENSIONS_DIR unset) load the ops of the
    checkout's build/torch_extensions instead of compiling them again into ~/.cache (05's check: 124 s -> 13 s);
    only where `make` built them (the marker), and never over an explicit TORCH_EXTENSIONS_DIR."""
    import os

    import labkit

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    labkit._use_course_ops(tmp_path)
    assert "TORCH_EXTENSIONS_DIR" not in os.environ  # no build there: DeepSpeed's own default
    built = tmp_path / "build" / "torch_extensions"
    built.mkdir(parents=True)
    (built / ".labkit-ds-ops").touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/else")
    labkit._use_course_ops(tmp_path)
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/somewhere/else"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    labkit._use_course_ops(tmp_path)
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(built)
