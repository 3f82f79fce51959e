"""`labkit grade SUBMISSIONS_DIR --out OUT_DIR`: grade a class's executed notebooks (docs/grading.md).

Writes OUT_DIR/grades.csv (one row per submission, one column per question), summary.csv, canvas.csv,
gradescope/<notebook>.csv, review.csv (copies to look at), unrostered.csv (--roster) and
feedback/<student>.html; exit code 0 whenever the gradebook (grades.csv) was written, whatever the submissions
held: a file or page that could not be written is a warning line. --deadline applies the late policy
(labkit.course.grading.late).
Code exercises: each exercise cell's function runs against the visible and hidden tests (--autograder) in
the same sandbox, one process per exercise, partial credit per test. With --execute or code tests it first
prints the isolation in use, and refuses (exit 2) where there is none unless --unsafe-no-isolation is given.

A class on many machines (labkit.course.grading.shards): `--emit slurm` writes OUT/slurm/grade.sbatch, a SLURM
array job whose task I runs `labkit grade ... --shard I/K` into OUT/parts/shard-I; `labkit grade merge
OUT/parts/shard-* --out OUT` joins the shards into the gradebook one machine would have written.
"""
from __future__ import annotations

import os
from pathlib import Path

import click

from labkit.course.grading import isolation, manual
from labkit.course.grading import shards as sharding
from labkit.course.grading.batch import (GradeOptions, code_plan, isolation_for, listing, maxima, private_paths,
                                         questions_for, roster_of, run_batch)
from labkit.course.grading.evaluate import Grade
from labkit.course.grading.late import LatePolicy
from labkit.course.grading.registry import load_file
from labkit.course.grading.sandbox import Limits
from labkit.errors import ConfigError, GradingError
from labkit.profiles import get_profile
from labkit.results import format_table


def _review(pair) -> None:
    if hasattr(pair, "similarity"):
        click.echo(f"review: {pair.student} and {pair.other} ({pair.notebook}): exercise code "
                   f"{pair.similarity:.0%} alike ({pair.page})")
    else:
        click.echo(f"review: {pair.student} and {pair.other} ({pair.notebook}): {pair.runs} recorded run(s) identical"
                   f"{' (the same seals)' if pair.same_seals else ' under other seals'}")


def _progress(row: Grade) -> None:
    click.echo(f"{row.status:>8}  {row.student}/{row.notebook or '-'}  {row.score:g}/{row.max_score:g}  "
               f"{row.detail[:100]}")


@click.command("grade")
@click.argument("submissions_dir", nargs=-1, required=True,
                metavar="SUBMISSIONS_DIR | merge OUT_PARTS... | review OUT_DIR")
@click.option("--out", "out_dir", default=None, type=click.Path(), help="Where grades and feedback go.")
@click.option("--notebook", default=None, help="Grade only <student>/NOTEBOOK.ipynb, e.g. 01_memory.")
@click.option("--execute", is_flag=True, help="Re-run each notebook with papermill in a sandbox first.")
@click.option("--profile", default="smoke", show_default=True, help="PROFILE injected when executing.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds per notebook (--execute).")
@click.option("--workers", type=int, default=1, show_default=True, help="Submissions graded in parallel.")
@click.option("--memory-gib", type=float, default=8.0, show_default=True, help="Memory cap per process (--execute).")
@click.option("--output-mib", type=float, default=50.0, show_default=True, help="Largest executed notebook.")
@click.option("--checks", "checks_file", type=click.Path(), default=None,
              help="Python file with extra (e.g. private hidden) checks: CHECKS = {'01_memory': [...]}.")
@click.option("--kernel", default="labkit", show_default=True, help="Jupyter kernel for --execute.")
@click.option("--scratch-mib", type=float, default=512.0, show_default=True,
              help="Size of each execution's private scratch tmpfs (--execute).")
@click.option("--autograder", type=click.Path(exists=True, file_okay=False), default=None,
              help="Hidden tests of the code exercises (`labkit assign`'s OUT/autograder; default: the source "
                   "tree's notebooks/tests/hidden when present).")
@click.option("--exercise-timeout", type=float, default=300.0, show_default=True,
              help="Seconds for all the tests of one code exercise.")
@click.option("--unsafe-no-isolation", is_flag=True,
              help="Execute even where no file-system sandbox exists (student code gets the grader's access).")
@click.option("--emit", type=click.Choice(["slurm"]), default=None,
              help="Grade nothing here: write OUT/slurm/grade.sbatch, a SLURM array job (one task per shard).")
@click.option("--shards", type=int, default=None,
              help="Tasks of --emit slurm (default: one per 8 students).")
