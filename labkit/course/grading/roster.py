"""The class list: `labkit grade --roster roster.csv` (issue #40 item 3).

A roster is a CSV with a header row: `id` (the student id; also accepted: `student id`, `sid`, `student`),
`name`, `email` and `extension` (optional; days added to `--deadline` for that student, e.g. `2` or `0.5`).
A student's folder in SUBMISSIONS_DIR is theirs when its name is their id or their email (letter case aside).

With a roster every rostered student gets a row for every notebook graded: one who submitted nothing gets
status `missing`, 0 points and "not submitted"; folders that match nobody are still graded (nothing a student
handed in is dropped) and listed in OUT_DIR/unrostered.csv and as warnings. The exports take the name, id
and email from the roster (canvas.csv, gradescope/).
"""
from __future__ import annotations

import csv
import hashlib
import math
from dataclasses import astuple, dataclass
from pathlib import Path

from labkit.errors import GradingError

ID_HEADERS = ("id", "student id", "student_id", "sid", "student")


@dataclass(frozen=True)
class Student:
    id: str
    name: str = ""
    email: str = ""
    extension_days: float = 0.0
    """Days added to the class deadline for this student (labkit.course.grading.late)."""


@dataclass(frozen=True)
class Roster:
    students: tuple[Student, ...]

    def find(self, folder: str) -> Student | None:
        """The rostered student whose id or email is `folder` (letter case aside), or None."""
        key = folder.casefold()
        for s in self.students:
            if key in (s.id.casefold(), s.email.casefold()) and key:
                return s
        return None

    def rows(self) -> list[list]:
        """The roster as plain data (a shard's plan carries it: shards under other rosters never merge)."""
        return [list(astuple(s)) for s in self.students]

    @classmethod
    def from_rows(cls, rows) -> "Roster":
        return cls(tuple(Student(str(a), str(b), str(c), float(d)) for a, b, c, d in rows))

    def digest(self) -> str:
        return hashlib.sha256(repr(self.rows()).encode("utf-8", "surrogatepass")).hexdigest()


def _extension(text: str, where: str) -> float:
    text = text.strip()
    if not text:
        return 0.0
    try:
        days = float(text.removesuffix("d").strip())
    except ValueError:
        days = -1.0
    if not math.isfinite(days) or days < 0:
        raise GradingError(f"{where}: extension {text!r}; give a number of days >= 0 (e.g. 2 or 0.5), or leave it "
                           "empty")
    return days


def load(path: str | Path) -> Roster:
    """The roster in CSV file `path`; GradingError naming the line and the fix for anything else."""
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            lines = list(csv.reader(fh))
    except OSError as exc:
        raise GradingError(f"--roster {path}: {exc.strerror}; give a CSV file with the columns id,name,email,"
                           "extension") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise GradingError(f"--roster {path} is not a UTF-8 CSV file ({exc}); export it from your spreadsheet as "
                           "CSV UTF-8") from None
    if not lines:
        raise GradingError(f"--roster {path} is empty; give a header row id,name,email,extension and one line per "
                           "student")
    header = [h.strip().casefold() for h in lines[0]]
    id_col = next((header.index(h) for h in ID_HEADERS if h in header), None)
    if id_col is None:
        raise GradingError(f"--roster {path}: no student id column in the header {lines[0]!r}; name one of "
                           f"{', '.join(ID_HEADERS)} (and optionally name, email, extension)")
    col = {k: header.index(k) for k in ("name", "email", "extension") if k in header}
    students, seen = [], {}
    for number, line in enumerate(lines[1:], 2):
        if not any(cell.strip() for cell in line):
            continue
        get = lambda i: line[i].strip() if i is not None and i < len(line) else ""  # noqa: E731
        sid = get(id_col)
        where = f"--roster {path}, line {number}"
        if not sid:
            raise GradingError(f"{where}: no student id; fill it in or delete the line")
        if sid.casefold() in seen:
            raise GradingError(f"{where}: student id {sid!r} is also on line {seen[sid.casefold()]}; one line per "
                               "student")
        seen[sid.casefold()] = number
        students.append(Student(sid, get(col.get("name")), get(col.get("email")),
                                _extension(get(col.get("extension")), where)))
    if not students:
        raise GradingError(f"--roster {path} lists no student; add one line per student under the header")
    return Roster(tuple(students))
