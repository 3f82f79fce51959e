"""Free-text answers graded by a TA (issue #40 item 5): `manual` checks, `labkit grade review`, marks.

1. A `manual(name, pts, key)` check (labkit.course.grading.checks) reads a text answer recorded with
   `answer(key, "...")`. `labkit grade` gives it 0 and "awaiting a TA's mark", and writes every such answer to
   OUT_DIR/manual.json (student, notebook, question, points, answer, and a digest of the answer).
2. `labkit grade review OUT_DIR` writes OUT_DIR/review.ipynb: one cell calling `review_widget(".")`, which shows
   each student's answer (escaped: it is the student's text), a points box (0 to the question's points) and a
   comment box. Every change is saved at once to OUT_DIR/marks.json (written to a temporary file, then renamed:
   a crash never leaves half a file; marks of answers not shown are kept).
3. The next `labkit grade ... --out OUT_DIR` (or `--marks FILE`) merges the marks: the question earns the TA's
   points, its feedback message is the TA's comment, the row's score and the per-question columns follow.
   A mark whose answer changed since (a new submission) is not applied: the row says it awaits a new mark.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from labkit.course.grading.checks import AWAITING, CheckResult
from labkit.course.grading.text import clean
from labkit.errors import GradingError

ANSWERS, MARKS, NOTEBOOK = "manual.json", "marks.json", "review.ipynb"


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def answers_of(rows) -> list[dict]:
    """The manual answers of `rows` with their question's points (what review.ipynb shows)."""
    out = []
    for row in rows:
        points = {r.name: r.points for r in row.results}
        for question, text in row.answers:
            out.append({"student": row.student, "notebook": row.notebook, "question": question,
                        "points": points.get(question, 0.0), "answer": text, "digest": digest(text)})
    return out


def write_answers(rows, out_dir: Path) -> Path | None:
    """OUT_DIR/manual.json when any row has a manual answer (None otherwise)."""
    answers = answers_of(rows)
    if not answers:
        return None
    path = out_dir / ANSWERS
    path.write_text(json.dumps({"answers": answers}, indent=1, ensure_ascii=True) + "\n", encoding="utf-8")
    return path


def load_marks(path: Path) -> dict[tuple[str, str, str], dict]:
    """{(student, notebook, question): {"points", "comment", "digest"}} of a marks file; {} when there is none."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise GradingError(f"marks file {path} is unreadable ({exc}); restore it from review.ipynb's folder or "
                           "delete it to grade without marks") from None
    out = {}
    for m in data.get("marks", []) if isinstance(data, dict) else []:
        try:
            out[(str(m["student"]), str(m["notebook"]), str(m["question"]))] = {
                "points": float(m["points"]), "comment": str(m.get("comment", "")), "digest": str(m["digest"])}
        except (KeyError, TypeError, ValueError):
            continue
    return out


def save_marks(path: Path, marks: dict[tuple[str, str, str], dict]) -> None:
    """Write `marks` atomically (a temporary file in the same folder, then renamed)."""
    rows = [{"student": s, "notebook": n, "question": q, **m} for (s, n, q), m in sorted(marks.items())]
    fd, tmp = tempfile.mkstemp(prefix=".marks-", dir=str(Path(path).parent))
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump({"marks": rows}, fh, indent=1, ensure_ascii=True)
        fh.write("\n")
    os.replace(tmp, path)


def apply(rows, marks: dict[tuple[str, str, str], dict], late_policy=None):
    """`rows` with each marked manual question earning the TA's points (within [0, its points]) and showing the
    TA's comment; a mark of another answer (the student resubmitted) is left out and the row says so. A late
    row (labkit.course.grading.late, already applied) keeps the same fraction of the marked points."""
    if not marks:
        return list(rows)
    out = []
    for row in rows:
        texts = dict(row.answers)
        results, notes = [], []
        for r in row.results:
            mark = marks.get((row.student, row.notebook, r.name)) if r.name in texts else None
            if mark is None:
                results.append(r)
            elif mark["digest"] != digest(texts[r.name]):
                results.append(replace(r, message=f"{AWAITING} (your answer changed after it was marked)"))
                notes.append(f"{r.name}: the answer changed after it was marked; mark it again")
            else:
                earned = min(max(mark["points"], 0.0), r.points)
                results.append(CheckResult(r.name, r.points, earned, earned > 0, r.visible,
                                           clean(mark["comment"], 2000) or f"marked {earned:g}/{r.points:g}"))
        delta = sum(a.earned for a in results) - sum(b.earned for b in row.results)
        keep = 1.0 - late_policy.fraction_lost(row.days_late) if late_policy is not None and row.days_late else 1.0
        detail = "; ".join(filter(None, (row.detail, *notes)))
        out.append(replace(row, results=tuple(results), score=row.score + delta * keep, detail=detail,
                           late_penalty=round(row.late_penalty + delta * (1.0 - keep), 6)))
    return out


def write_notebook(out_dir: str | Path) -> tuple[Path, bool]:
    """OUT_DIR/review.ipynb (kept when it exists: a TA may have edited it); (its path, whether it was written)."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    out_dir = Path(out_dir)
    if not (out_dir / ANSWERS).is_file():
        raise GradingError(f"no {ANSWERS} in {out_dir}: no manual question was graded there; run `labkit grade "
                           f"SUBMISSIONS --out {out_dir}` first (with a notebook whose checks include `manual`)")
    path = out_dir / NOTEBOOK
    if path.exists():
        return path, False
    nb = new_notebook(cells=[
        new_markdown_cell("# Marking the free-text answers\n\nRun the cell below. Each answer shows the student's "
                          "text, a points box and a comment box; every change is saved to `marks.json` in this "
                          "folder at once. Then run `labkit grade SUBMISSIONS --out THIS_FOLDER` again: the marks "
                          "go into grades.csv and each student's feedback (the comment is what they read)."),
        new_code_cell('from labkit.course.grading.manual import review_widget\n\nreview_widget(".")')],
        metadata={"kernelspec": {"name": "labkit", "display_name": "labkit (Python 3)", "language": "python"},
                  "language_info": {"name": "python"}})  # as the course notebooks: JupyterLab starts it unasked
    nbformat.write(nb, str(path))
    return path, True


