"""`labkit assign --out DIR [--source notebooks]`: write the student release and the autograder folder.

DIR/notebooks/ holds the notebooks with every solution stubbed and outputs cleared, plus their visible tests;
DIR/autograder/ the hidden tests (docs/grading.md, "For instructors"); the course files the notebooks link
to (docs/*.md, reservations/README.md, ...) go to the same place relative to DIR/notebooks, so no link is
dead in the release. Bad solution markers or a dead link: one line, exit 2.
"""
from __future__ import annotations

from pathlib import Path

import click

from labkit.course.exercises.release import make_release
from labkit.course.links import copy_linked, linked_files


@click.command("assign")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Release folder to write.")
@click.option("--source", "source_dir", default="notebooks", show_default=True, type=click.Path(),
              help="The course's source notebooks (with tests/ and tests/hidden/ beside them).")
def command(out_dir, source_dir):
    """Write the student release of SOURCE to OUT/notebooks and the hidden tests to OUT/autograder."""
    linked_files(Path(source_dir))  # a dead link stops the release before anything is written
    rel = make_release(out_dir, source_dir)
    linked = copy_linked(source_dir, out_dir)
    click.echo(f"wrote {len(rel.notebooks)} notebooks ({len(rel.exercises)} code exercises stubbed) and "
               f"{len(rel.visible)} visible test files to {out_dir}/notebooks; {len(rel.hidden)} hidden test "
               f"files to {out_dir}/autograder; {len(linked)} linked course file(s) beside them")
    return 0