@click.option("--roster", type=click.Path(), default=None,
              help="CSV of the class (id,name,email,extension): every rostered student gets a row; a student "
                   "with nothing handed in is `missing` (0, not submitted); folders on no line are listed.")
@click.option("--export-questions", is_flag=True,
              help="Also put the points of every check and test into canvas.csv and gradescope/ (grades.csv always "
                   "has them).")
@click.option("--similarity", type=float, default=0.7, show_default=True,
              help="Exercise code at least this alike (0-1, winnowing as MOSS does) goes to review.csv; 0: off.")
@click.option("--marks", type=click.Path(dir_okay=False), default=None,
              help="The TA's marks of manual questions (default: OUT/marks.json, written by OUT/review.ipynb).")
@click.option("--deadline", default=None, metavar="TIME",
              help="Due time, ISO (2026-12-01T23:59 is UTC; or give an offset, 2026-12-01T23:59-05:00); late rows lose "
                   "--late-penalty percent a started day (roster extensions add days).")
@click.option("--late-penalty", type=float, default=10.0, show_default=True, help="Percent lost per day late.")
@click.option("--late-cap", type=float, default=100.0, show_default=True, help="Most percent lateness can cost.")
@click.option("--shard", default=None, metavar="I/K",
              help="Grade only shard I of K (students split by name; what each SLURM task runs).")
def command(submissions_dir, out_dir, notebook, execute, profile, timeout, workers, memory_gib, output_mib,
            checks_file, kernel, scratch_mib, autograder, exercise_timeout, unsafe_no_isolation, emit, shards, shard,
            roster, export_questions, deadline, late_penalty, late_cap, similarity, marks):
    """Grade SUBMISSIONS_DIR/<student>/<notebook>.ipynb on recorded results (or re-executed with --execute),
    and the code exercises' cells on their visible + hidden tests (sandboxed).

    `labkit grade merge OUT_PARTS... --out OUT` joins the shards of `--emit slurm` into one gradebook;
    `labkit grade review OUT_DIR` writes OUT_DIR/review.ipynb, where a TA marks the free-text (manual) answers."""
    if submissions_dir[0] == "review":
        return _review_notebook(submissions_dir[1:])
    if out_dir is None:
        raise GradingError("--out OUT_DIR is missing: where the gradebook goes (labkit grade SUBMISSIONS --out OUT)")
    if submissions_dir[0] == "merge":
        return _merge(submissions_dir[1:], out_dir)
    if len(submissions_dir) != 1:
        raise GradingError(f"one SUBMISSIONS_DIR, got {len(submissions_dir)} ({' '.join(submissions_dir[:3])} ...); "
                           "to join shards: labkit grade merge OUT/parts/shard-* --out OUT")
    submissions_dir = submissions_dir[0]
    get_profile(profile)  # an unknown profile is a ConfigError naming the valid ones
    if checks_file:
        click.echo(f"extra checks for: {', '.join(load_file(checks_file))}")
    limits = Limits(timeout_s=timeout, memory_bytes=int(memory_gib * 2**30), output_bytes=int(output_mib * 2**20),
                    scratch_bytes=int(scratch_mib * 2**20))
    opts = GradeOptions(execute=execute, notebook=notebook, profile=profile, kernel=kernel, workers=workers,
                        limits=limits, private=(checks_file,) if checks_file else (),
                        unsafe_no_isolation=unsafe_no_isolation, autograder=autograder,
                        exercise_timeout_s=exercise_timeout, roster=roster,
                        export_questions=export_questions,
                        late=LatePolicy(deadline, late_penalty, late_cap) if deadline else None,
                        similarity=similarity, marks=marks)
    class_list = roster_of(opts)  # a malformed roster is a GradingError (exit 2) naming its line
    if class_list is not None:
        click.echo(f"roster: {len(class_list.students)} students")
    if emit == "slurm":
        return _emit(submissions_dir, out_dir, opts, shards, checks_file, memory_gib, output_mib, scratch_mib)
    if execute:
        iso = isolation_for(opts)  # ConfigError (exit 2) when there is none and it was not accepted
        click.echo(f"isolation: {iso.level} ({iso.detail})")
    if execute or os.geteuid() == 0:  # code tests run sandboxed too; only root can get level unprivileged-user
        _private_to_grader(opts, Path(submissions_dir), Path(out_dir))
    part = sharding.parse_shard(shard) if shard else None
    select = (lambda subs: sharding.select(subs, *part)) if part else None
    result = run_batch(submissions_dir, out_dir, opts, progress=_progress, select=select)
    if part:
        everything = listing(submissions_dir, opts)
        most = maxima(everything, opts)  # the whole class's plan
        sharding.write_shard(result.out_dir, *part, everything, result.rows,
                             sharding.plan_of(opts, most, roster_of(opts), questions_for(most, opts)))
    click.echo(format_table(result.summary))
    click.echo(f"wrote {result.out_dir / 'grades.csv'} ({len(result.rows)} rows), summary.csv, canvas.csv, "
               f"received.csv, review.csv, report.html, gradescope/, feedback/")
    for pair in (*result.pairs, *result.code_pairs):
        _review(pair)
    for problem in result.problems:  # the gradebook is written: say what is missing, still exit 0
        click.echo(f"warning: {problem}")
    return 0


