"""Grading pieces without a kernel: seals, physical bounds, safe loading, check kinds, registry, outputs."""
from __future__ import annotations

import copy
import json

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

from labkit.errors import ConfigError, GradingError
from labkit.course.grading import checks as K
from labkit.course.grading import feedback, gradebook, registry, tamper
from labkit.course.grading.batch import GradeOptions, find_submissions
from labkit.course.grading.evaluate import Grade, SubmissionProblem, grade_notebook, load_notebook
from labkit.course.grading.evidence import Evidence
from labkit.course.grading.fingerprint import cell_sha256, seal, seal_problem
from labkit.course.grading.sandbox import Limits
from labkit.results import MIME

RUN = dict(strategy="ddp", model="resnet50", profile="a100x4", world_size=4, steps=10, losses=[2.0, 1.0],
           step_time_s=0.2, samples_per_s=2500.0, peak_bytes=[30 * 2**30] * 4, param_bytes=[100 * 2**20] * 4,
           grad_bytes=[100 * 2**20] * 4, optimizer_bytes=[200 * 2**20] * 4, trainable_params=25_557_032,
           device="cuda", dtype="bfloat16", mfu=0.3)


def _nb(*cells, identity="t_units"):
    """A notebook whose code cells (source, [(payload, text), ...]) carry genuinely sealed outputs."""
    nb = new_notebook(metadata={"labkit": {"notebook": identity}})
    for count, (source, payloads) in enumerate(cells, 1):
        outputs = [new_output("display_data", data={MIME: seal(p, t, cell=(source, count)), "text/plain": t})
                   for p, t in payloads]
        nb.cells.append(new_code_cell(source, execution_count=count, outputs=outputs))
    return nbformat.from_dict(json.loads(json.dumps(nb)))  # what a saved-and-reloaded file holds


def _answer(key, value, source=None):
    return (source or f"answer({key!r}, {value!r})", [({"kind": "answer", "key": key, "value": value},
                                                        f"answer {key} = {value!r}")])


def _run(key, **overrides):
    return (f"show({key})", [({"kind": "run", "key": key, "record": {**RUN, **overrides}}, key)])


# ---------------------------------------------------------------- seals
def test_seal_holds_until_payload_or_text_is_edited():
    sealed = seal({"kind": "answer", "key": "q", "value": [1, float("nan")]}, "answer q = [1, nan]")
    stored = json.loads(json.dumps(sealed))  # NaN was made JSON data first, so the round trip keeps the seal
    assert stored["value"] == [1, "nan"] and seal_problem(stored, "answer q = [1, nan]") is None
    assert stored["fingerprint"]["cell_sha256"] is None  # outside IPython there is no cell
    assert "edited" in seal_problem(stored, "answer q = [1, 2]")
    stored["value"] = [1, 2]
    assert "edited" in seal_problem(stored, "answer q = [1, nan]")
    assert "no labkit seal" in seal_problem({"kind": "answer", "value": 1}, None)


def test_cell_hash_ignores_whitespace_noise_but_not_code():
    assert cell_sha256("x = 1  \r\ny = 2\n\n") == cell_sha256("x = 1\ny = 2")
    assert cell_sha256("x = 1\ny = 2") != cell_sha256("x = 1\ny = 3")


def test_sealed_notebook_is_clean_and_moved_or_recounted_outputs_are_not():
    nb = _nb(_answer("a", 1.0), _answer("b", 2.0))
    assert tamper.problems(nb) == []
    recount = copy.deepcopy(nb)
    recount.cells[0].execution_count = 7
    assert "comes from execution [1] but the cell shows [7]" in tamper.problems(recount)[0]
    moved = copy.deepcopy(nb)
    moved.cells[0].outputs, moved.cells[1].outputs = moved.cells[1].outputs, moved.cells[0].outputs
    assert len(tamper.problems(moved)) == 2
    markdown = copy.deepcopy(nb)
    markdown.cells[0].cell_type = "markdown"
    assert "sits in a markdown cell" in tamper.problems(markdown)[0]
    assert tamper.problems(moved, seals_only=True) == []  # a re-execution makes moved outputs moot


# ---------------------------------------------------------------- physics
def test_a_notebook_sealed_before_typed_facts_still_grades():
    # Schema 1 (a flat `extra`), sealed by the labkit of that time: the seal holds on the stored data and
    # the checks read the facts it maps to.
    from labkit.course.grading.nb_checks import lab05_zero
    old = _run("zero1", strategy="zero1", schema=1, extra={"master_copy_bytes": 4096, "zero_stage": 1,
                                                         "comm_bytes_per_rank": {"all_gather": 10, "reduce_scatter": 10}})
    nb = _nb(old)
    assert tamper.problems(nb) == []
    ev = Evidence.from_notebook(nb)
    assert lab05_zero.zero1_master_bytes(ev) == 4096.0
    run = ev.run("zero1")
    assert run.sharding.zero_stage == 1 and run.comm.total == 20 and run.schema == 2


