"""Grading a class on many machines: `labkit grade ... --emit slurm` and `labkit grade merge`.

The submissions are split by student (sorted names, student i in shard i % K): `labkit grade SUBS --out PART
--shard I/K` grades shard I with the very code of a single-machine run (batch.run_batch, the same sandbox per
submission) and writes PART's gradebook plus PART/shard.json: its rows as data, the plan (points possible per
notebook and the options that decide them), and a digest of the whole listing it split. `merge` checks that
the parts are the K shards of one listing under one plan (none missing, none twice), joins their rows, finds
copies across all of them and writes the gradebook with gradebook.write_all: the same files, byte for byte,
as one machine grading every submission (tests/test_grading_shards.py compares them).

`emit_slurm` writes a SLURM array job, one task per shard; each task runs that command with
I = $SLURM_ARRAY_TASK_ID (run one by hand: `SLURM_ARRAY_TASK_ID=3 bash OUT/slurm/grade.sbatch`).
"""
from __future__ import annotations

import csv
from collections import Counter
import hashlib
import json
import math
import shlex
import shutil
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from labkit.course.grading import copies, gradebook, manual, questions, similarity
from labkit.course.grading.late import LatePolicy
from labkit.course.grading.checks import CheckResult
from labkit.course.grading.evaluate import Grade
from labkit.course.grading.roster import Roster
from labkit.errors import GradingError

SHARD_FILE = "shard.json"
FORMAT = 2


