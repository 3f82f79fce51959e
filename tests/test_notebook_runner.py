"""The notebook runner, hygiene check and cleaner (labkit.course.notebooks, notebook_hygiene) on throwaway
notebooks."""
from __future__ import annotations

import json
import os

import nbformat
import pytest

from labkit.course import notebook_hygiene as hygiene
from labkit.course import notebooks as nbk
from labkit.cli import main
from labkit.errors import ConfigError, NotebookError
from labkit.results import from_notebook

# Cell 0 is the title and cell 1 the parameters cell (build_notebook), so the body starts at cell 2.
PASSING = [
    "import os\nfrom labkit.results import answer",
    'answer("profile", PROFILE); answer("extra", EXTRA)\n'
    'answer("cwd", os.getcwd()); answer("mpl", os.environ.get("MPLBACKEND"))',
    ("markdown", "The end."),
]
FAILING = ["1 / 0", "print('never runs')"]


def write(path, cells, **kw):
    nbformat.write(nbk.build_notebook("Throwaway", cells, **kw), path)
    return path


def answers(path) -> dict:
    nb = nbformat.read(path, as_version=4)
    return {p["key"]: p["value"] for p in from_notebook(nb) if p["kind"] == "answer"}


@pytest.fixture(scope="module")
def nbdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("nbs")
    write(d / "10_pass.ipynb", PASSING, parameters='PROFILE = "smoke"\nEXTRA = 0')
    write(d / "20_fail.ipynb", FAILING)
    return d