def review_widget(out_dir: str | Path = "."):
    """The TA's marking widget over OUT_DIR/manual.json; saves every change to OUT_DIR/marks.json."""
    import html

    import ipywidgets as w

    out_dir = Path(out_dir)
    answers = json.loads((out_dir / ANSWERS).read_text(encoding="utf-8"))["answers"]
    marks = load_marks(out_dir / MARKS)
    status = w.HTML(f"{len(answers)} answer(s); marks are saved to {html.escape(str(out_dir / MARKS))}")
    boxes = []

    def save(*_):
        for a, points, comment in boxes:
            key = (a["student"], a["notebook"], a["question"])
            if points.value is not None and (points.value or comment.value or key in marks):
                marks[key] = {"points": float(points.value), "comment": comment.value, "digest": a["digest"]}
        save_marks(out_dir / MARKS, marks)
        status.value = f"saved {len(marks)} mark(s) to {html.escape(str(out_dir / MARKS))}"

    items = []
    for a in sorted(answers, key=lambda a: (a["notebook"], a["question"], a["student"])):
        old = marks.get((a["student"], a["notebook"], a["question"]), {})
        stale = old and old.get("digest") != a["digest"]
        points = w.BoundedFloatText(value=0.0 if stale else old.get("points", 0.0), min=0.0, max=float(a["points"]),
                                    step=0.5, description="points")
        comment = w.Textarea(value="" if stale else old.get("comment", ""), description="comment",
                             placeholder="what the student reads in their feedback")
        points.observe(save, names="value")
        comment.observe(save, names="value")
        boxes.append((a, points, comment))
        head = (f"<b>{html.escape(clean(a['student'], 200))}</b> &middot; {html.escape(a['notebook'])} &middot; "
                f"{html.escape(a['question'])} ({a['points']:g} pts)"
                + (" &middot; the answer changed since it was marked: mark it again" if stale else ""))
        answer = f"<pre style=\"white-space:pre-wrap\">{html.escape(clean(a['answer'], 20_000))}</pre>"
        items.append(w.VBox([w.HTML(head), w.HTML(answer), points, comment], layout=w.Layout(
            border="1px solid #ccc", padding="6px", margin="4px 0")))
    button = w.Button(description="Save marks", button_style="primary")
    button.on_click(save)
    return w.VBox([status, *items, button])
