"""Grade a class: `SUBMISSIONS_DIR/<student>/<notebook>.ipynb` -> exactly one gradebook row per submission.

Nothing a submission holds stops the batch: every failure becomes a row with a status (graded, error,
timeout, invalid, tampered) and a reason. Every submission is first copied into a private workspace
(labkit.course.grading.workspace) and graded from the copy. Submissions are graded in a thread pool (`workers`);
with `execute` each one runs in its own sandboxed process (labkit.course.grading.sandbox) that cannot see the
workspace, the other submissions, the output folder or private checks (labkit.course.grading.isolation).
"""
from __future__ import annotations

import tempfile
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from labkit.course.exercises import grading as exercise_grading
from labkit.errors import ConfigError, GradingError
from labkit.course.grading import (copies, gradebook, isolation, late, manual, questions, report, roster,
                                   sandbox, similarity, tamper, workspace)
from labkit.course.grading.evaluate import (DEFAULT_MAX_BYTES, ERROR, INVALID, MISSING, TAMPERED, TIMEOUT, Grade,
                                     SubmissionProblem, check_identity, grade_notebook, join_reasons,
                                     load_notebook)
from labkit.course.grading.evidence import cell_number, collect, error_of
from labkit.course.grading.gradebook import safe_name
from labkit.course.grading.isolation import Isolation
from labkit.course.grading.late import LatePolicy
from labkit.course.grading.registry import checks_for
from labkit.course.grading.submissions import Submission, find_submissions, with_roster


@dataclass(frozen=True)
class GradeOptions:
    """How `labkit grade` grades: recorded results (default) or a sandboxed re-execution."""

    execute: bool = False
    notebook: str | None = None
    """Grade only `<student>/<notebook>.ipynb` (a student without it gets an `invalid` row)."""
    profile: str = "smoke"
    """PROFILE parameter papermill injects when executing."""
    kernel: str = "labkit"
    workers: int = 1
    limits: sandbox.Limits = field(default_factory=sandbox.Limits)
    max_bytes: int = DEFAULT_MAX_BYTES
    """Largest submitted notebook that is read at all."""
    private: tuple[str, ...] = ()
    """More paths executed notebooks must not see (e.g. the --checks file); the batch's own are always hidden."""
    unsafe_no_isolation: bool = False
    """Execute even without file-system isolation (notebooks can then read and write what the grader can)."""
    autograder: str | None = None
    """Hidden tests of the code exercises (`labkit assign`'s DIR/autograder); None: the source tree's
    notebooks/tests/hidden when it exists. Code tests always run sandboxed, with or without `execute`."""
    exercise_timeout_s: float = 300.0
    """Seconds for all the tests of one code exercise (one sandboxed process per exercise)."""
    export_questions: bool = False
    """Also put the points per question (every check and test) into canvas.csv and gradescope/ (grades.csv
    always has them)."""
    similarity: float = similarity.DEFAULT_THRESHOLD
    """Exercise code this alike (0-1, labkit.course.grading.similarity) puts a pair in review.csv; 0: off."""
    late: LatePolicy | None = None
    """--deadline and its penalty (labkit.course.grading.late); None: nobody is late."""
    marks: str | None = None
    """The TA's marks of manual questions (labkit grade review); None: OUT_DIR/marks.json when it exists."""
    roster: str | None = None
    """CSV of the class (labkit.course.grading.roster): every rostered student gets a row, missing or not."""

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"workers={self.workers!r}; give a positive integer")
        if not 0 <= self.similarity <= 1:
            raise ConfigError(f"--similarity {self.similarity!r}; give a fraction between 0 (off) and 1")


def _max_score(notebook: str, opts: GradeOptions | None = None) -> float:
    code = code_plan(notebook, opts).max_score if opts is not None else 0.0
    try:
        return float(sum(c.points for c in checks_for(notebook))) + code
    except GradingError:
        return code


def code_plan(notebook: str, opts: GradeOptions) -> exercise_grading.Plan:
    return exercise_grading.plan_for_autograder(notebook, opts.autograder)


