"""`labkit assign --out DIR [--source notebooks]`: write the student release and the autograder folder.
`labkit assign --self-study [--out my-labs]`: a self-study learner's own release (labkit.course.selfstudy).

DIR/notebooks/ holds the notebooks with every solution stubbed and outputs cleared, plus their visible tests;
DIR/autograder/ the hidden tests (docs/grading.md, "For instructors"); the course files the notebooks link
to (docs/*.md, reservations/README.md, ...) go to the same place relative to DIR/notebooks, so no link is
dead in the release; with --gradescope also one Gradescope autograder zip per lab in DIR/gradescope/
(docs/grading.md, "On Gradescope"). Bad solution markers or a dead link: one line, exit 2.
"""
from __future__ import annotations

from pathlib import Path

import click

from labkit.course.exercises.release import make_release
from labkit.course.links import copy_linked, linked_files


@click.command("assign")
@click.option("--out", "out_dir", default=None, type=click.Path(),
              help="Release folder to write (required, except with --self-study: my-labs).")
@click.option("--source", "source_dir", default=None, type=click.Path(),
              help="The course's source notebooks (with tests/ and tests/hidden/ beside them) [default: notebooks].")
@click.option("--gradescope", is_flag=True,
              help="Also write OUT/gradescope/<notebook>.zip per lab: a Gradescope autograder (labkit pinned by the lock).")
@click.option("--self-study", is_flag=True,
              help="A learner's own release: OUT/*.ipynb and OUT/tests (visible tests only); never replaces a "
                   "file already in OUT (docs/self-study.md).")
def command(out_dir, source_dir, gradescope, self_study):
    """Write the student release of SOURCE to OUT/notebooks and the hidden tests to OUT/autograder."""
    if self_study:
        from labkit.course.selfstudy import DEFAULT_OUT, format_self_study, make_self_study

        click.echo(format_self_study(make_self_study(out_dir or DEFAULT_OUT, source_dir)))
        return 0
    if out_dir is None:
        raise click.UsageError("--out DIR is required (or --self-study for your own copy of the labs in my-labs/)")
    source_dir = source_dir or "notebooks"
    linked_files(Path(source_dir))  # a dead link stops the release before anything is written
    rel = make_release(out_dir, source_dir)
    linked = copy_linked(source_dir, out_dir)
    click.echo(f"wrote {len(rel.notebooks)} notebooks ({len(rel.exercises)} code exercises stubbed) and "
               f"{len(rel.visible)} visible test files to {out_dir}/notebooks; {len(rel.hidden)} hidden test "
               f"files to {out_dir}/autograder; {len(linked)} linked course file(s) beside them")
    if gradescope:
        from labkit.course.grading.gradescope import write_zips

        zips = write_zips(rel, out_dir, source_dir)
        click.echo(f"wrote {len(zips)} Gradescope autograder zips to {out_dir}/gradescope "
                   f"({', '.join(z.name for z in zips)})")
    return 0
