"""Free cloud notebooks: Colab (one T4, profile t4x1) and Kaggle (two T4s, profile t4x2).

`platform()` names the one this kernel runs on (from the variables each sets in its kernels: Colab's
`COLAB_RELEASE_TAG`, Kaggle's `KAGGLE_KERNEL_RUN_TYPE`); `labkit env` prints it. Each lab notebook's
first code cell after the parameters is `first_cell(...)`'s text: there labkit is not installed yet, so
the cell installs it from `REPOSITORY` with the class's lock (requirements/lock.txt) using only the
standard library, and is a no-op everywhere else; then `require_gpus` stops a 2-GPU lab on Colab's one
T4 in one line that says to use Kaggle's T4 x2. docs/free-gpus.md is the learner's guide.
Unverified on the platforms themselves (no Colab or Kaggle from here): the variables are the ones
their kernels are documented / widely observed to set; tests/test_hosted.py runs the cell with them set.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from labkit.errors import NeedsMoreGPUs
from labkit.profiles import Profile, get_profile

#: The course's public repository (placeholder until it is published; site/site.yml names the same one).
REPOSITORY = "https://github.com/labkit-course/labkit"
#: Where the first cell clones the repository, relative to the notebook's folder (/content on Colab,
#: /kaggle/working on Kaggle).
CLONE_DIR = "labkit-course"
#: platform -> (its name, the variable its kernels set, the profile to run there).
PLATFORMS = {"colab": ("Colab", "COLAB_RELEASE_TAG", "t4x1"), "kaggle": ("Kaggle", "KAGGLE_KERNEL_RUN_TYPE", "t4x2")}
#: A profile with too few GPUs for a lab -> where to run that lab instead.
MORE_GPUS = {"t4x1": "use Kaggle's T4 x2 (Accelerator 'GPU T4 x2', PROFILE = \"t4x2\")"}


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
_INSTALL = f"""\
# On Colab / Kaggle: install labkit from the course repository with the class's lock (a no-op elsewhere)
import os, subprocess, sys
if {_VARS}:
    if not os.path.isdir("{CLONE_DIR}"):
        subprocess.check_call(["git", "clone", "--depth", "1", "{REPOSITORY}", "{CLONE_DIR}"])
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-c", "{CLONE_DIR}/requirements/lock.txt",
                               "-e", "{CLONE_DIR}"])
    sys.path.insert(0, os.path.abspath("{CLONE_DIR}"))  # this kernel started before the install"""


def first_cell(lab: str, gpus: int = 1) -> str:
    """The source of `lab`'s first code cell after the parameters (tests check every notebook has it)."""
    if gpus <= 1:
        return _INSTALL
    return (f"{_INSTALL}\n\nfrom labkit.hosted import require_gpus\n\n"
            f'require_gpus(PROFILE, {gpus}, "{lab}")  # Colab\'s one T4 stops here: this lab needs Kaggle\'s two')
