"""The grading sandbox's file-system isolation (issue 20): hostile submissions in one `--execute` batch.

A hostile student cannot change another's grade, read another submission or the private checks, or write
anywhere but its own scratch space; the honest submissions in the same batch are graded exactly as alone.
"""
from __future__ import annotations

import csv
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import live_children

import labkit
from labkit.cli import cli, main
from labkit.course.grading import isolation, registry, unprivileged
from labkit.course.grading.batch import GradeOptions, run_batch
from labkit.course.grading.isolation import BUBBLEWRAP, MOUNT_NS, NONE, Isolation, View, command, mount_plan
from labkit.errors import GradingError


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


corpus = _load("grading_corpus", "data/grading/corpus.py")
hostile = _load("grading_hostile", "data/grading_hostile/hostile.py")


def _require_bubblewrap() -> Isolation:
    iso = isolation.detect()
    assert iso.level == BUBBLEWRAP, f"these tests need bubblewrap (`make test` installs it): {iso.detail}"
    return iso


def _sandboxed(level: str, view: View, script: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(Isolation(level, level, True), view, ["sh", "-c", script]), capture_output=True,
                          text=True, timeout=60)


@pytest.fixture(params=[BUBBLEWRAP, MOUNT_NS])
def level(request):
    """Both file-system isolation levels, each required: bubblewrap (installed by `make test`) and its
    fallback through plain `unshare` (util-linux, always present)."""
    if request.param == BUBBLEWRAP:
        _require_bubblewrap()
    else:
        assert isolation._probe(MOUNT_NS, False) is None, "unshare cannot build a mount namespace here"
    return request.param


def test_only_the_system_and_shown_paths_exist_read_only_and_only_scratch_is_writable(tmp_path, level):
    home, out, scratch = tmp_path / "home", tmp_path / "out", tmp_path / "scratch"
    for d in (home / "venv", out, scratch):
        d.mkdir(parents=True)
    (home / "venv" / "lib.py").write_text("needed")
    (home / "venv" / "checks.py").write_text("private")  # a private file inside a shown directory
    (home / "venv" / "hidden").mkdir()  # a private directory inside it
    (home / "venv" / "hidden" / "tests.py").write_text("private")
    (home / "notes.txt").write_text("instructor's")  # beside the shown directory: not shown
    (out / "grades.csv").write_text("grades")
    view = View(scratch, 2**20, private=(out, home / "venv" / "checks.py", home / "venv" / "hidden"),
                shown=(home / "venv",))
    assert ("bind", home / "venv", str(home / "venv")) in mount_plan(view)
    tree = Path(labkit.__file__).resolve().parents[1]  # the source tree: only its labkit/ is shown
    probe = _sandboxed(level, view, f"""
        cat {home}/venv/lib.py; echo
        for p in {home}/venv/checks.py {home}/venv/hidden/tests.py {home}/notes.txt {out}/grades.csv \
                 {tree}/notebooks {tree}/tests {tree}/pyproject.toml; do
            {{ test -f $p && test -s $p; }} || {{ test -d $p && test -n "$(ls -A $p)"; }} && echo "SEEN $p"; done
        for p in {home}/venv/x {tmp_path}/x {out}/x /x /usr/x; do touch $p 2>/dev/null && echo "WROTE $p"; done
        touch {scratch}/ok && echo scratch-writable
        umount {home}/venv 2>/dev/null && echo UNMOUNTED; grep CapEff /proc/self/status""")
    assert probe.stdout.split() == ["needed", "scratch-writable", "CapEff:", "0" * 16], probe.stdout + probe.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(
        ["home", "out", "scratch", "venv", "lib.py", "checks.py", "hidden", "tests.py", "notes.txt", "grades.csv"])


def test_scratch_is_a_capped_tmpfs(tmp_path, level):
    view = View(tmp_path, 4 * 2**20)
    probe = _sandboxed(level, view, f"head -c 8M /dev/zero > {tmp_path}/fill; echo rc=$?")
    assert "No space left on device" in probe.stderr and "rc=1" in probe.stdout
    assert list(tmp_path.iterdir()) == []  # a fresh tmpfs: nothing reached the host directory