def _with_code(grade: Grade, nb, sub: Submission, opts: GradeOptions, out_dir: Path, box: Sandboxing | None) -> Grade:
    """The row with the code exercises' tests run (sandboxed) on the submitted exercise cells."""
    plan = code_plan(sub.notebook, opts)
    if not plan.exercises:
        return grade
    box = box or Sandboxing(isolation_for(opts), private_paths(opts))
    grades = exercise_grading.grade_exercises(
        nb, sub.notebook, plan, timeout_s=opts.exercise_timeout_s, memory_bytes=opts.limits.memory_bytes,
        output_bytes=opts.limits.output_bytes, isolation=box.isolation, kernel=opts.kernel,
        private=box.hidden + (out_dir,))
    return exercise_grading.merge(grade, grades)


def private_paths(opts: GradeOptions, *more: Path) -> tuple[Path, ...]:
    """What no sandbox may see, even inside what its view shows (isolation.View.private): `more` (the
    submissions, --out, the workspace), --checks, the hidden tests (--autograder; all of a `labkit assign`
    release around it) and the source tree's notebooks/tests/hidden."""
    paths = [*more, *map(Path, opts.private), exercise_grading.source_tests_dir() / "hidden"]
    hidden = exercise_grading.autograder_dir(opts.autograder)
    if hidden is not None:
        release = hidden.resolve().parent
        paths += [hidden, *([release] if (release / "notebooks").is_dir() and release != Path(release.anchor) else [])]
    return tuple(paths)


@dataclass(frozen=True)
class Sandboxing:
    """How a batch executes: the isolation in use and the paths its notebooks must not see."""

    isolation: Isolation
    hidden: tuple[Path, ...] = ()


def isolation_for(opts: GradeOptions) -> Isolation:
    """The isolation `opts` executes under; ConfigError when there is none and the grader did not accept that."""
    iso = isolation.detect(opts.limits.network)
    if not iso.isolated and not opts.unsafe_no_isolation:
        raise ConfigError(f"--execute needs a sandbox and this machine has none ({iso.detail}); install "
                          "bubblewrap (`sudo apt-get install bubblewrap`), or pass --unsafe-no-isolation to let "
                          "student code read and write everything the grader can")
    return iso


def grade_submission(sub: Submission, opts: GradeOptions, out_dir: Path, box: Sandboxing | None = None) -> Grade:
    """The row for one submission; never raises."""
    try:
        return _grade(sub, opts, out_dir, box)
    except SubmissionProblem as exc:
        return Grade(sub.student, sub.notebook, exc.status, 0.0, _max_score(sub.notebook, opts), str(exc))
    except Exception as exc:  # noqa: BLE001 - the batch never dies; the row says what broke
        return Grade(sub.student, sub.notebook, ERROR, 0.0, _max_score(sub.notebook, opts),
                     f"grader error ({type(exc).__name__}: {str(exc)[:200]}); please report it")


def _grade(sub: Submission, opts: GradeOptions, out_dir: Path, box: Sandboxing | None) -> Grade:
    if sub.missing:
        raise SubmissionProblem(MISSING, "not submitted")
    if sub.problem:
        raise SubmissionProblem(INVALID, sub.problem)
    if sub.path is None:
        what = f"{sub.notebook}.ipynb" if sub.notebook else "notebook (*.ipynb)"
        found = f" (it holds: {', '.join(sub.present[:5])})" if sub.present else ""
        raise SubmissionProblem(INVALID, f"no {what} in the student's directory{found}")
    try:
        checks = checks_for(sub.notebook)
    except GradingError as exc:
        raise SubmissionProblem(INVALID, f"{sub.path.name} is not a graded course notebook ({exc})") from exc
    nb = load_notebook(sub.path, max_bytes=opts.max_bytes)
    check_identity(nb, sub.notebook)
    marks = {"digests": _digests(nb), "signatures": copies.signatures(nb),  # what was submitted, in both modes
             "code": similarity.code_of(nb), "runs": report.runs_of(nb)}
    try:
        return replace(_graded(nb, checks, sub, opts, out_dir, box), **marks)
    except SubmissionProblem as exc:
        return Grade(sub.student, sub.notebook, exc.status, 0.0, _max_score(sub.notebook, opts), str(exc), **marks)


