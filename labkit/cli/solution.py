"""`labkit solution LAB NAME`: print the reference solution of one exercise (or one-line answer), read from the
course's source notebooks only when asked. Without NAME: list what LAB has. Unknown names: one line, exit 2."""
from __future__ import annotations

import click

from labkit.course.selfstudy import format_solution, solution, solutions


@click.command("solution")
@click.argument("lab")
@click.argument("name", required=False)
@click.option("--source", "source_dir", default=None, type=click.Path(),
              help="The course's source notebooks [default: notebooks/ of the source tree labkit runs from].")
def command(lab, name, source_dir):
    """Print the reference solution of exercise NAME of LAB (e.g. `labkit solution 03_ddp ring_allreduce`)."""
    if name is None:
        found = solutions(lab, source_dir)
        exercises = [s.name for s in found.values() if s.kind == "exercise"]
        answers = [s.name for s in found.values() if s.kind == "answer"]
        lab_name = next(iter(found.values())).lab if found else lab
        click.echo(f"{lab_name}: exercises: {', '.join(exercises) or '(none)'}; answers: {', '.join(answers) or '(none)'}")
        click.echo(f"show one: labkit solution {lab_name} NAME")
        return 0
    click.echo(format_solution(solution(lab, name, source_dir)), nl=False)
    return 0