def test_execute_without_isolation_is_refused_unless_accepted(tmp_path, monkeypatch, capsys):
    none = Isolation(NONE, "file system NOT isolated (bubblewrap not installed)", False)
    monkeypatch.setattr(isolation, "detect", lambda network=False: none)
    (tmp_path / "subs" / "ann").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_info:
        main(["grade", str(tmp_path / "subs"), "--out", str(tmp_path / "out"), "--execute"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--execute needs a sandbox" in err and "--unsafe-no-isolation" in err
    # Accepted: the batch runs (nothing to execute here) and says what it ran under.
    res = CliRunner().invoke(cli, ["grade", str(tmp_path / "subs"), "--out", str(tmp_path / "out"), "--execute",
                                   "--unsafe-no-isolation"])
    assert res.exit_code == 0 and "isolation: none (file system NOT isolated" in res.output


def test_an_original_changed_during_the_batch_is_noted_and_the_copy_graded(tmp_path):
    registry.register(corpus.DEMO, corpus.demo_checks())
    try:
        ann = corpus.write(tmp_path / "subs", "ann", corpus.demo_notebook())
        bob = corpus.write(tmp_path / "subs", "bob", corpus.demo_notebook())
        received_sha = hashlib.sha256(bob.read_bytes()).hexdigest()

        def overwrite_bob(row):  # ann is graded first (one worker, student order)
            if row.student == "ann":
                bob.write_text("{}")

        result = run_batch(tmp_path / "subs", tmp_path / "out", GradeOptions(workers=1), progress=overwrite_bob)
    finally:
        registry.unregister(corpus.DEMO)
    rows = {r.student: r for r in result.rows}
    assert rows["bob"].status == rows["ann"].status != "invalid" and rows["bob"].score == rows["ann"].score
    assert "changed while the batch ran" in rows["bob"].detail and received_sha[:12] in rows["bob"].detail
    assert "changed" not in rows["ann"].detail and ann.exists()
    with (tmp_path / "out" / "received.csv").open(newline="") as fh:
        received = {r["student"]: r for r in csv.DictReader(fh)}
    assert received["bob"]["sha256"] == received_sha and received["bob"]["changed_during_batch"] == "yes"
    assert received["ann"]["changed_during_batch"] == "no"


def _grades(out: Path) -> dict[str, dict[str, str]]:
    with (out / "grades.csv").open(newline="") as fh:
        return {r["student"]: r for r in csv.DictReader(fh)}


def _same_row(a: dict[str, str], b: dict[str, str]) -> bool:
    return all(a[k] == b[k] for k in ("notebook", "score", "max_score", "status", "detail"))


@pytest.mark.slow
def test_hostile_submissions_touch_nothing_but_their_own_row(tmp_path):
    _require_bubblewrap()
    subs, out, checks = tmp_path / "subs", tmp_path / "out", tmp_path / "private" / "checks.py"
    checks.parent.mkdir()
    checks.write_text(hostile.PRIVATE_CHECKS)
    outside = Path(labkit.__file__).parent / "HOSTILE_WAS_HERE"
    honest = corpus.demo_notebook()
    for student in ("ann", "bob"):
        corpus.write(subs, student, honest)
    attacks = hostile.cells(neighbour=subs / "bob" / f"{corpus.DEMO}.ipynb",
                            other=subs / "ann" / f"{corpus.DEMO}.ipynb", checks=checks, out=out, outside=outside,
                            grader_pid=os.getpid())
    for student, cell in attacks.items():
        corpus.write(subs, student, corpus.demo_notebook(extra=cell))
    before = {p: p.read_bytes() for p in subs.rglob("*.ipynb")}
    registry.register(corpus.DEMO, corpus.demo_checks())
    try:
        res = CliRunner().invoke(cli, ["grade", str(subs), "--out", str(out), "--execute", "--workers", "2",
                                       "--timeout", "60", "--memory-gib", "1.5", "--scratch-mib", "64",
                                       "--checks", str(checks)])
        assert res.exit_code == 0, res.output
        alone = run_batch(_one(subs, "ann", tmp_path / "alone"), tmp_path / "alone_out",
                          GradeOptions(execute=True, limits=_limits()))
    finally:
        registry.unregister(corpus.DEMO)
    assert "isolation: bubblewrap" in res.output
    rows = _grades(out)
    assert set(rows) == {"ann", "bob", *attacks}
    # The honest students: graded exactly as alone (private check included), whatever their neighbours did.
    alone_row = _grades(tmp_path / "alone_out")["ann"]
    assert alone_row["status"] == "graded" and float(alone_row["score"]) == corpus.TOTAL_POINTS + 1
    assert _same_row(rows["ann"], alone_row) and _same_row(rows["bob"], alone_row)
    assert [r.status for r in alone.rows] == ["graded"]
    # Every hostile one: its own row, with the reason its attack failed.
    reasons = {s: rows[s]["detail"] for s in attacks}
    assert all(rows[s]["status"] == "error" for s in attacks), reasons
    for student in ("peeker", "checkreader"):  # not there at all, not merely unreadable
        assert "cell 4 raised FileNotFoundError" in reasons[student], reasons[student]
    for student in ("overwriter", "outwriter"):
        assert any(f"cell 4 raised {e}" in reasons[student] for e in ("FileNotFoundError", "OSError: [Errno 30]"))
    assert "cell 4 raised OSError: [Errno 30] Read-only file system" in reasons["outsider"]
    assert "No space left on device" in reasons["filler"]
    assert "executor was killed (SIGKILL)" in reasons["parentkiller"]
    assert "cell 4 raised ProcessLookupError" in reasons["graderkiller"]
    # Nothing outside the batch's own outputs changed; the private checks reached no file the batch wrote.
    assert {p: p.read_bytes() for p in subs.rglob("*.ipynb")} == before and not outside.exists()
    written = b"".join(p.read_bytes() for p in out.rglob("*") if p.is_file())
    assert hostile.PRIVATE_MARK.encode() not in written and b"0.4242, rtol" not in written
    with (out / "received.csv").open(newline="") as fh:
        assert {r["changed_during_batch"] for r in csv.DictReader(fh)} == {"no"}
    assert live_children() == []


def _limits():
    from labkit.course.grading.sandbox import Limits
    return Limits(timeout_s=60, memory_bytes=int(1.5 * 2**30), scratch_bytes=64 * 2**20)


def _one(subs: Path, student: str, root: Path) -> Path:
    """A submissions folder holding only `student`'s submission."""
    (root / student).mkdir(parents=True)
    src = subs / student / f"{corpus.DEMO}.ipynb"
    (root / student / src.name).write_bytes(src.read_bytes())
    return root


@pytest.mark.slow
def test_the_unshare_fallback_grades_honest_work_and_stops_hostile_work(tmp_path, monkeypatch):
    assert isolation._probe(MOUNT_NS, False) is None, "unshare cannot build a mount namespace here"
    fallback = Isolation(MOUNT_NS, "unshare (test)", True)
    monkeypatch.setattr(isolation, "detect", lambda network=False: fallback)
    subs, checks = tmp_path / "subs", tmp_path / "private" / "checks.py"
    checks.parent.mkdir()
    checks.write_text(hostile.PRIVATE_CHECKS)
    corpus.write(subs, "ann", corpus.demo_notebook())
    ann = subs / "ann" / f"{corpus.DEMO}.ipynb"
    attacks = hostile.cells(neighbour=ann, other=ann, checks=checks, out=tmp_path / "out",
                            outside=tmp_path / "outside", grader_pid=os.getpid())
    for student in ("overwriter", "checkreader", "filler"):
        corpus.write(subs, student, corpus.demo_notebook(extra=attacks[student]))
    registry.register(corpus.DEMO, corpus.demo_checks())
    try:
        result = run_batch(subs, tmp_path / "out", GradeOptions(execute=True, workers=2, limits=_limits(),
                                                                 private=(str(checks),)))
    finally:
        registry.unregister(corpus.DEMO)
    rows = {r.student: r for r in result.rows}
    assert result.isolation == fallback
    assert (rows["ann"].status, rows["ann"].score) == ("graded", corpus.TOTAL_POINTS), rows["ann"].detail
    assert "cell 4 raised FileNotFoundError" in rows["checkreader"].detail
    assert "cell 4 raised" in rows["overwriter"].detail and "No space left on device" in rows["filler"].detail
    assert all(rows[s].status == "error" for s in ("overwriter", "checkreader", "filler"))


def test_each_execution_gets_a_private_copy_of_the_torch_extensions_cache(tmp_path, monkeypatch):
    """DeepSpeed takes a lock file in TORCH_EXTENSIONS_DIR even to load a built op: read-only there, so the
    executor copies the cache into its scratch (a stale lock left out: it would make the load wait forever)."""
    from labkit.course.grading.sandbox import _private_extensions

    cache, scratch = tmp_path / "ext", tmp_path / "scratch"
    (cache / "cpu_adam").mkdir(parents=True)
    (cache / "cpu_adam" / "cpu_adam.so").write_bytes(b"\x7fELF")
    (cache / "cpu_adam" / "lock").touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    _private_extensions(scratch)
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(scratch / "torch_extensions")
    assert sorted(p.name for p in (scratch / "torch_extensions").rglob("*")) == ["cpu_adam", "cpu_adam.so"]


# ---------------------------------------------------------------- level unprivileged-user (no namespaces)
NOBODY = unprivileged.User("nobody", 65534, 65534)


@pytest.fixture
def shared_tmp():
    """A folder every user can traverse (pytest's tmp_path lies in a 0700 one), removed after the test."""
    folder = Path(tempfile.mkdtemp(prefix="labkit-unpriv-"))
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_what_the_student_user_can_open_follows_the_modes_of_the_path_and_every_folder_above(shared_tmp):
    (shared_tmp / "open").mkdir(mode=0o755)
    (shared_tmp / "open" / "tests.py").write_text("hidden")
    (shared_tmp / "closed").mkdir(mode=0o700)
    (shared_tmp / "closed" / "tests.py").write_text("hidden")
    os.chmod(shared_tmp / "open" / "tests.py", 0o644)
    os.chmod(shared_tmp / "closed" / "tests.py", 0o644)  # readable itself, but its folder is closed
    assert unprivileged.reachable(shared_tmp / "open" / "tests.py", NOBODY)
    assert not unprivileged.reachable(shared_tmp / "closed" / "tests.py", NOBODY)
    assert not unprivileged.reachable(shared_tmp / "missing", NOBODY)
    private = [shared_tmp / "open", shared_tmp / "closed", shared_tmp / "missing"]
    assert unprivileged.exposed(private, NOBODY) == [shared_tmp / "open"]
    assert unprivileged.closed([shared_tmp / "open", shared_tmp / "closed" / "tests.py"], NOBODY) == \
        [shared_tmp / "closed" / "tests.py"]
    message = unprivileged.exposed_message([shared_tmp / "open"], NOBODY)
    assert f"chmod go-rwx '{shared_tmp / 'open'}'" in message and "nobody (uid 65534)" in message


def test_the_student_user_runs_without_privileges_and_a_readable_private_path_is_refused(shared_tmp):
    user = unprivileged.sandbox_user()
    if user is None:
        pytest.skip(f"none of the users {unprivileged.SANDBOX_USERS} exists here")
    cmd = unprivileged.command(user, ["python3", "-c", "pass"], tasks=64)
    i = cmd.index(next(c for c in cmd if c.endswith("setpriv")))
    assert cmd[i + 1:i + 7] == [f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--no-new-privs",
                                "--inh-caps=-all", "--pdeathsig=keep"] and cmd[-3:] == ["python3", "-c", "pass"]
    (shared_tmp / "hidden").mkdir(mode=0o755)
    view = View(shared_tmp / "scratch", 2**20, private=(shared_tmp / "hidden",))
    with pytest.raises(GradingError, match="chmod go-rwx"):
        command(Isolation(isolation.UNPRIVILEGED, "", False), view, ["true"])
    os.chmod(shared_tmp / "hidden", 0o700)
    assert command(Isolation(isolation.UNPRIVILEGED, "", False), view, ["true"])[-1] == "true"


def test_the_unprivileged_level_says_why_it_cannot_run_here_or_runs(shared_tmp):
    """Root with a sandbox user that can read this Python and labkit gets the level (the probe imports the
    sandbox as that user); otherwise one line says what is missing. A private checkout or a Python in root's
    home (pyenv) is the usual reason on a developer's machine: tests/test_grading_container.py then shows it."""
    found = isolation._unprivileged_level(False, "no namespaces")
    user = unprivileged.sandbox_user()
    needed = [sys.executable, *isolation.runtime_paths("labkit"), isolation.labkit_path().split(os.pathsep)[0]]
    if os.geteuid() != 0:
        assert found == f"{isolation.UNPRIVILEGED} needs a grader running as root (to start the student's code as another user)"
    elif user is None:
        assert "useradd --system labkit-student" in found
    elif unprivileged.closed(needed, user):
        assert found.startswith(f"{isolation.UNPRIVILEGED}: user {user} cannot read "), found
    else:
        assert isinstance(found, Isolation) and found.level == isolation.UNPRIVILEGED, found
        assert "network NOT cut" in found.detail and not found.network_isolated
        scratch = isolation.scratch_dir(found, shared_tmp)
        assert scratch.stat().st_uid == user.uid and scratch.parent == unprivileged.scratch_parent()
        isolation.release_scratch(found, scratch)
        assert not scratch.exists()
