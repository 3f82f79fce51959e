"""One results root, `$LABKIT_RUNS` (issue 25, finding 13): every notebook's `OUT = R.run_dir(...)` line and
`labkit train`'s default --out go there; unset, `runs/` beside the notebook as before. A notebook whose own
folder is read-only (the Apptainer image) writes its results where LABKIT_RUNS points, and without it
stops at its setup cell with the fix, before any run."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit import results
from labkit.errors import ConfigError
from labkit.train.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent


def test_run_dir_is_under_labkit_runs_else_runs_beside_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(results.RUNS_ENV, raising=False)
    assert results.run_dir("03_ddp", "smoke") == os.path.join("runs", "03_ddp", "smoke")
    assert (tmp_path / "runs" / "03_ddp" / "smoke").is_dir()  # created by the setup cell, not by the first run
    monkeypatch.setenv(results.RUNS_ENV, str(tmp_path / "mounted"))
    assert results.run_dir("09_beyond_3d", "a100x4") == str(tmp_path / "mounted" / "09_beyond_3d" / "a100x4")
    assert list((tmp_path / "mounted" / "09_beyond_3d" / "a100x4").iterdir()) == []  # its write test cleans up


def test_an_unwritable_root_names_labkit_runs_before_any_run(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(results.RUNS_ENV, str(tmp_path / "a-file" / "runs"))  # no folder can be made under a file
    with pytest.raises(ConfigError, match="cannot write results to .*set LABKIT_RUNS to a writable folder"):
        results.run_dir("02_single_gpu", "smoke")


def test_labkit_train_writes_to_the_root_unless_out_is_given(tmp_path, monkeypatch):
    from labkit.cli.train import command

    out = next(p for p in command.params if p.name == "out")
    assert out.default == "" and "LABKIT_RUNS" in out.help  # the CLI default is the root, not a fixed "runs"
    monkeypatch.delenv(results.RUNS_ENV, raising=False)
    assert TrainConfig.of(strategy="single", model="tiny-llama").resolve().run.out == "runs"
    monkeypatch.setenv(results.RUNS_ENV, str(tmp_path / "r"))
    assert TrainConfig.of(strategy="single", model="tiny-llama").resolve().run.out == str(tmp_path / "r")
    assert TrainConfig.of(strategy="single", model="tiny-llama", out="mine").resolve().run.out == "mine"


def test_every_lab_notebook_writes_under_run_dir():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        code = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
        outs = re.findall(r"^OUT = .*$", code, re.M)
        assert all("R.run_dir(" in line for line in outs), f"{path.name}: {outs}"
        assert '"runs/' not in code and "'runs/" not in code, f"{path.name} writes to a fixed runs/ path"


def _in_read_only(folder: Path, *argv: str, env: dict) -> subprocess.CompletedProcess:
    """`argv`, run in `folder` while it is bind-mounted read-only over itself in a private user + mount
    namespace (root ignores file modes, not a read-only mount): the folder of an Apptainer image."""
    if shutil.which("unshare") is None:
        pytest.fail("util-linux `unshare` is needed to make a read-only folder (apt-get install util-linux)")
    script = 'mount --bind -o ro "$0" "$0" && cd "$0" && exec "$@"'
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, str(folder), *argv],
                          capture_output=True, text=True, env=env, timeout=600)


#: The record the training loop appends (labkit.train.loop: `results.append(record, cfg.run.out)`), without
#: paying for a training run: what is tested is where it lands.
_CELL = """import labkit.results as R
OUT = R.run_dir("99_tiny", PROFILE)
R.append(R.RunRecord(strategy="single", model="tiny-llama", profile=PROFILE, world_size=1, steps=1, losses=[1.0],
                     step_time_s=0.1, samples_per_s=1.0, peak_bytes=[0], param_bytes=[0], grad_bytes=[0],
                     optimizer_bytes=[0], trainable_params=0, device="cpu", dtype="float32"), OUT)"""


@pytest.mark.slow
def test_a_notebook_in_a_read_only_folder_keeps_its_results_in_labkit_runs(tmp_path):
    from labkit.course.notebooks import build_notebook

    nb_dir = tmp_path / "image" / "notebooks"
    nb_dir.mkdir(parents=True)
    nbformat.write(build_notebook("Results beside a read-only notebook", [_CELL]), nb_dir / "tiny.ipynb")
    env = {**os.environ, "PYTHONPATH": str(ROOT), results.RUNS_ENV: str(tmp_path / "mounted")}

    proc = _in_read_only(nb_dir, sys.executable, "-m", "labkit", "notebooks", "run", str(nb_dir / "tiny.ipynb"),
                         "--out", str(tmp_path / "executed"), env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [line] = (tmp_path / "mounted" / "99_tiny" / "smoke" / "results.jsonl").read_text().splitlines()
    assert json.loads(line)["strategy"] == "single"
    assert sorted(p.name for p in nb_dir.iterdir()) == ["tiny.ipynb"]  # nothing written beside it

    # Without LABKIT_RUNS it is runs/ beside the read-only notebook: the setup line stops, naming the fix.
    env.pop(results.RUNS_ENV)
    proc = _in_read_only(nb_dir, sys.executable, "-c", "import labkit.results as R; R.run_dir('99_tiny', 'smoke')",
                         env=env)
    assert proc.returncode != 0 and "set LABKIT_RUNS to a writable folder" in proc.stderr, proc.stderr[-2000:]