@pytest.fixture(scope="module")
def runs(nbdir, tmp_path_factory):
    """One run of both notebooks, the failing one first: the runner must go on after a failure."""
    out = tmp_path_factory.mktemp("executed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MPLBACKEND", "TkAgg")  # the runner must hand the kernel Agg whatever we have
        result = nbk.run_notebooks(["20_fail", "10_pass"], profile="a100x4", out_dir=out, notebook_dir=nbdir,
                                   parameters={"EXTRA": 7}, timeout_s=120)
        assert os.environ["MPLBACKEND"] == "TkAgg"  # and restore ours afterwards
    return {r.name: r for r in result}


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_passing_notebook_is_ok_and_its_executed_copy_kept(runs, nbdir):
    run = runs["10_pass"]
    assert run.ok and run.status == "ok" and run.cell is None and run.ename == ""
    assert run.output.is_file() and run.output.name == "10_pass.ipynb"
    got = answers(run.output)
    # PROFILE and extra parameters are injected; the kernel runs in the notebook's folder, with Agg.
    assert got == {"profile": "a100x4", "extra": 7, "cwd": str(nbdir), "mpl": "Agg"}


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_failing_notebook_names_cell_2_and_the_exception(runs):
    run = runs["20_fail"]
    assert run.status == "failed" and not run.ok
    assert (run.cell, run.ename, run.evalue) == (2, "ZeroDivisionError", "division by zero")
    assert run.exec_count == 3  # In [3]: papermill's injected-parameters cell ran as In [2]
    assert "ZeroDivisionError" in run.traceback and "\x1b[" not in run.traceback
    line = run.describe()
    assert "20_fail" in line and "cell 2" in line and "ZeroDivisionError: division by zero" in line
    assert str(run.output) in line


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_failed_executed_copy_is_kept_with_the_traceback_in_place(runs):
    nb = nbformat.read(runs["20_fail"].output, as_version=4)
    errors = [c.source for c in nb.cells if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"]
    assert errors == ["1 / 0"]
    never = [c for c in nb.cells if c.source == "print('never runs')"]
    assert len(never) == 1 and never[0].outputs == []  # execution stopped at the failure


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_format_runs_is_a_table_with_every_notebook(runs):
    text = nbk.format_runs(list(runs.values()))
    header, *rows = text.splitlines()
    assert header.split() == ["notebook", "status", "seconds", "cpu", "s", "failure"]
    assert [r.split()[:2] for r in rows] == [["20_fail", "failed"], ["10_pass", "ok"]]
    assert all(r.cpu_seconds > 0 for r in runs.values())  # the kernel's own CPU time, reaped with it
    assert "cell 2: ZeroDivisionError" in rows[0]


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_timeout_fails_the_notebook_at_the_stuck_cell(tmp_path):
    path = write(tmp_path / "slow.ipynb", ["x = 1", "import time\ntime.sleep(600)"])
    run = nbk.run_notebook(path, out_dir=tmp_path / "out", timeout_s=2)
    assert run.status == "failed" and run.cell == 3 and run.ename == "CellTimeoutError"
    assert run.output.is_file()


def test_missing_kernel_fails_before_any_cell_and_keeps_the_copy(nbdir, tmp_path):
    run = nbk.run_notebook(nbdir / "10_pass.ipynb", kernel="no-such-kernel", out_dir=tmp_path)
    assert run.status == "failed" and run.cell is None and run.ename == "NoSuchKernel"
    assert run.output.is_file() and "before any cell ran" in run.describe()


def test_an_output_folder_that_is_the_notebooks_own_is_refused_and_the_notebook_kept(nbdir):
    """The executed copy is written over `out_dir/<name>.ipynb` (an earlier copy is deleted first): with the
    notebook's own folder that would be the student's notebook (seen: a test lost its notebook so)."""
    path = nbdir / "10_pass.ipynb"
    before = path.read_bytes()
    with pytest.raises(ConfigError, match="choose another output folder"):
        nbk.run_notebook(path, out_dir=nbdir)
    assert path.read_bytes() == before


def test_unknown_profile_or_contradicting_parameter_fails_before_running(nbdir, tmp_path):
    with pytest.raises(ConfigError, match="valid profiles are"):
        nbk.run_notebooks(["10_pass"], profile="a100x9", notebook_dir=nbdir, out_dir=tmp_path)
    with pytest.raises(ConfigError, match="contradicts"):
        nbk.run_notebook(nbdir / "10_pass.ipynb", profile="smoke", parameters={"PROFILE": "a100x4"},
                         out_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_find_notebooks_accepts_name_file_name_number_and_path(nbdir):
    want = [nbdir / "10_pass.ipynb"]
    for name in ("10_pass", "10_pass.ipynb", "10", str(nbdir / "10_pass.ipynb")):
        assert nbk.find_notebooks([name], nbdir) == want
    assert nbk.find_notebooks(None, nbdir) == sorted(nbdir.glob("*.ipynb"))
    assert nbk.find_notebooks(["10", "10_pass"], nbdir) == want  # no duplicates
    with pytest.raises(NotebookError, match=r"unknown notebook '99_nope'.*10_pass, 20_fail"):
        nbk.find_notebooks(["99_nope"], nbdir)


# ---------------------------------------------------------------- hygiene and clean
@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_clean_strips_outputs_and_keeps_every_source(runs, tmp_path):
    dirty = tmp_path / "dirty.ipynb"
    dirty.write_bytes(runs["20_fail"].output.read_bytes())
    before = nbformat.read(dirty, as_version=4)
    assert hygiene.check_hygiene(dirty)  # an executed copy is not committable
    stripped = hygiene.clean(dirty)
    assert any("outputs" in s for s in stripped) and any("execution counts" in s for s in stripped)
    after = nbformat.read(dirty, as_version=4)
    assert all(c.outputs == [] and c.execution_count is None for c in after.cells if c.cell_type == "code")
    assert "papermill" not in after.metadata
    kept = lambda nb: [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in nb.cells  # noqa: E731
                       if nbk.ERROR_MARKER_TAG not in c.metadata.get("tags", [])]
    assert kept(after) == kept(before)  # only papermill's banners went; the injected cell is the author's call
    problems = hygiene.check_hygiene(dirty)
    assert len(problems) == 1 and "papermill injected" in problems[0]
    text = dirty.read_text()
    assert hygiene.clean(dirty) == [] and dirty.read_text() == text  # idempotent, no rewrite when clean


def test_built_notebooks_are_clean(nbdir):
    for path in nbdir.glob("*.ipynb"):
        assert hygiene.check_hygiene(path) == []


def _edit(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _params(data):
    return next(c for c in data["cells"] if "parameters" in c["metadata"].get("tags", []))


BREAKAGES = {
    "outputs": (lambda d: d["cells"][2].update(outputs=[{"output_type": "stream", "name": "stdout", "text": "2\n"}]),
                "have outputs"),
    "execution count": (lambda d: d["cells"][2].update(execution_count=4), "have execution counts"),
    "no parameters cell": (lambda d: _params(d)["metadata"].update(tags=[]), "0 cells are tagged `parameters`"),
    "two parameters cells": (lambda d: d["cells"][2]["metadata"].update(tags=["parameters"]),
                             "2 cells are tagged `parameters`"),
    "no smoke profile": (lambda d: _params(d).update(source='PROFILE = "a100x4"'), 'PROFILE = "smoke"'),
    "wrong kernel": (lambda d: d["metadata"]["kernelspec"].update(name="python3"), "kernelspec is 'python3'"),
    "invalid nbformat": (lambda d: d["cells"][2].update(bogus=1), "invalid nbformat"),
    "no title": (lambda d: d["cells"].pop(0), "markdown title"),
    "papermill metadata": (lambda d: d["metadata"].update(papermill={"duration": 1.0}), "comes from an execution"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_check_hygiene_reports_each_broken_rule(tmp_path, breakage):
    change, message = BREAKAGES[breakage]
    path = write(tmp_path / "nb.ipynb", ["1 + 1"])
    assert hygiene.check_hygiene(path) == []
    _edit(path, change)
    problems = hygiene.check_hygiene(path)
    assert any(message in p for p in problems), problems


def test_check_hygiene_reports_an_unreadable_file(tmp_path):
    path = tmp_path / "broken.ipynb"
    path.write_text("{not json")
    assert "not a readable notebook" in hygiene.check_hygiene(path)[0]
    with pytest.raises(NotebookError, match="not a readable notebook"):
        hygiene.clean(path)


# ---------------------------------------------------------------- CLI exit codes
def cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(["notebooks", *args])
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_cli_run_exits_1_naming_the_failed_notebook_and_cell(capsys, nbdir, tmp_path):
    code, out, err = cli(capsys, "run", str(nbdir / "20_fail.ipynb"), str(nbdir / "10_pass.ipynb"),
                         "--out", str(tmp_path))
    assert code == 1
    assert [line.split()[:2] for line in out.splitlines()[1:]] == [["20_fail", "failed"], ["10_pass", "ok"]]
    assert "1 of 2 notebooks failed" in err and "20_fail: failed at cell 2" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["10_pass.ipynb", "20_fail.ipynb"]


@pytest.mark.slow  # starts ranks or a kernel: not in `make test-fast`
def test_cli_run_exits_0_when_all_pass_and_reads_parameters_as_yaml(capsys, nbdir, tmp_path):
    code, out, _ = cli(capsys, "run", str(nbdir / "10_pass.ipynb"), "--out", str(tmp_path), "-p", "EXTRA", "42")
    assert code == 0 and out.splitlines()[1].split()[:2] == ["10_pass", "ok"]
    assert answers(tmp_path / "10_pass.ipynb")["extra"] == 42


def test_cli_unknown_notebook_exits_2_listing_the_notebooks(capsys, monkeypatch, tmp_path):
    (tmp_path / "notebooks").mkdir()
    write(tmp_path / "notebooks" / "10_pass.ipynb", PASSING)
    monkeypatch.chdir(tmp_path)  # NAMES are looked up in ./notebooks
    code, _, err = cli(capsys, "run", "99_nope")
    assert code == 2 and "unknown notebook '99_nope'" in err and "10_pass" in err


def test_cli_check_and_clean_exit_codes(capsys, tmp_path):
    clean_nb = write(tmp_path / "clean.ipynb", ["1 + 1"])
    dirty = write(tmp_path / "dirty.ipynb", ["1 + 1"])
    _edit(dirty, BREAKAGES["outputs"][0])
    assert cli(capsys, "check", str(clean_nb))[0] == 0
    code, out, _ = cli(capsys, "check", str(clean_nb), str(dirty))
    assert code == 1 and "dirty.ipynb: 1 problem(s)" in out and "have outputs" in out
    # an unmatched shell glob (an empty reservations/) is not an error; a missing file is
    code, out, _ = cli(capsys, "clean", str(dirty), str(tmp_path / "empty" / "*.ipynb"))
    assert code == 0 and "stripped outputs of 1 cell(s)" in out
    assert cli(capsys, "check", str(dirty))[0] == 0
    code, _, err = cli(capsys, "clean", str(tmp_path / "missing.ipynb"))
    assert code == 2 and "no notebook at" in err
