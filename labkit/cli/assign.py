"""`labkit assign --out DIR [--source notebooks]`: write the student release and the autograder folder.

DIR/notebooks/ holds the notebooks with every solution stubbed and outputs cleared, plus their visible tests;
DIR/autograder/ the hidden tests (docs/grading.md, "For instructors"); with --gradescope also one Gradescope
autograder zip per lab in DIR/gradescope/ (docs/grading.md, "On Gradescope"). Bad solution markers: one line,
exit 2.
"""
from __future__ import annotations

import click

from labkit.course.exercises.release import make_release


@click.command("assign")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Release folder to write.")
@click.option("--source", "source_dir", default="notebooks", show_default=True, type=click.Path(),
              help="The course's source notebooks (with tests/ and tests/hidden/ beside them).")
@click.option("--gradescope", is_flag=True,
              help="Also write OUT/gradescope/<notebook>.zip per lab: a Gradescope autograder (labkit pinned by the lock).")
def command(out_dir, source_dir, gradescope):
    """Write the student release of SOURCE to OUT/notebooks and the hidden tests to OUT/autograder."""
    rel = make_release(out_dir, source_dir)
    click.echo(f"wrote {len(rel.notebooks)} notebooks ({len(rel.exercises)} code exercises stubbed) and "
               f"{len(rel.visible)} visible test files to {out_dir}/notebooks; {len(rel.hidden)} hidden test "
               f"files to {out_dir}/autograder")
    if gradescope:
        from labkit.course.grading.gradescope import write_zips

        zips = write_zips(rel, out_dir, source_dir)
        click.echo(f"wrote {len(zips)} Gradescope autograder zips to {out_dir}/gradescope "
                   f"({', '.join(z.name for z in zips)})")
    return 0