def _graded(nb, checks, sub: Submission, opts: GradeOptions, out_dir: Path, box: Sandboxing | None) -> Grade:
    if not opts.execute:
        grade = grade_notebook(nb, sub.notebook, checks, student=sub.student)
        if grade.status == TAMPERED:
            return replace(grade, max_score=_max_score(sub.notebook, opts))
        return _with_code(grade, nb, sub, opts, out_dir, box)
    # Re-running regenerates every result, but a forged seal in what was submitted is still cheating.
    forged = tamper.problems(nb, seals_only=True)
    if forged:
        raise SubmissionProblem(TAMPERED, join_reasons(forged))
    box = box or Sandboxing(isolation_for(opts), private_paths(opts))
    grade = _execute_and_grade(sub, opts, out_dir, checks, box)
    if grade.status == TAMPERED:
        return replace(grade, max_score=_max_score(sub.notebook, opts))
    return _with_code(grade, nb, sub, opts, out_dir, box)


def _digests(nb) -> tuple[str, ...]:
    return tuple(str(r.payload["fingerprint"].get("digest")) for r in collect(nb)
                 if isinstance(r.payload.get("fingerprint"), dict))


def _execute_and_grade(sub: Submission, opts: GradeOptions, out_dir: Path, checks, box: Sandboxing) -> Grade:
    who = sub.file_name or safe_name(sub.student)
    dst = out_dir / "executed" / who / f"{safe_name(sub.notebook)}.ipynb"
    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as work:
        run = sandbox.execute(sub.path, dst, workdir=work, kernel=opts.kernel,
                              parameters={"PROFILE": opts.profile}, limits=opts.limits,
                              private=box.hidden + (out_dir,), isolation=box.isolation)
        _keep_log(Path(work) / "executor.log", out_dir / "logs" / f"{who}__{dst.stem}.log")
    nb = _load_quietly(run.output, opts.limits.output_bytes)
    iso = run.isolation
    note = "" if iso.isolated and (iso.network_isolated or opts.limits.network) else f" [{iso.detail}]"
    if run.outcome == sandbox.OK:
        if nb is None:
            raise SubmissionProblem(ERROR, "papermill finished but the executed notebook is unreadable")
        grade = grade_notebook(nb, sub.notebook, checks, student=sub.student)
        return replace(grade, detail=grade.detail + note)
    status = TIMEOUT if run.outcome == sandbox.TIMEOUT else ERROR
    reason = _failure_reason(run, nb, opts)
    score, max_score, results = 0.0, float(sum(c.points for c in checks)), ()
    if nb is not None:
        partial = grade_notebook(nb, sub.notebook, checks, student=sub.student)
        if partial.status == TAMPERED:
            return replace(partial, detail=f"{partial.detail} (while executing: {reason})")
        score, results = partial.score, partial.results
        reason += f"; partial credit {score:g}/{max_score:g} from the cells that ran"
    return Grade(sub.student, sub.notebook, status, score, max_score, reason + note, results)


def _load_quietly(path: Path | None, max_bytes: int):
    if path is None:
        return None
    try:
        return load_notebook(path, max_bytes=max_bytes)
    except SubmissionProblem:
        return None


def _keep_log(src: Path, dst: Path, limit: int = 64 * 2**10) -> None:
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        with src.open("rb") as fh:
            fh.seek(max(src.stat().st_size - limit, 0))
            dst.write_bytes(fh.read())
    except OSError:
        pass


def _last_started_cell(nb) -> int | None:
    """Index of the last cell papermill started (the one running when the kernel died or time ran out)."""
    started = [i for i, c in enumerate(nb.cells) if (c.get("metadata", {}).get("papermill") or {}).get("start_time")]
    return started[-1] if started else None


