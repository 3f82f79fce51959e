"""`labkit slides build|list`: the lecture decks (the builder's own argument parser, `labkit.course.slides.main`)."""
from __future__ import annotations

import click


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                 "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def command(args):
    """Build the decks in slides/ into offline HTML + PDF (`labkit slides build --help`)."""
    from labkit.course.slides import main

    code = main(list(args) or ["--help"])
    raise SystemExit(code)
