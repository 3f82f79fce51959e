"""OUT_DIR/report.html: the class at a glance, for instructors (issue #40 item 8).

One static page (no script, figures as embedded PNGs, labkit.viz.class_report): the score distribution of
each lab; the pass rate of every check and test; the most common failure messages; the class's recorded runs
(each student's speedup over their own 1-GPU run of a strategy, and peak memory per GPU per strategy). It is
a function of the rows (Grade.runs carries each submission's recorded runs), so a merge of shards writes the
same page. It names hidden checks and their messages: keep it with grades.csv, never give it to students.
"""
from __future__ import annotations

import base64
import html
import io
from collections import Counter, defaultdict
from pathlib import Path
from typing import Sequence

from labkit.course.grading.evaluate import GRADED
from labkit.course.grading.text import clean

MAX_RUNS = 50
GIB = 2**30


def runs_of(nb) -> tuple[tuple, ...]:
    """(key, strategy, ranks, throughput, peak GiB per GPU) of each recorded run of `nb` (50 at most)."""
    from labkit.course.grading.evidence import collect

    out = []
    for rec in collect(nb):
        record = rec.payload.get("record") if rec.kind == "run" else None
        if not isinstance(record, dict):
            continue
        try:
            throughput = float(record.get("samples_per_s") or record.get("tokens_per_s") or 0.0)
            peaks = [float(p) for p in record.get("peak_bytes") or [] if isinstance(p, (int, float))]
            out.append((clean(rec.key, 100), clean(record.get("strategy", "?"), 60), int(record.get("world_size", 1)),
                        throughput, max(peaks, default=0.0) / GIB))
        except (TypeError, ValueError):
            continue
    return tuple(out[:MAX_RUNS])


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _speedups(rows) -> list[tuple[str, int, float]]:
    """(strategy, ranks, throughput / the same student's 1-rank throughput of that strategy or of `single`)."""
    out = []
    for row in rows:
        base: dict[str, float] = {}
        for _, strategy, ranks, thr, _ in row.runs:
            if ranks == 1 and thr > 0:
                base.setdefault(strategy, thr)
        for _, strategy, ranks, thr, _ in row.runs:
            ref = base.get(strategy) or base.get("single")
            if ranks > 1 and ref and thr > 0:
                out.append((strategy, ranks, thr / ref))
    return out


def _table(head: Sequence[str], lines) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(clean(c, 400))}</td>" for c in line) + "</tr>"
                   for line in lines)
    return f"<table><tr>{cells}</tr>{body}</table>"


_CSS = ("body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}"
        "table{border-collapse:collapse;margin:.5rem 0 1.5rem}td,th{border:1px solid #ccc;padding:.25rem .5rem;"
        "text-align:left;vertical-align:top;font-size:.9rem}img{max-width:100%}")


def page(rows, maxima: dict[str, float]) -> str:
    from labkit.viz import class_report

    graded = [r for r in rows if r.status == GRADED]
    scores: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r.notebook:
            scores[r.notebook].append(float(r.score))
    parts = [f"<h1>Class report</h1><p>{len(rows)} rows, {len({r.student for r in rows})} students, "
             f"{len(graded)} graded. For instructors: it names hidden checks and their messages.</p>"]
    if scores:
        parts.append(f'<h2>Scores</h2><img alt="score distribution per lab" '
                     f'src="{_png(class_report.score_histograms(scores, maxima))}">')
    passed: dict[tuple[str, str], list[bool]] = defaultdict(list)
    failures: Counter = Counter()
    for r in graded:
        for res in r.results:
            passed[(r.notebook, res.name)].append(res.passed)
            if not res.passed and res.message:
                failures[(r.notebook, res.name, res.message)] += 1
    parts.append("<h2>Pass rate per check and test</h2>" + _table(
        ("notebook", "check or test", "passed", "pass rate"),
        ((nb, name, f"{sum(v)}/{len(v)}", f"{sum(v) / len(v):.0%}") for (nb, name), v in sorted(passed.items()))))
    parts.append("<h2>Most common failure messages</h2>" + _table(
        ("notebook", "check or test", "students", "message"),
        ((nb, name, str(n), msg) for (nb, name, msg), n in failures.most_common(15))))
    speedups = _speedups(rows)
    peaks = [(strategy, peak) for r in rows for _, strategy, _, _, peak in r.runs if peak > 0]
    parts.append("<h2>The class's recorded runs</h2>")
    if speedups:
        parts.append(f'<img alt="speedup vs GPUs" src="{_png(class_report.speedup_vs_gpus(speedups))}">')
    if peaks:
        parts.append(f'<img alt="peak memory per strategy" '
                     f'src="{_png(class_report.peak_memory_by_strategy(peaks))}">')
    if not speedups and not peaks:
        parts.append("<p>No recorded run in these notebooks.</p>")
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>labkit class report</title>"
            f"<style>{_CSS}</style></head><body>{''.join(parts)}</body></html>\n")


def write(rows, maxima: dict[str, float], path: Path) -> Path:
    path.write_text(page(rows, maxima), encoding="utf-8")
    return path
