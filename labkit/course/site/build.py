"""`make site` / `labkit site build`: the course as a static website, built with Jupyter Book 2 (MyST).

1. the student release of the labs (`labkit assign`: every solution stubbed), each executed in the `smoke`
   profile with papermill (or taken, already executed, from --executed DIR; or left unexecuted);
2. a MyST project in build/site-src: the landing page, one page per lab (a header with Open in Colab /
   Kaggle and its slides), the slides (built HTML), the docs, the glossary;
3. `jupyter-book build --site` with a local, empty template: MyST parses every page (notebook outputs
   included) into its AST, offline (its own themes are downloaded at build time, which we cannot rely on);
4. labkit's renderer writes the pages (labkit.course.site.render: glossary terms linked, lab numbers kept
   in the URLs), and the result is checked: no page or file holds a solution line or a hidden test
   (labkit.course.site.leaks); only then does it replace build/site/.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from labkit.course import source_tree
from labkit.course.site import leaks as L
from labkit.course.site import pages as P
from labkit.course.site.render import SiteWriter
from labkit.errors import ConfigError, LabkitError, NotebookError, choices_error

#: File at the top of a built site: a re-build only ever replaces a folder that has it.
STAMP = ".labkit-site"


@dataclass(frozen=True)
class SiteResult:
    out: Path
    labs: tuple[str, ...]
    executed: tuple[str, ...]
    failed: tuple[str, ...]
    """Labs whose smoke execution failed (their pages show the outputs up to the failing cell)."""
    figures: dict[str, int]
    """Image outputs per lab page (0 for a lab shown without outputs)."""
    pages: tuple[str, ...] = ()
    """Every page written (paths relative to `out`)."""
    unhandled: dict[str, Counter] = field(default_factory=dict)
    """{page: MyST node types the renderer has no handler for} (their text children are shown)."""
    unhandled_text: dict[str, Counter] = field(default_factory=dict)
    """{page: those of them that carried text}."""
    broken: tuple[str, ...] = ()
    """'<page>: <link>' for links to no page or file of the site."""
    repository: str = ""
    """Where the Open in Colab / Kaggle links point (site/site.yml's placeholder unless --repo)."""

    @property
    def ok(self) -> bool:
        return not self.failed and not self.broken


# ---- 1. the labs ------------------------------------------------------------------------------------------

def _execute(released: Path, names, executed_dir: Path | None, work: Path, log) -> tuple[dict[str, Path], list[str]]:
    """{lab: notebook to render}: executed copies where asked, the plain release elsewhere; and the failures."""
    from labkit.course.notebooks import run_notebook

    chosen, failed = {}, []
    for path in sorted(released.glob("*.ipynb")):
        lab = path.stem
        given = executed_dir / path.name if executed_dir else None
        if given is not None and given.is_file():
            chosen[lab] = given
        elif names is None or lab in names:
            log(f"executing {lab} (student release, profile smoke) ...")
            run = run_notebook(path, profile="smoke", out_dir=work / "executed")
            log(f"  {run.describe()}")
            if not run.ok:
                failed.append(f"{lab}: {run.describe()}")
            chosen[lab] = run.output if run.output.is_file() else path
        else:
            chosen[lab] = path
    return chosen, failed


def _has_outputs(nb) -> bool:
    return any(c.get("outputs") for c in nb.cells if c.cell_type == "code")


def _figures(nb) -> int:
    return sum(1 for c in nb.cells for o in c.get("outputs", []) if any(k.startswith("image/") for k in o.get("data", {})))


def _lab_page(src: Path, lab: str, cfg: P.SiteConfig, decks, site_paths: dict[str, str]):
    """The site's copy of one lab: a header cell after the title, links to repository files rewritten."""
    import nbformat

    nb = nbformat.read(src, as_version=4)
    nb.cells = [c for c in nb.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = P.rewrite_links(cell.source, f"notebooks/{lab}.ipynb", site_paths, cfg.blob_url)
    header = nbformat.v4.new_markdown_cell(P.lab_header(cfg, lab, decks, _has_outputs(nb)))
    header.metadata["labkit"] = {"site": "header"}
    nb.cells.insert(1, header)
    return nb


# ---- 2. the MyST project ----------------------------------------------------------------------------------

#: A local template (any folder with a template.yml): `jupyter-book build --site` then writes the pages' AST
#: without downloading MyST's theme, which our renderer replaces.
TEMPLATE = "_template"


def _decks(root: Path, project: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The slide decks as HTML in project/slides (as `labkit slides build` writes them, without PDFs: each deck
    parsed once, its figures drawn once); their titles and the labs each belongs to."""
    from labkit.course import slides

    refs = slides.load_references(root / "slides" / "references.yaml")
    (project / "slides").mkdir()
    titles, labs = {}, {}
    for path in slides.deck_paths(root / "slides"):
        deck = slides.parse_deck(path, refs)
        (project / "slides" / f"{deck.name}.html").write_text(slides.render_html(deck, refs, root / "slides" / "theme"))
        titles[deck.name] = deck.meta["title"]
        labs[deck.name] = [n.strip() for n in deck.meta.get("notebooks", "").split(",") if n.strip()]
    return titles, labs


def _docs(root: Path) -> dict[str, str]:
    """{repository path: project path} of the docs the site shows."""
    docs = {f"docs/{p.name}": f"docs/{p.name}" for p in sorted((root / "docs").glob("*.md"))}
    if (root / "reservations" / "README.md").is_file():
        docs["reservations/README.md"] = "docs/reservations.md"
    return docs


def _myst_yml(cfg: P.SiteConfig, labs, docs: list[str]) -> str:
    first = [d for d in docs if d.endswith("self-study.md")]
    toc = [{"file": "index.md"},
           {"title": "Labs", "children": [{"file": f"labs/{lab.name}.ipynb"} for lab in labs]},
           {"file": "slides.md"}, {"file": "glossary.md"},
           {"title": "Docs", "children": [{"file": d} for d in first + [d for d in docs if d not in first]]}]
    data = {"version": 1,
            "project": {"title": cfg.title, "github": cfg.repository, "toc": toc,
                        "exclude": ["_build/**", TEMPLATE + "/**"]},
            "site": {"template": f"./{TEMPLATE}"}}
    return yaml.safe_dump(data, sort_keys=False)


def assemble(project: Path, labs_nb: dict[str, Path], cfg: P.SiteConfig,
             root: Path) -> tuple[list[str], list[str], dict[str, int]]:
    """Write the MyST project; returns the lab names, the executed ones and the figures of each lab page."""
    import nbformat

    terms = P.load_glossary(root / "site" / "glossary.yml")
    titles = {lab: nbformat.read(p, as_version=4).cells[0].source.lstrip("# ").splitlines()[0]
              for lab, p in labs_nb.items()}
    labs = P.load_labs(root / "site" / "labs.yml", titles)
    decks, deck_labs = _decks(root, project)
    docs = _docs(root)
    site_paths = {**docs, **{f"notebooks/{lab}.ipynb": f"labs/{lab}.ipynb" for lab in labs_nb}}
    for repo_path, site_path in docs.items():
        (project / site_path).parent.mkdir(exist_ok=True)
        text = (root / repo_path).read_text()
        (project / site_path).write_text(P.rewrite_links(text, repo_path, site_paths, cfg.blob_url))
    (project / "labs").mkdir()
    executed: set[str] = set()
    figures: dict[str, int] = {}
    for lab in labs:
        mine = [(n, decks[n]) for n, nbs in deck_labs.items() if lab.name in nbs]
        nb = _lab_page(labs_nb[lab.name], lab.name, cfg, mine, site_paths)
        figures[lab.name] = _figures(nb)
        if _has_outputs(nb):
            executed.add(lab.name)
        nbformat.write(nb, project / "labs" / f"{lab.name}.ipynb")
    (project / "index.md").write_text(P.landing_page(cfg, labs, decks, executed))
    (project / "glossary.md").write_text(P.glossary_page(terms))
    (project / "slides.md").write_text(P.slides_page(decks, deck_labs))
    (project / TEMPLATE).mkdir()
    (project / TEMPLATE / "template.yml").write_text("jtex: v1\ntitle: labkit static (pages rendered by labkit)\n")
    (project / "myst.yml").write_text(_myst_yml(cfg, labs, list(docs.values())))
    return [lab.name for lab in labs], sorted(executed), figures


# ---- 3. Jupyter Book --------------------------------------------------------------------------------------

def jupyter_book() -> str:
    exe = Path(sys.executable).parent / "jupyter-book"
    if exe.is_file():
        return str(exe)
    found = shutil.which("jupyter-book")
    if found is None:
        raise ConfigError("jupyter-book is not installed: `pip install -e '.[site]'` (or `make site`, which does it)")
    return found


def run_jupyter_book(project: Path, log) -> Path:
    """`jupyter-book build --site` in `project`; returns MyST's output folder (config.json, content/, public/)."""
    if shutil.which("node") is None:
        raise ConfigError("`node` is not on the PATH: Jupyter Book runs on Node.js; install it "
                          "(`sudo apt-get install -y nodejs`), then run `make site` again")
    env = {**os.environ, "JB_ALLOW_NODEENV": "no"}  # Debian's node, never a download
    proc = subprocess.run([jupyter_book(), "build", "--site", "--ci"], cwd=project, capture_output=True, text=True,
                          env=env)
    out = project / "_build" / "site"
    if proc.returncode != 0 or not (out / "config.json").is_file():
        raise LabkitError(f"jupyter-book build failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.startswith(("⚠️", "⛔️")):
            log(f"  jupyter-book: {line}")
    return out


# ---- the whole build --------------------------------------------------------------------------------------

def _replace(out: Path, built: Path) -> None:
    if out.exists() and any(out.iterdir()) and not (out / STAMP).exists():
        raise ConfigError(f"{out} exists and is not a site this command built (no {STAMP}); choose an empty --out")
    (built / STAMP).write_text("written by `labkit site build`; replaced on re-run\n")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(built), str(out))


def render(project: Path, myst_out: Path, staging: Path, cfg: P.SiteConfig, root: Path, log):
    """Our pages from MyST's AST, with the slides and the stylesheet, into `staging`."""
    shutil.copytree(project / "slides", staging / "slides")
    shutil.copy2(root / "site" / "site.css", staging / "site.css")
    terms = P.term_words(P.load_glossary(root / "site" / "glossary.yml"))
    rendered = SiteWriter(myst_out, staging, site_title=cfg.title, terms=terms, glossary="glossary.md",
                          term_pages=("labs/",)).write()
    for page, kinds in sorted(rendered.unhandled.items()):
        text = rendered.unhandled_text.get(page, Counter())
        log(f"  {page}: MyST node types without a handler (their text shown plain): "
            + ", ".join(f"{k} x{n} ({text[k]} with text)" for k, n in kinds.most_common()))
    for link in rendered.broken:
        log(f"  broken link: {link}")
    return rendered


def build_site(out: str | Path = "build/site", *, execute: tuple[str, ...] | None = None,
               executed_dir: str | Path | None = None, repository: str | None = None,
               work: str | Path | None = None, log=print) -> SiteResult:
    """Build the site into `out`. `execute`: the labs to run in smoke (None: all); `executed_dir`: executed
    student copies to use instead of running them (a lab found there is not run); `work`: the MyST project
    folder (default build/site-src)."""
    from labkit.course.exercises.release import make_release

    root = source_tree()
    cfg = P.load_config(root / "site" / "site.yml", repository)
    out = Path(out).resolve()
    labs_found = sorted(p.stem for p in (root / "notebooks").glob("*.ipynb"))
    if execute is not None and set(execute) - set(labs_found):
        raise choices_error("lab", sorted(set(execute) - set(labs_found))[0], labs_found)
    project = Path(work).resolve() if work else root / "build" / "site-src"
    shutil.rmtree(project, ignore_errors=True)
    project.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="labkit-site-") as tmp:
        make_release(Path(tmp) / "release", root / "notebooks")
        names = None if execute is None else set(execute)
        labs_nb, failed = _execute(Path(tmp) / "release" / "notebooks", names,
                                   Path(executed_dir) if executed_dir else None, Path(tmp), log)
        labs, executed, figures = assemble(project, labs_nb, cfg, root)
    start = time.perf_counter()
    myst_out = run_jupyter_book(project, log)
    log(f"jupyter-book build --site: {time.perf_counter() - start:.0f} s")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        rendered = render(project, myst_out, staging, cfg, root, log)
        found = L.scan_site(staging, root / "notebooks")
        if found:
            raise NotebookError("the built site shows solution or hidden-test text; nothing was written to "
                                f"{out}:\n  " + "\n  ".join(found[:20]))
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would keep a web server out
        _replace(out, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return SiteResult(out, tuple(labs), tuple(executed), tuple(failed), figures, tuple(sorted(rendered.pages)),
                      rendered.unhandled, rendered.unhandled_text, tuple(rendered.broken), cfg.repository)