def parse_shard(text: str) -> tuple[int, int]:
    """'3/8' -> (3, 8); GradingError naming the form otherwise."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise GradingError(f"--shard {text!r}; give I/K with 0 <= I < K (shard I of K, e.g. 0/8)")
    return index, count


def students(subs) -> list[str]:
    return sorted({s.student for s in subs})


def select(subs, index: int, count: int) -> list:
    """The submissions of shard `index` of `count`: every notebook of student i (sorted names) in shard i % count."""
    mine = {s for i, s in enumerate(students(subs)) if i % count == index}
    return [s for s in subs if s.student in mine]


def listing(subs) -> str:
    """Digest of what was split: every (student, notebook) found (shards must agree on it)."""
    text = "\n".join(f"{s.student}\x00{s.notebook}" for s in sorted(subs, key=lambda s: (s.student, s.notebook)))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def plan_of(opts, maxima: dict[str, float], roster=None, questions_list=()) -> dict:
    """What decides a row's points and the gradebook's columns: shards graded under different plans do not merge."""
    return {"maxima": maxima, "notebook": opts.notebook, "execute": opts.execute, "profile": opts.profile,
            "autograder": opts.autograder, "checks": list(opts.private),
            "roster": roster.rows() if roster is not None else None,
            "questions": questions.as_data(questions_list), "export_questions": opts.export_questions,
            "late": asdict(opts.late) if opts.late is not None else None, "similarity": opts.similarity}


def _row_data(row: Grade) -> dict:
    return {**asdict(replace(row, review="")), "results": [asdict(r) for r in row.results]}


def _row(data: dict) -> Grade:
    fields = dict(data)
    fields["results"] = tuple(CheckResult(**r) for r in fields["results"])
    for key in ("digests", "signatures"):
        fields[key] = tuple(fields[key])
    for key in ("answers", "runs"):
        fields[key] = tuple(tuple(a) for a in fields.get(key, ()))
    return Grade(**fields)


def write_shard(out_dir: Path, index: int, count: int, all_subs, rows: Sequence[Grade], plan: dict) -> Path:
    entries = sorted([s.student, s.notebook] for s in all_subs)
    data = {"format": FORMAT, "shard": index, "of": count, "listing": listing(all_subs),
            "submissions": len(all_subs), "entries": entries, "plan": plan, "rows": [_row_data(r) for r in rows]}
    path = out_dir / SHARD_FILE
    path.write_text(json.dumps(data, indent=1, ensure_ascii=True) + "\n", encoding="utf-8")
    return path


def _read(part: Path) -> dict:
    path = part / SHARD_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError:
        raise GradingError(f"{part} is not a shard (no {SHARD_FILE}); pass the --out folders of `labkit grade "
                           "--shard I/K` (the SLURM tasks' OUT/parts/shard-*)") from None
    except ValueError as exc:
        raise GradingError(f"{path} is not valid JSON ({exc}); grade that shard again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise GradingError(f"{path} was written by another labkit version; grade that shard again")
    return data


@dataclass(frozen=True)
class _Entry:
    student: str
    notebook: str


def _check_rows(path: Path, data: dict, count: int) -> None:
    """GradingError unless the rows of shard `data` are its submissions of the listing, each exactly once."""
    try:
        entries = [_Entry(str(a), str(b)) for a, b in data["entries"]]
        rows = [(str(r["student"]), str(r["notebook"])) for r in data["rows"]]
    except (KeyError, TypeError, ValueError):
        raise GradingError(f"{path} is malformed (its entries or rows); grade that shard again") from None
    if listing(entries) != data["listing"] or len(entries) != data["submissions"]:
        raise GradingError(f"{path}: its list of submissions does not match its digest; grade that shard again")
    expected = sorted((e.student, e.notebook) for e in select(entries, data["shard"], count))
    repeated = sorted(r for r, n in Counter(rows).items() if n > 1)
    if repeated:
        raise GradingError(f"{path} grades {repeated[0][0]!r}/{repeated[0][1]!r} more than once; grade that shard "
                           "again")
    foreign = sorted(set(rows) - set(expected))
    if foreign or sorted(rows) != expected:
        what = (f"{foreign[0][0]!r}/{foreign[0][1]!r}, which is not one of its students" if foreign else
                f"no row for {sorted(set(expected) - set(rows))[0][0]!r}")
        raise GradingError(f"{path} (shard {data['shard']}/{count}) holds {what}; grade that shard again with "
                           "`labkit grade ... --shard I/K`")


def merge(parts: Sequence[str | Path], out_dir: str | Path) -> tuple[list[Grade], list, list[str]]:
    """Join the shard folders `parts` into one gradebook in `out_dir`: (rows, copies.Pair list, problems)."""
    if not parts:
        raise GradingError("no shards to merge; give the shard folders: labkit grade merge OUT/parts/shard-* --out OUT")
    datas = {Path(p): _read(Path(p)) for p in parts}
    first_path, first = next(iter(datas.items()))
    count = first["of"]
    seen: dict[int, Path] = {}
    for path, data in datas.items():
        if data["of"] != count:
            raise GradingError(f"{first_path} is a shard of {count} but {path} of {data['of']}; merge the shards "
                               "of one `--emit slurm` run")
        if data["listing"] != first["listing"]:
            raise GradingError(f"{path} split other submissions than {first_path} ({data['submissions']} vs "
                               f"{first['submissions']} found): the submissions changed between tasks; grade every "
                               "shard again")
        if data["plan"] != first["plan"]:
            raise GradingError(f"{path} was graded under another plan than {first_path} (options, checks or tests "
                               "differ); grade every shard with the same command")
        if data["shard"] in seen:
            raise GradingError(f"{seen[data['shard']]} and {path} are both shard {data['shard']}/{count}; pass each "
                               "shard once")
        seen[data["shard"]] = path
        _check_rows(path, data, count)
    missing = sorted(set(range(count)) - set(seen))
    if missing:
        ids = ",".join(map(str, missing))
        raise GradingError(f"shard(s) {ids} of {count} missing; run them (sbatch --array={ids} OUT/slurm/grade.sbatch, "
                           f"or SLURM_ARRAY_TASK_ID={missing[0]} bash OUT/slurm/grade.sbatch) and merge again")
    rows = sorted((_row(r) for d in datas.values() for r in d["rows"]), key=lambda r: (r.student, r.notebook))
    policy = LatePolicy(**first["plan"]["late"]) if first["plan"].get("late") else None
    rows = manual.apply(rows, manual.load_marks(Path(out_dir) / manual.MARKS), policy)
    maxima = first["plan"]["maxima"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pairs = copies.find_pairs(rows)
    code_pairs = similarity.find_pairs(rows, first["plan"].get("similarity", 0))
    rows = gradebook.normalize(similarity.flag(copies.flag(rows, pairs), code_pairs), maxima)
    class_list = Roster.from_rows(first["plan"]["roster"]) if first["plan"].get("roster") is not None else None
    problems = gradebook.write_all(rows, maxima, out, gradebook.safe_name, pairs, class_list,
                                   questions.from_data(first["plan"].get("questions")),
                                   bool(first["plan"].get("export_questions")), code_pairs)
    _join_received([Path(p) for p in seen.values()], out / "received.csv")
    for part in seen.values():  # --execute: the executed notebooks and logs, student by student
        for sub in ("executed", "logs"):
            if (part / sub).is_dir():
                shutil.copytree(part / sub, out / sub, dirs_exist_ok=True)
    return rows, pairs + code_pairs, problems


def _join_received(parts: list[Path], path: Path) -> None:
    header, lines = None, []
    for part in parts:
        try:
            with (part / "received.csv").open(newline="", encoding="utf-8") as fh:
                reader = csv.reader(fh)
                header = next(reader, header)
                lines += list(reader)
        except OSError:
            continue
    if header is not None:
        with path.open("w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(header)
            writer.writerows(sorted(lines, key=lambda line: (line[0], line[1])))


# ------------------------------------------------------------------------------------------- SLURM


def _hms(seconds: float) -> str:
    seconds = int(math.ceil(seconds))
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def slurm_script(*, submissions: Path, out: Path, count: int, argv: Sequence[str], workers: int,
                 memory_gib: float, seconds: float, cwd: Path, python: str = sys.executable) -> str:
    """The sbatch script of an array of `count` tasks; task I runs `labkit grade SUBS --out OUT/parts/shard-I
    --shard I/count ARGV...` (ARGV: the other options of the emitting command)."""
    part = shlex.quote(str(out / "parts")) + '/shard-"$SLURM_ARRAY_TASK_ID"'
    command = " ".join([shlex.quote(python), "-m", "labkit", "grade", shlex.quote(str(submissions)), "--out", part,
                        "--shard", f'"$SLURM_ARRAY_TASK_ID/{count}"', *map(shlex.quote, argv)])
    merge = f"labkit grade merge {shlex.quote(str(out / 'parts'))}/shard-* --out {shlex.quote(str(out))}"
    return "\n".join([
        "#!/bin/bash",
        "# labkit grade as a SLURM array: one task per shard of the submissions (`labkit grade ... --emit slurm`).",
        f"# Submit: sbatch {shlex.quote(str(out / 'slurm' / 'grade.sbatch'))}",
        f"# When every task is done: {merge}",
        "# One shard by hand: SLURM_ARRAY_TASK_ID=3 bash this-file. Add your site's --partition/--account lines.",
        "#SBATCH --job-name=labkit-grade",
        f"#SBATCH --array=0-{count - 1}",
        f"#SBATCH --cpus-per-task={workers}",
        f"#SBATCH --mem={math.ceil(workers * memory_gib + 2)}G",
        f"#SBATCH --time={_hms(seconds)}",
        f"#SBATCH --output={out / 'slurm' / 'logs' / 'shard-%a.out'}",
        "set -euo pipefail",
        f': "${{SLURM_ARRAY_TASK_ID:?run this with sbatch, or set SLURM_ARRAY_TASK_ID to a shard in 0..{count - 1}}}"',
        f"cd {shlex.quote(str(cwd))}",
        f"exec {command}",
        ""])


def emit_slurm(subs, submissions: Path, out: Path, *, shards: int | None, argv: Sequence[str], workers: int,
               memory_gib: float, per_submission_s: Callable[[object], float]) -> tuple[Path, int]:
    """Write OUT/slurm/grade.sbatch for `subs`; (its path, the number of tasks)."""
    names = students(subs)
    if not names:
        raise GradingError(f"no submissions in {submissions}; expected {submissions}/<student>/<notebook>.ipynb "
                           "(one folder per student)")
    if shards is not None and shards < 1:
        raise GradingError(f"--shards {shards}; give a positive number of SLURM tasks")
    count = min(shards or math.ceil(len(names) / 8), len(names))
    biggest = max((select(subs, i, count) for i in range(count)), key=lambda group: sum(map(per_submission_s, group)))
    seconds = sum(map(per_submission_s, biggest)) / workers + 600  # the slowest shard, one worker each, + start-up
    path = out / "slurm" / "grade.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    (out / "slurm" / "logs").mkdir(exist_ok=True)
    path.write_text(slurm_script(submissions=submissions.resolve(), out=out.resolve(), count=count, argv=argv,
                                 workers=workers, memory_gib=memory_gib, seconds=seconds, cwd=Path.cwd()))
    path.chmod(0o755)
    return path, count