_NETWORK_HINTS = ("URLError", "gaierror", "Connection", "Network", "Socket", "MaxRetry", "unreachable",
                  "name resolution", "Name or service")


def _failed_cell(nb) -> int | None:
    """Index in the saved executed notebook of the first cell with an error (papermill's own index
    predates the banner cells it inserts)."""
    for i, cell in enumerate(nb.cells):
        if error_of(cell) or (cell.get("metadata", {}).get("papermill") or {}).get("exception") is True:
            return i
    return None


def _failure_reason(run: sandbox.Execution, nb, opts: GradeOptions) -> str:
    reason = _failure(run, nb, opts)
    capped = str(run.info.get("capped", ""))
    return f"{reason} ({capped})" if capped and capped not in reason else reason


def _failure(run: sandbox.Execution, nb, opts: GradeOptions) -> str:
    if run.outcome in (sandbox.TIMEOUT, sandbox.KERNEL_DIED):
        cell = _last_started_cell(nb) if nb is not None else None
        where = f" in cell {cell_number(nb, cell)}" if cell is not None else ""
        if run.outcome == sandbox.TIMEOUT:
            return f"timeout: still running{where} after {opts.limits.timeout_s:g} s"
        return f"the kernel died{where} (os._exit, a crash or the OOM killer)"
    if run.outcome == sandbox.CELL_ERROR:
        ename, evalue = str(run.info.get("ename", "Error")), str(run.info.get("evalue", ""))
        cell = _failed_cell(nb) if nb is not None else None
        where = f"cell {cell_number(nb, cell)}" if cell is not None else "a cell"
        reason = f"{where} raised {ename}: {evalue[:200]}".rstrip(": ")
        if ename == "MemoryError":
            reason += f" (memory cap {opts.limits.memory_bytes / 2**30:g} GiB)"
        elif any(h.lower() in f"{ename} {evalue}".lower() for h in _NETWORK_HINTS) and \
                run.isolation.network_isolated:
            reason += " (the grading sandbox has no network)"
        return reason
    return run.detail


def grade_all(subs: list[Submission], opts: GradeOptions, out_dir: Path,
              progress: Callable[[Grade], None] | None = None, box: Sandboxing | None = None) -> list[Grade]:
    """Grade `subs` with `opts.workers` threads; rows in (student, notebook) order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with ThreadPoolExecutor(max_workers=opts.workers) as pool:
        futures = [pool.submit(grade_submission, sub, opts, out_dir, box) for sub in subs]
        for future in as_completed(futures):
            row = future.result()  # grade_submission never raises
            rows.append(row)
            if progress is not None:
                progress(row)
    rows.sort(key=lambda r: (r.student, r.notebook))
    return rows


@dataclass(frozen=True)
class BatchResult:
    rows: list[Grade]
    out_dir: Path
    summary: list[dict]
    isolation: Isolation | None = None
    """What executed notebooks ran under (None without --execute)."""
    pairs: tuple = ()
    """copies.Pair: submissions whose recorded runs are identical (review.csv)."""
    problems: tuple[str, ...] = ()
    """Gradebook files (other than grades.csv) or feedback pages that could not be written, one line each."""
    code_pairs: tuple = ()
    """similarity.CodePair: submissions whose exercise code is alike (review.csv, review/)."""


def _grade_copies(subs: list[Submission], opts: GradeOptions, out_dir: Path, hidden: tuple[Path, ...],
                  progress: Callable[[Grade], None] | None) -> list[Grade]:
    """Copy every submission into a private workspace, grade the copies, note originals that changed, and apply
    the late policy (`hidden[0]`: the submissions folder)."""
    code = any(code_plan(s.notebook, opts).exercises for s in subs if s.notebook)
    box = Sandboxing(isolation_for(opts), private_paths(opts, *hidden)) if opts.execute or code else None
    received: dict[int, workspace.Received] = {}
    refused: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="labkit-ws-") as ws:  # mode 0700
        for i, sub in enumerate(subs):
            try:
                if sub.path is not None and not sub.problem:
                    received[i] = workspace.take(sub.path, Path(ws), i, opts.max_bytes)
            except SubmissionProblem as exc:  # not a regular file, above the cap, unreadable: never read again
                refused[i] = str(exc)
        copies = [replace(s, path=received[i].copy) if i in received else
                  replace(s, problem=refused[i]) if i in refused else s for i, s in enumerate(subs)]
        box = box and replace(box, hidden=box.hidden + (Path(ws),))
        rows = grade_all(copies, opts, out_dir, progress, box)
    notes = {(subs[i].student, subs[i].notebook): (rec, workspace.changed(rec, opts.max_bytes))
             for i, rec in received.items()}
    workspace.write_received([(*key, *value) for key, value in sorted(notes.items())], out_dir / "received.csv")
    out = []
    for row in rows:
        note = notes.get((row.student, row.notebook), (None, None))[1]
        out.append(replace(row, detail=f"{row.detail}; {note}" if row.detail else note) if note else row)
    if opts.late is None:
        return out
    mtimes = {(subs[i].student, subs[i].notebook): rec.mtime for i, rec in received.items()}
    return late.apply(out, opts.late, late.submission_times(hidden[0], subs, mtimes), roster_of(opts))


def questions_for(notebooks, opts: GradeOptions) -> list[questions.Question]:
    """The plan's questions (every check and exercise test, labkit.course.grading.questions) of `notebooks`."""
    return [q for nb in sorted(set(notebooks)) if nb for q in questions.plan(nb, code_plan(nb, opts))]