def test_device_specs_pick_the_right_family():
    assert tamper.device_spec("NVIDIA A100-SXM4-40GB") == (312e12, 40 * 2**30)
    assert tamper.device_spec("NVIDIA A10G")[0] == 125e12
    assert tamper.device_spec("NVIDIA H100 80GB HBM3") == (989e12, 80 * 2**30)
    assert tamper.device_spec("cpu: Intel Xeon")[1] is None


def test_physical_bounds_flag_only_impossible_runs():
    a100 = "NVIDIA A100-SXM4-80GB"
    assert tamper.physical_problems(RUN, a100) == []
    fast = tamper.physical_problems({**RUN, "samples_per_s": 200_000.0}, a100)
    assert len(fast) == 1 and "resnet50 at 2e+05 samples/s" in fast[0]
    assert "more than NVIDIA A100-SXM4-40GB holds" in tamper.physical_problems(
        {**RUN, "peak_bytes": [45 * 2**30] * 4}, "NVIDIA A100-SXM4-40GB")[0]
    assert "MFU 1.50" in tamper.physical_problems({**RUN, "mfu": 1.5}, a100)[0]
    assert "tokens_per_s=-1.0" in tamper.physical_problems({**RUN, "tokens_per_s": -1.0}, a100)[0]
    llm = {**RUN, "model": "llama2-7b", "param_bytes": [14e9] * 4, "tokens_per_s": 1e6}
    assert "throughput" in tamper.physical_problems(llm, a100)[0]  # 7B x 1M tok/s > 4 A100s


# ---------------------------------------------------------------- loading
def test_load_refuses_huge_files_before_reading(tmp_path):
    path = tmp_path / "huge.ipynb"
    with path.open("wb") as fh:
        fh.truncate(10 * 2**30)  # sparse: 10 GiB on paper, nothing on disk
    with pytest.raises(SubmissionProblem, match="10240.0 MiB, above the 50 MiB cap") as info:
        load_notebook(path)
    assert info.value.status == "invalid"


@pytest.mark.parametrize("content, reason", [
    (b"\xff\xfe not text", "not UTF-8"), (b"[1, 2]", "not a Jupyter notebook"),
    (b"[" * 200_000, "not valid JSON|too deeply"), (b'{"cells": []}', "nbformat None, not 4"),
    (b'{"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [{"cell_type": "code", "source": 5}]}',
     "not a valid notebook"),
])
def test_load_reports_malformed_files_as_invalid(tmp_path, content, reason):
    path = tmp_path / "bad.ipynb"
    path.write_bytes(content)
    with pytest.raises(SubmissionProblem, match=reason):
        load_notebook(path)