def _private_to_grader(opts: GradeOptions, submissions: Path, out: Path) -> None:
    """At isolation level unprivileged-user (no namespaces; file permissions keep the grader's files from the
    student's user): --out made readable by the grader only when new, and a GradingError (exit 2, one line)
    while the student's user can open a private path (the submissions, --out, the hidden tests)."""
    iso = isolation.detect(opts.limits.network)
    if iso.level != isolation.UNPRIVILEGED:
        return
    if opts.workers > 1:
        raise ConfigError(f"--workers {opts.workers} at isolation {iso.level}: every sandbox runs as the same user "
                          "here, so two at once could reach each other's files; use --workers 1 (or grade where "
                          "bubblewrap can start)")
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    isolation.guard_private(private_paths(opts, submissions, out))


def _emit(submissions_dir, out_dir, opts: GradeOptions, shards, checks_file, memory_gib, output_mib, scratch_mib):
    subs = listing(submissions_dir, opts)
    argv = [*(["--notebook", opts.notebook] if opts.notebook else []), *(["--execute"] if opts.execute else []),
            "--profile", opts.profile, "--timeout", f"{opts.limits.timeout_s:g}", "--workers", str(opts.workers),
            "--memory-gib", f"{memory_gib:g}", "--output-mib", f"{output_mib:g}", "--kernel", opts.kernel,
            "--scratch-mib", f"{scratch_mib:g}", "--exercise-timeout", f"{opts.exercise_timeout_s:g}",
            *(["--checks", str(Path(checks_file).resolve())] if checks_file else []),
            *(["--autograder", str(Path(opts.autograder).resolve())] if opts.autograder else []),
            *(["--unsafe-no-isolation"] if opts.unsafe_no_isolation else []),
            *(["--roster", str(Path(opts.roster).resolve())] if opts.roster else []),
            *(["--export-questions"] if opts.export_questions else []),
            "--similarity", f"{opts.similarity:g}",
            *(["--deadline", opts.late.deadline, "--late-penalty", f"{opts.late.per_day:g}", "--late-cap",
               f"{opts.late.cap:g}"] if opts.late else [])]

    def seconds(sub) -> float:  # a generous bound: execution, then every exercise's whole budget
        exercises = len(code_plan(sub.notebook, opts).exercises) if sub.notebook else 0
        return (opts.limits.timeout_s if opts.execute else 30.0) + exercises * opts.exercise_timeout_s

    path, count = sharding.emit_slurm(subs, Path(submissions_dir), Path(out_dir), shards=shards, argv=argv,
                                      workers=opts.workers, memory_gib=memory_gib, per_submission_s=seconds)
    click.echo(f"wrote {path}: a SLURM array of {count} task(s) over {len(sharding.students(subs))} students "
               f"({len(subs)} submissions)")
    click.echo(f"submit: sbatch {path}")
    click.echo(f"then:   labkit grade merge {Path(out_dir) / 'parts'}/shard-* --out {out_dir}")
    return 0


def _review_notebook(args):
    if len(args) != 1:
        raise GradingError("labkit grade review OUT_DIR: give the one folder `labkit grade --out` wrote")
    path, written = manual.write_notebook(args[0])
    click.echo(f"{'wrote' if written else 'kept the existing'} {path}: open it in Jupyter, run its cell, mark each "
               "answer (saved to marks.json at once)")
    click.echo(f"then: labkit grade SUBMISSIONS --out {args[0]} (the same options): the marks go into grades.csv and "
               "feedback/")
    return 0


def _merge(parts, out_dir):
    rows, pairs, problems = sharding.merge(parts, out_dir)
    click.echo(format_table(sharding.gradebook.summary(rows)))
    click.echo(f"merged {len(parts)} shard(s): wrote {Path(out_dir) / 'grades.csv'} ({len(rows)} rows), summary.csv, "
               "canvas.csv, received.csv, review.csv, report.html, gradescope/, feedback/")
    for pair in pairs:
        _review(pair)
    for problem in problems:
        click.echo(f"warning: {problem}")
    return 0
