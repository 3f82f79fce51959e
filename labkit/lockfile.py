"""The class's locked environment: `requirements/lock.txt`, a pip constraints file (`make lock`).

One lock pins every package the CI venv resolved, so a class gets the same versions in week 1 and
week 12 on the CPU venv (`make lab`), the conda env of a GPU node (environment.yml) and the containers
(Dockerfile, containers/labkit.def): all install with `-c requirements/lock.txt`. It is written from
`pip freeze` of the venv (`make lock`) minus what is not a PyPI pin of labkit's environment:

- labkit itself (an editable install) and any other local or VCS line;
- what labkit does not use: a package outside the dependency tree of labkit and its installed extras
  (a tool someone installed into the venv by hand);
- the CUDA runtime of the torch build (nvidia-*, cuda-*, triton): each CUDA build of torch pins its
  own exactly, and a GPU node installs another build of the same torch (cu126, cu130, cu132:
  labkit.runtime.cudadriver) whose runtime packages differ.

`labkit env` compares the running environment with the lock (`compare`); tests/test_packaging.py
fails when the venv, environment.yml or the images disagree with it.
"""
from __future__ import annotations

import platform
import re
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

LOCK_PATH = "requirements/lock.txt"
#: Packages that belong to the CUDA build of torch, not to the lock (see the module docstring).
TORCH_BUILD_PACKAGES = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")
#: Installers are not pinned: pip freeze leaves them out, and `make venv` upgrades pip first.
INSTALLERS = {"pip", "setuptools", "wheel"}
HEADER = """\
# The class's locked environment: pip constraints for every install of labkit.
# Made by `make lock` from `pip freeze` of the CI venv (`make venv`: Python {python}, {machine}),
# minus labkit itself, local lines, packages outside labkit's dependency tree and torch's CUDA
# runtime (nvidia-*, cuda-*, triton: each CUDA build of torch pins its own). Installed with
# `pip install -c {path} ...` by the Makefile, environment.yml, the Dockerfile and
# containers/labkit.def. Regenerate at the start of a semester (docs/gpu-node.md); a class keeps
# one lock all term. Do not edit by hand.
# python: {python}
"""


def normalize(name: str) -> str:
    """PEP 503 name normalisation: Foo_Bar and foo-bar are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def public(version: str) -> str:
    """'2.14.1+cu126' -> '2.14.1': a CUDA build of torch is the locked torch."""
    return version.split("+")[0]


def lock_lines(freeze: str, keep: set[str] | None = None) -> list[str]:
    """The `name==version` pins of `pip freeze` output that go into the lock, sorted by name; with
    `keep`, only those packages (labkit's dependency tree: `needed`)."""
    pins = {}
    for line in freeze.splitlines():
        line = line.strip()
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if not match:
            continue  # comments, `-e path` (labkit), `name @ file://...`, `name @ git+...`
        name, version = normalize(match.group(1)), match.group(2)
        if name == "labkit" or name in INSTALLERS or TORCH_BUILD_PACKAGES.match(name):
            continue
        if keep is not None and name not in keep:
            continue
        pins[name] = f"{name}=={public(version)}"
    return [pins[name] for name in sorted(pins)]


def render(freeze: str, keep: set[str] | None = None, *, python: str | None = None,
           machine: str | None = None) -> str:
    """The text of the lock file for `pip freeze` output (deterministic: rerunning changes nothing)."""
    python = python or "%d.%d" % sys.version_info[:2]
    head = HEADER.format(python=python, machine=machine or f"{platform.system()} {platform.machine()}",
                         path=LOCK_PATH)
    return head + "\n".join(lock_lines(freeze, keep)) + "\n"


@dataclass(frozen=True)
class Lock:
    """A parsed lock file: the Python it was made with and {normalized name: version}."""
    python: str | None
    pins: dict[str, str] = field(default_factory=dict)


def parse(text: str) -> Lock:
    python = re.search(r"^# python: (\d+\.\d+)", text, re.M)
    pins = {}
    for line in text.splitlines():
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line.split("#")[0].strip())
        if match:
            pins[normalize(match.group(1))] = match.group(2)
    return Lock(python.group(1) if python else None, pins)


def find_lock() -> Path | None:
    """The lock beside this labkit checkout (editable installs: the repo, a container's /opt/labkit)."""
    path = Path(__file__).resolve().parent.parent / LOCK_PATH
    return path if path.is_file() else None


