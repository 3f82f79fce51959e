"""What a student may know of the hidden tests: how many per exercise, their points, what they vary (issue #30).

The hidden file's authors write `VARIES = {"<id>": "other rank counts and shapes"}`. In the source tree
`ex.check` and `labkit check` read it from `tests/hidden/NN_x.py`; a release (`labkit assign`) has no hidden
file beside the notebook, only `tests/NN_x.hidden.json`, written from it. Never their names or content.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class HiddenInfo:
    tests: int
    points: float
    varies: str = ""

    def line(self, when: str = "when your instructor grades") -> str:
        what = f": they vary {self.varies}" if self.varies else ""
        plural = "s" if self.tests != 1 else ""
        return f"+ {self.tests} hidden test{plural} ({self.points:g} pts) {when}{what}"


#: A self-study copy's `ex.check` line: the hidden tests are the learner's, run by `labkit check`.
OWN_COPY = "in your copy's tests/hidden/ (`labkit check` runs them)"


#: A release's `tests/NN_x.hidden.json` (a self-study copy carries the hidden tests themselves instead).
MANIFEST_SUFFIX = ".hidden.json"


def manifest_path(tests_dir: Path, notebook: str) -> Path:
    return Path(tests_dir) / f"{notebook}{MANIFEST_SUFFIX}"


def from_hidden_file(path: Path) -> dict[str, HiddenInfo]:
    """{exercise: HiddenInfo} of a hidden test file."""
    from labkit.course.exercises.cases import load_cases, load_varies

    cases = load_cases(path, hidden=True)
    varies = load_varies(path)
    out: dict[str, HiddenInfo] = {}
    for exercise in dict.fromkeys(c.exercise for c in cases):
        mine = [c for c in cases if c.exercise == exercise]
        out[exercise] = HiddenInfo(len(mine), sum(c.points for c in mine), varies.get(exercise, ""))
    return out


def write_manifest(hidden_file: Path, tests_dir: Path) -> Path:
    """`tests_dir/NN_x.hidden.json` from the hidden file `NN_x.py` (for a release)."""
    path = manifest_path(tests_dir, Path(hidden_file).stem)
    path.write_text(json.dumps({k: asdict(v) for k, v in from_hidden_file(Path(hidden_file)).items()}, indent=1))
    return path


def own_hidden_tests(notebook: str, tests_dir: Path | None) -> Path | None:
    """The hidden tests a learner's own copy carries (TESTS/hidden/NN_x.py beside the visible ones: `make student`,
    labkit.course.selfstudy); None in a class release, and in the course's source tree (graded with `labkit grade`)."""
    from labkit.course.exercises.grading import source_tests_dir

    if tests_dir is None or Path(tests_dir).resolve() == source_tests_dir().resolve():
        return None
    path = Path(tests_dir) / "hidden" / f"{notebook}.py"
    return path if path.is_file() else None


def hidden_info(notebook: str, tests_dir: Path | None) -> dict[str, HiddenInfo]:
    """What the visible tests folder `tests_dir` tells of `notebook`'s hidden tests ({} when nothing)."""
    if tests_dir is None:
        return {}
    source = Path(tests_dir) / "hidden" / f"{notebook}.py"
    if source.is_file():
        return from_hidden_file(source)
    manifest = manifest_path(Path(tests_dir), notebook)
    if not manifest.is_file():
        return {}
    try:
        data = json.loads(manifest.read_text())
        return {str(k): HiddenInfo(int(v["tests"]), float(v["points"]), str(v.get("varies", "")))
                for k, v in data.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}