def maxima(rows: list[Grade], opts: GradeOptions) -> dict[str, float]:
    """The grader's plan: the points possible of each notebook in `rows` (its checks and code tests)."""
    return {nb: _max_score(nb, opts) for nb in sorted({r.notebook for r in rows})}


def roster_of(opts: GradeOptions):
    return roster.load(opts.roster) if opts.roster else None


def listing(submissions_dir: str | Path, opts: GradeOptions) -> list[Submission]:
    """Everything a batch grades (a shard picks its students from it): the folders' submissions, completed by the
    roster, each with its file name in OUT_DIR (unique over the whole listing, so a shard names as one machine)."""
    subs = find_submissions(submissions_dir, opts.notebook)
    if opts.roster:
        subs, _ = with_roster(subs, roster_of(opts), opts.notebook)
    names, _ = gradebook.file_names(s.student for s in subs)
    return [replace(s, file_name=names[s.student]) for s in subs]


def run_batch(submissions_dir: str | Path, out_dir: str | Path, opts: GradeOptions = GradeOptions(),
              progress: Callable[[Grade], None] | None = None,
              select: Callable[[list[Submission]], list[Submission]] | None = None) -> BatchResult:
    """Grade every submission (or those `select` keeps: a shard, labkit.course.grading.shards) and write
    grades.csv, summary.csv, canvas.csv, received.csv, review.csv, gradescope/, feedback/ (and with --execute
    executed/ and logs/). Only grades.csv failing raises."""
    out_dir = Path(out_dir)
    subs = listing(submissions_dir, opts)
    subs = select(subs) if select is not None else subs
    out_dir.mkdir(parents=True, exist_ok=True)
    hidden = (Path(submissions_dir), out_dir)
    rows = _grade_copies(subs, opts, out_dir, hidden, progress)
    rows = manual.apply(rows, manual.load_marks(Path(opts.marks) if opts.marks else out_dir / manual.MARKS),
                        opts.late)
    pairs, most = copies.find_pairs(rows), maxima(rows, opts)
    code_pairs = similarity.find_pairs(rows, opts.similarity)
    rows = gradebook.normalize(similarity.flag(copies.flag(rows, pairs), code_pairs), most)
    problems = gradebook.write_all(rows, most, out_dir, safe_name, pairs, roster_of(opts), questions_for(most, opts),
                                   opts.export_questions, code_pairs)
    return BatchResult(rows, out_dir, gradebook.summary(rows), isolation_for(opts) if opts.execute else None,
                       tuple(pairs), tuple(problems), tuple(code_pairs))