def distributions() -> dict[str, metadata.Distribution]:
    """{normalized name: distribution} of this environment (the first on sys.path wins, as for imports).

    Only install locations count: a folder inside a package is its vendored copies (setuptools puts
    setuptools/_vendor on sys.path once imported, with its own tomli, zipp...), which pip never installed."""
    out = {}
    places = [p for p in sys.path if not (Path(p or ".") / ".." / "__init__.py").is_file()]
    for dist in metadata.distributions(path=places):
        name = dist.metadata["Name"]
        if name:
            out.setdefault(normalize(name), dist)
    return out


def requirements(dist: metadata.Distribution) -> list[tuple[str, frozenset[str], str | None]]:
    """(name, extras it asks for, the extra it belongs to or None) of each requirement in `dist`'s
    metadata: 'jsonschema[format-nongpl]>=4; extra == "cli"' -> ('jsonschema', {'format-nongpl'}, 'cli')."""
    out = []
    for req in dist.requires or []:
        head = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", req)
        asked = frozenset(normalize(e) for e in (head.group(2) or "").split(",") if e.strip())
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", req)
        out.append((normalize(head.group(1)), asked, normalize(extra.group(1)) if extra else None))
    return out


def needed(dists: dict[str, metadata.Distribution], root: str = "labkit") -> tuple[set[str], set[str]]:
    """(labkit's own requirements outside its extras, every installed package labkit's code can reach):
    its requirements (its extras too) and theirs, transitively through what is installed, following
    the extras each requirement asks for (jsonschema[format-nongpl]). Environment markers other than
    `extra` are not evaluated: a requirement counts when its package is installed."""
    if root not in dists:
        return set(), set()  # labkit on sys.path without being installed: nothing to walk from
    own = requirements(dists[root])
    base = {name for name, _, extra in own if extra is None}
    reach: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(name, asked) for name, asked, _ in own if name in dists]
    while todo:
        name, asked = todo.pop()
        if (name, asked) in seen:
            continue
        seen.add((name, asked))
        reach.add(name)
        todo += [(n, a) for n, a, extra in requirements(dists[name])
                 if n in dists and (extra is None or extra in asked)]
    return base, reach


def compare(lock: Lock, have: dict[str, str], base: set[str], reach: set[str],
            python: str | None = None) -> list[str]:
    """What differs between an environment and the lock, one line each ([] = it matches):
    - a package labkit uses (`reach`) installed at another version than the lock's (torch's +cuXXX
      build label is ignored), or not in the lock at all (added after the lock was made);
    - a package labkit requires (`base`) that is not installed;
    - another Python than the lock's.
    Locked packages that are not installed and not required (the test tools on a GPU node) and
    installed packages labkit does not use (conda's own, a base image's) do not count."""
    out = []
    if lock.python and python and python != lock.python:
        out.append(f"python {python} runs here, the lock was made with {lock.python}")
    for name in sorted(reach):
        if name == "labkit" or name in INSTALLERS or TORCH_BUILD_PACKAGES.match(name):
            continue
        want = lock.pins.get(name)
        if want is None:
            out.append(f"{name} {have[name]} installed, not in the lock (run `make lock`)")
        elif public(have[name]) != want:
            out.append(f"{name} {have[name]} installed, the lock has {want}")
    for name in sorted(base - set(have)):
        out.append(f"{name} is not installed" + (f" (the lock has {lock.pins[name]})" if name in lock.pins else ""))
    return out


def status(path: Path | None = None) -> dict:
    """`labkit env`'s lock facts: {'path', 'matches', 'differences'}; path None when no lock is found."""
    path = path or find_lock()
    if path is None or not path.is_file():
        return {"path": None, "matches": None,
                "differences": [f"no {LOCK_PATH} beside labkit (installed without its repository?)"]}
    dists = distributions()
    base, reach = needed(dists)
    have = {name: dist.version for name, dist in dists.items()}
    diffs = compare(parse(path.read_text()), have, base, reach, "%d.%d" % sys.version_info[:2])
    return {"path": str(path), "matches": not diffs, "differences": diffs}


def main() -> int:
    """`pip freeze | python -m labkit.lockfile > requirements/lock.txt` (what `make lock` runs), in the
    venv whose freeze it reads: it keeps labkit's dependency tree there."""
    dists = distributions()
    if "labkit" not in dists:
        print("error: labkit is not installed in this environment -> run `make venv` first", file=sys.stderr)
        return 1
    sys.stdout.write(render(sys.stdin.read(), needed(dists)[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
