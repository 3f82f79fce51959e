"""`labkit site build [--out build/site] [--execute all|none|LAB,...] [--executed DIR] [--repo URL]`: the course
website (labkit.course.site). Exit 0 when every lab executed and every link leads somewhere, 1 when a lab's
smoke run failed or a link is broken (the site is still written: a failed lab's page shows the outputs up to
the failing cell), 2 on a build error (a page that would show a solution is one: nothing is written)."""
from __future__ import annotations

import click


def repository_lines(repository: str) -> str:
    """Where the Open in Colab / Kaggle links point, and one more line while that is still the placeholder."""
    from labkit.runtime import hosted

    text = f"Open in Colab / Kaggle links point to {repository} (site/site.yml, or --repo)"
    if hosted.is_placeholder(repository):
        text += (f"\nnote: {repository} is still the placeholder in site/site.yml (`repository:`): the Colab / Kaggle "
                 "links, the notebooks' first cell and the docs' clone lead nowhere until it names the published "
                 "repository (then regenerate the first cells, docs/free-gpus.md)")
    return text


@click.group("site")
def command():
    """The course as a static website (Jupyter Book 2 + labkit's renderer): build it into build/site."""


@command.command("build")
@click.option("--out", default="build/site", show_default=True, type=click.Path(), help="Folder of the built site.")
@click.option("--execute", "execute", default="all", show_default=True,
              help="Labs to execute in smoke: all, none, or names (00_setup,01_memory).")
@click.option("--executed", "executed_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Folder of already executed student-release notebooks to show instead of running them.")
@click.option("--repo", "repository", default=None,
              help="GitHub repository of the student release for Open in Colab/Kaggle [default: site/site.yml].")
@click.pass_context
def build(ctx, out, execute, executed_dir, repository):
    """Build the site: student release, smoke execution, Jupyter Book, labkit's pages, leak check."""
    from labkit.course.site.build import build_site

    names = None if execute == "all" else () if execute == "none" else tuple(n.strip() for n in execute.split(","))
    result = build_site(out, execute=names, executed_dir=executed_dir, repository=repository,
                        log=lambda m: click.echo(m, err=True))
    click.echo(f"site: {result.out}/index.html ({len(result.pages)} pages, {len(result.labs)} labs, "
               f"{len(result.executed)} with smoke outputs, {sum(result.figures.values())} figures); "
               f"read it with `python3 -m http.server -d {out} 8000` and http://127.0.0.1:8000")
    click.echo(repository_lines(result.repository))
    for failure in result.failed:
        click.echo(f"  FAILED {failure}")
    for link in result.broken:
        click.echo(f"  BROKEN LINK {link}")
    ctx.exit(0 if result.ok else 1)
