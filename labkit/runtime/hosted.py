"""Free cloud notebooks: Colab (one T4, profile t4x1) and Kaggle (two T4s, profile t4x2).

`platform()` names the one this kernel runs on (from the variables each sets in its kernels: Colab's
`COLAB_RELEASE_TAG`, Kaggle's `KAGGLE_KERNEL_RUN_TYPE`); `labkit env` prints it. Each lab notebook's
first code cell after the parameters is `first_cell(...)`'s text: there labkit is not installed yet, so
the cell clones the course's repository (`repository()`: site/site.yml's `repository`, the one setting the
site, this cell and the docs use) and, with only the standard library, asks the clone's labkit/runtime/cudadriver.py
which torch to run (`hosted_install`: the platform's own when it is >= labkit's minimum and the driver runs
it, else the locked torch's build for the driver; one printed line says which), then installs labkit with
the class's lock (requirements/lock.txt); it is a no-op everywhere else. Then `require_gpus` stops a 2-GPU
lab on Colab's one T4 in one line that says to use Kaggle's T4 x2. docs/free-gpus.md is the learner's guide.
Unverified on the platforms themselves (no Colab or Kaggle from here): the variables are the ones
their kernels are documented / widely observed to set, the platform's torch is whatever they ship that
week; tests/test_hosted.py runs the cell with the variables set and a fake nvidia-smi.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

from labkit.errors import ConfigError, NeedsMoreGPUs
from labkit.profiles import Profile, get_profile

#: The one setting: `repository:` in the source tree's site/site.yml (read by the site, this cell and the docs).
SITE_CONFIG = Path(__file__).resolve().parents[2] / "site" / "site.yml"
#: What site/site.yml names until the course is published: `make site` says so while it still does.
PLACEHOLDER_REPOSITORY = "https://github.com/labkit-course/labkit"
#: Where the first cell clones the repository, relative to the notebook's folder (/content on Colab,
#: /kaggle/working on Kaggle).
CLONE_DIR = "labkit-course"
#: Written into the clone once labkit is installed there: the next notebook of the session skips the install.
INSTALLED = ".labkit-installed"
#: platform -> (its name, the variable its kernels set, the profile to run there).
PLATFORMS = {"colab": ("Colab", "COLAB_RELEASE_TAG", "t4x1"), "kaggle": ("Kaggle", "KAGGLE_KERNEL_RUN_TYPE", "t4x2")}
#: A profile with too few GPUs for a lab -> where to run that lab instead.
MORE_GPUS = {"t4x1": "use Kaggle's T4 x2 (Accelerator 'GPU T4 x2', PROFILE = \"t4x2\")"}


@lru_cache(maxsize=None)
def repository(config: Path = SITE_CONFIG) -> str:
    """The course's public repository (https://github.com/OWNER/NAME) from site/site.yml."""
    import yaml

    if not config.is_file():
        raise ConfigError(f"no {config}: the course repository's URL is set there (`repository:`); run this from a "
                          "clone of the course repository")
    repo = str((yaml.safe_load(config.read_text()) or {}).get("repository", "")).rstrip("/")
    if not re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", repo):
        raise ConfigError(f"repository {repo!r} in {config} is not https://github.com/OWNER/NAME; set it there")
    return repo


def is_placeholder(repo: str) -> bool:
    return repo.rstrip("/") == PLACEHOLDER_REPOSITORY


def platform(environ: Mapping[str, str] | None = None) -> str | None:
    """'colab', 'kaggle', or None when this is neither."""
    environ = os.environ if environ is None else environ
    return next((key for key, (_name, var, _p) in PLATFORMS.items() if environ.get(var)), None)


def platform_name(environ: Mapping[str, str] | None = None) -> str:
    """'Colab', 'Kaggle' or 'none': what `labkit env` prints."""
    key = platform(environ)
    return PLATFORMS[key][0] if key else "none"


def require_gpus(profile: str | Profile, gpus: int, lab: str) -> Profile:
    """The profile; NeedsMoreGPUs (one line, no traceback) when `lab` needs more GPUs than a free-GPU
    profile has. Only profiles in MORE_GPUS stop: the course nodes' profiles run every lab."""
    profile = get_profile(profile)
    if profile.nproc < gpus and profile.name in MORE_GPUS:
        raise NeedsMoreGPUs(f"{lab} needs {gpus} GPUs and profile {profile.name!r} has {profile.nproc}: "
                            f"{MORE_GPUS[profile.name]}; or PROFILE = \"smoke\" on any machine")
    return profile


_VARS = " or ".join(f'os.environ.get("{var}")' for _name, var, _p in PLATFORMS.values())
_INSTALL = """\
# On Colab / Kaggle: install labkit from the course repository with the class's lock (a no-op elsewhere); torch
# stays the platform's when labkit's minimum allows it and the driver runs it, else the locked torch's build for
# this driver (labkit/runtime/cudadriver.py decides; one printed line says which)
import os, runpy, subprocess, sys
if {vars}:
    if not os.path.isfile("{clone}/{stamp}"):  # once per session (a failed install runs again)
        if not os.path.isdir("{clone}"):
            subprocess.check_call(["git", "clone", "--depth", "1", "{repo}", "{clone}"])
        for command in runpy.run_path("{clone}/labkit/runtime/cudadriver.py")["hosted_install"]("{clone}"):
            subprocess.check_call(command)
        open("{clone}/{stamp}", "w").close()
    sys.path.insert(0, os.path.abspath("{clone}"))  # this kernel started before the install"""


def first_cell(lab: str, gpus: int = 1) -> str:
    """The source of `lab`'s first code cell after the parameters (tests check every notebook has it)."""
    install = _INSTALL.format(vars=_VARS, clone=CLONE_DIR, repo=repository(), stamp=INSTALLED)
    if gpus <= 1:
        return install
    return (f"{install}\n\nfrom labkit.runtime.hosted import require_gpus\n\n"
            f'require_gpus(PROFILE, {gpus}, "{lab}")  # Colab\'s one T4 stops here: this lab needs Kaggle\'s two')


def rewrite_first_cells(folder: str | Path) -> list[Path]:
    """Regenerate the first cell after the parameters of every notebook in `folder` from `first_cell` (after
    site/site.yml's `repository` or this module changed), each with the GPU count its cell already asks for; only
    that cell changes (other cells, ids and metadata stay byte-identical). The notebooks it rewrote."""
    import nbformat

    changed = []
    for path in sorted(Path(folder).glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        params = next((i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])), None)
        if params is None or params + 1 >= len(nb.cells) or "On Colab / Kaggle" not in nb.cells[params + 1].source:
            continue
        cell = nb.cells[params + 1]
        gpus = re.search(r"require_gpus\(PROFILE, (\d+),", cell.source)
        new = first_cell(path.stem, int(gpus.group(1)) if gpus else 1)
        if cell.source != new:
            cell.source = new
            nbformat.write(nb, path)
            changed.append(path)
    return changed


if __name__ == "__main__":  # python -m labkit.runtime.hosted notebooks/
    import sys

    for rewritten in rewrite_first_cells(sys.argv[1] if len(sys.argv) > 1 else "notebooks"):
        print(f"rewrote the first cell of {rewritten}")