def test_nbformat_comes_without_the_grammar_of_iris_which_still_checks_iris(tmp_path):
    """import_nbformat (issue #39): jsonschema's rfc3987_syntax grammar (a second of every `labkit check`) is not
    built by importing nbformat, a malformed notebook is still refused, and jsonschema's "iri" format still
    rejects a bad IRI (the real module loads on first use). A fresh Python: this one imported nbformat."""
    import subprocess
    import sys

    bad = tmp_path / "bad.ipynb"
    bad.write_text('{"nbformat": 4, "nbformat_minor": 5, "metadata": {}, '
                   '"cells": [{"cell_type": "code", "source": 5}]}')
    code = ("import sys\n"
            "from labkit.course.grading.evaluate import SubmissionProblem, import_nbformat, load_notebook\n"
            "nbformat = import_nbformat()\n"
            "print('grammar built:', 'rfc3987_syntax' in sys.modules)\n"
            f"try:\n    load_notebook({str(bad)!r})\nexcept SubmissionProblem as exc:\n    print('refused:', exc)\n"
            "from jsonschema import Draft7Validator\n"
            "v = Draft7Validator({'format': 'iri'}, format_checker=Draft7Validator.FORMAT_CHECKER)\n"
            "print('iri checked:', v.is_valid('http://example.org/ok'), v.is_valid('http://not an iri/'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "grammar built: False" in out, out
    assert "refused: bad.ipynb is not a valid notebook" in out, out
    assert "iri checked: True False" in out, out


# ---------------------------------------------------------------- check kinds
def test_check_kinds_pass_and_fail_with_a_fix():
    nb = _nb(_answer("mem", 112.0), _answer("word", "ZeRO-3 "), _answer("text", "many"),
             _run("ddp"), _run("fsdp", peak_bytes=[10 * 2**30] * 4, samples_per_s=2400.0))
    ev = Evidence.from_notebook(nb)
    ok = lambda check: check.run(ev)  # noqa: E731
    assert ok(K.answer_close("m", 1, "mem", lambda e: 110.0, rtol=0.05)).passed
    close = ok(K.answer_close("m", 1, "mem", 50.0))
    assert not close.passed and "not within 5% of labkit's value;" in close.message and "50" not in close.message
    hidden = ok(K.answer_close("m", 1, "mem", 50.0, visible=False))  # the instructor's view names it
    assert not hidden.passed and "not within 5% of labkit's value 50;" in hidden.message
    assert "record a finite number" in ok(K.answer_close("t", 1, "text", 1.0)).message
    assert "no answer 'nope' recorded" in ok(K.answer_close("n", 1, "nope", 1.0)).message
    assert ok(K.answer_equals("w", 1, "word", "zero-3")).passed
    assert ok(K.peak_below("p", 1, "fsdp", "ddp")).passed
    assert not ok(K.peak_below("p", 1, "ddp", "fsdp")).passed
    assert ok(K.fits_in("f", 1, "fsdp", 24)).passed and not ok(K.fits_in("f", 1, "ddp", 24)).passed
    speed = ok(K.speedup_at_least("s", 1, "fsdp", "ddp", lambda e: 1.2))
    assert not speed.passed and "0.96x (< 1.2x)" in speed.message
    assert "no run 'pp' recorded" in ok(K.peak_below("p", 1, "pp", "ddp")).message
    assert "ZeroDivisionError" in ok(K.relation("r", 1, lambda e: 1 / 0)).message
    assert not ok(K.figure_present("fig", 1)).passed


def test_cell_ran_names_the_failing_cell():
    nb = _nb(_answer("a", 1.0), ("1 / 0", []))
    nb.cells[1].outputs = [new_output("error", ename="ZeroDivisionError", evalue="division by zero", traceback=[])]
    ev = Evidence.from_notebook(nb)
    result = K.cell_ran("all", 1).run(ev)
    assert not result.passed and result.message.startswith("cell 2 raised ZeroDivisionError")
    assert K.cell_ran("a ran", 1, key="a").run(ev).passed


def test_check_and_registry_validation():
    with pytest.raises(ConfigError, match="points=0"):
        K.answer_close("x", 0, "k", 1.0)
    with pytest.raises(ConfigError, match="two checks are named 'x'"):
        registry.register("t_dup", [K.cell_ran("x", 1), K.cell_ran("x", 2)])
    with pytest.raises(GradingError, match="no checks are declared for notebook 'nope'"):
        registry.checks_for("nope")
    with pytest.raises(ConfigError, match="workers=0"):
        GradeOptions(workers=0)
    with pytest.raises(ConfigError, match="timeout_s=0"):
        Limits(timeout_s=0)


def test_private_checks_file_adds_hidden_checks(tmp_path):
    path = tmp_path / "private.py"
    path.write_text("from labkit.course.grading.checks import answer_close\n"
                    "CHECKS = {'t_private': [answer_close('hidden one', 2, 'a', 1.0, visible=False)]}\n")
    try:
        assert registry.load_file(path) == ["t_private"]
        (check,) = registry.checks_for("t_private")
        assert check.name == "hidden one" and not check.visible
    finally:
        registry.unregister("t_private")


# ---------------------------------------------------------------- grading and outputs
def test_grade_notebook_statuses():
    checks = [K.answer_close("a is 1", 1, "a", 1.0)]
    assert grade_notebook(_nb(_answer("a", 1.0)), "t_units", checks).status == "graded"
    wrong = grade_notebook(_nb(_answer("a", 1.0), identity="other"), "t_units", checks)
    assert wrong.status == "invalid" and "wrong notebook" in wrong.detail
    edited = _nb(_answer("a", 3.0))
    edited.cells[0].outputs[0]["data"][MIME]["value"] = 1.0
    assert grade_notebook(edited, "t_units", checks).status == "tampered"


def test_feedback_hides_hidden_messages_and_escapes_html():
    results = (K.CheckResult("visible <b>", 1, 0, False, True, "fix <script>"),
               K.CheckResult("hidden one", 2, 0, False, False, "expected 42.4242"))
    page = feedback.student_html("<eve>", [Grade("<eve>", "nb", "graded", 0, 3, "", results)])
    assert "42.4242" not in page and "<script>" not in page and "&lt;script&gt;" in page
    assert "hidden one" in page and "&lt;eve&gt;" in page


def test_csv_fields_cannot_become_formulas(tmp_path):
    rows = [Grade("=HYPERLINK(1)", "nb", "graded", 1, 2, "@cmd")]
    text = gradebook.write_grades(rows, tmp_path / "g.csv").read_text()
    assert "'=HYPERLINK(1)" in text and "'@cmd" in text
    assert gradebook.safe_name("../x y") != gradebook.safe_name("_x_y") and "/" not in gradebook.safe_name("../x")


def test_find_submissions_gives_every_student_a_row(tmp_path):
    (tmp_path / "ann").mkdir()
    (tmp_path / "ann" / "01_memory.ipynb").write_text("{}")
    (tmp_path / "bob").mkdir()
    (tmp_path / ".git").mkdir()
    subs = find_submissions(tmp_path)
    assert [(s.student, s.notebook, s.path is not None) for s in subs] == [("ann", "01_memory", True),
                                                                           ("bob", "", False)]
    subs = find_submissions(tmp_path, "02_single_gpu")
    assert [(s.student, s.path, s.present) for s in subs] == [("ann", None, ("01_memory.ipynb",)),
                                                              ("bob", None, ())]
    with pytest.raises(GradingError, match="does not exist"):
        find_submissions(tmp_path / "missing")


def test_points_possible_and_every_total_come_from_the_plan(tmp_path):
    """A row claiming 1019 points (the issue's forged report) changes nobody's percentage, its own included."""
    forged = Grade("mallory", "nb", "graded", 1019.0, 1019.0, "",
                   (K.CheckResult("x", 1000, 1000, True, True, ""),))
    rows = [forged, Grade("ann", "nb", "graded", 19.0, 19.0, "")]
    assert gradebook.write_all(rows, {"nb": 19.0}, tmp_path) == []
    canvas = (tmp_path / "canvas.csv").read_text().splitlines()
    assert canvas[1] == "Points Possible,,,,,19" and canvas[2:] == ["ann,,,ann,,19", "mallory,,,mallory,,19"]
    grades = (tmp_path / "grades.csv").read_text()
    assert grades.count(",19,19,graded,") == 2 and "1019 outside [0, 19]: clamped" in grades
    assert "Total: 19 / 19" in (tmp_path / "feedback" / "mallory.html").read_text()
    assert "max_score" in (tmp_path / "summary.csv").read_text().splitlines()[0]
    assert (tmp_path / "summary.csv").read_text().splitlines()[1].endswith(",19.0,19.0")


class _Unprintable:
    def __str__(self):
        raise RuntimeError("no")


def test_one_unprintable_row_never_stops_the_other_files_or_pages(tmp_path, monkeypatch):
    weird = ["a JSON list", {"b": 1}], b"\xff\x00 bytes", "lone \udcff surrogates\x00", "x" * 10**6, _Unprintable()
    results = tuple(K.CheckResult(f"check {i}", 1, 0, False, True, m) for i, m in enumerate(weird))
    rows = [Grade("mallory", "nb", "error", 0, 5, "raised \udc80" * 1000, results),
            Grade("st\udcffdent", "nb", "graded", 0, 5, ""), Grade("ann", "nb", "graded", 5, 5, ""),
            Grade("zoe", "nb", "graded", 5, 5, "")]
    real = feedback.student_html
    monkeypatch.setattr(feedback, "student_html", lambda s, g: real(s, g) if s != "ann" else 1 / 0)
    problems = gradebook.write_all(rows, {"nb": 5.0}, tmp_path)
    assert problems == ["feedback for 'ann' could not be rendered (ZeroDivisionError); a short page says so"]
    pages = sorted(p.name for p in (tmp_path / "feedback").iterdir())
    assert len(pages) == 4 and "zoe.html" in pages and "mallory.html" in pages
    mallory = (tmp_path / "feedback" / "mallory.html").read_text(encoding="utf-8")
    assert "a JSON list" in mallory and "&lt;unprintable _Unprintable&gt;" in mallory and len(mallory) < 50_000
    assert "this page could not be rendered" in (tmp_path / "feedback" / "ann.html").read_text()
    grades = (tmp_path / "grades.csv").read_bytes().decode("utf-8")  # valid UTF-8: the surrogates were replaced
    assert grades.count("\n") == 5 and len(grades) < 20_000
