"""`labkit assign --out DIR [--source notebooks]`: write the student release and the autograder folder.
`labkit assign --self-study [--out my-labs]`: a self-study learner's own release (labkit.course.selfstudy).

DIR/notebooks/ holds the notebooks with every solution stubbed and outputs cleared, plus their visible tests;
DIR/autograder/ the hidden tests (docs/grading.md, "For instructors"). Bad solution markers: one line, exit 2.
"""
from __future__ import annotations

import click

from labkit.course.exercises.release import make_release


@click.command("assign")
@click.option("--out", "out_dir", default=None, type=click.Path(),
              help="Release folder to write (required, except with --self-study: my-labs).")
@click.option("--source", "source_dir", default=None, type=click.Path(),
              help="The course's source notebooks (with tests/ and tests/hidden/ beside them) [default: notebooks].")
@click.option("--self-study", is_flag=True,
              help="A learner's own release: OUT/*.ipynb and OUT/tests (visible tests only); never replaces a "
                   "file already in OUT (docs/self-study.md).")
def command(out_dir, source_dir, self_study):
    """Write the student release of SOURCE to OUT/notebooks and the hidden tests to OUT/autograder."""
    if self_study:
        from labkit.course.selfstudy import DEFAULT_OUT, format_self_study, make_self_study

        click.echo(format_self_study(make_self_study(out_dir or DEFAULT_OUT, source_dir)))
        return 0
    if out_dir is None:
        raise click.UsageError("--out DIR is required (or --self-study for your own copy of the labs in my-labs/)")
    rel = make_release(out_dir, source_dir or "notebooks")
    click.echo(f"wrote {len(rel.notebooks)} notebooks ({len(rel.exercises)} code exercises stubbed) and "
               f"{len(rel.visible)} visible test files to {out_dir}/notebooks; {len(rel.hidden)} hidden test "
               f"files to {out_dir}/autograder")
    return 0
