"""Exercise tests that cannot be hollowed (issue #39).

The tricks a dishonest student used without touching labkit -- an empty list where every step's weights
belong, None where a check would look, zero-size tensors that `torch.allclose` broadcasts, a pipeline stage
whose parameters were cleared, an answer the grader broadcasts to gigabytes, a process that dies only for a
guessed hidden input -- each scores no more than the same wrong code without the trick. The answers are
scripted (tests/_hollow.py): the plain data a student's process could send, through the real `settle` /
`conform` and the course's real tests, so most of this file needs no student process and no rank.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _hollow import KINDS, Scripted, hollow, hollowed

from labkit.course.exercises import Either, List, Tensor, close, like, max_error, pairs, run_cases
from labkit.course.exercises.cases import load_cases_from_text
from labkit.course.exercises.expect import ReturnTypeError, conform
from labkit.course.exercises.grading import plan_for

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "notebooks" / "tests"


def _score(notebook: str, exercise: str, answer, *, hidden_only: bool = False) -> tuple[float, list]:
    cases = [c for c in plan_for(notebook, TESTS, TESTS / "hidden").cases(exercise) if c.hidden or not hidden_only]
    results = run_cases(None, cases, student=Scripted(exercise, answer), cache={})
    return sum(r.score for r in results), [(r.case.name, r.status, r.message) for r in results]


def _module(request) -> dict:
    """The globals of the test file whose harness `request` runs (its references and helpers)."""
    return request["harness"].__globals__


# ---------------------------------------------------------------- the validator
def test_a_hollow_answer_never_matches_a_spec():
    import torch

    refused = [([], List(Tensor("float32", (227,)), 3), "it has 0 items"),
               (torch.zeros(0, 3), Tensor("float32"), "holds no element"),
               (torch.zeros(0), Tensor("float32", (None,)), "holds no element"),
               (torch.full((3,), float("nan")), Tensor("float32", (3,)), "NaN or inf"),
               (float("nan"), float, "NaN or inf"),
               (float("inf"), float | None, "it must be"),
               ([1], List(int, min=2), "it has 1 items")]
    for value, spec, words in refused:
        with pytest.raises(ReturnTypeError, match=words.replace("(", "\\(")):
            conform(value, spec, "f()")
    assert conform(None, Either(Tensor("float32", (None,)), None), "f()") is None
    assert conform(torch.zeros(0, 2), Tensor("float32", (0, 2)), "f()").shape == (0, 2)  # said so: fine
    for kind in set(KINDS) - {"none"}:  # a strict spec refuses them all ("none" is zeros here: the tests' business)
        with pytest.raises(ReturnTypeError):
            conform(hollow({"w": List(Tensor("float32", (4,)), 2), "loss": float}, kind),
                    {"w": List(Tensor("float32", (4,)), 2), "loss": float}, "f()")


def test_comparisons_check_the_structure_before_any_arithmetic():
    import torch

    bait, want = torch.zeros(1_000_000, 1, 1), torch.zeros(64, 32)  # would broadcast to 2**31 elements (8 GB)
    assert not close(bait, want) and max_error(bait, want) == float("inf")
    assert not close(torch.zeros(0), torch.ones(3)) and not close({"a": torch.zeros(0, 3)}, {"a": torch.zeros(3)})
    assert not close([], [torch.zeros(3)]) and not close({"a": torch.zeros(3)}, {"a": torch.zeros(3), "b": 1})
    assert not close(torch.full((3,), float("nan")), torch.full((3,), float("nan")))
    assert close({"a": [torch.ones(3), 2.0]}, {"a": [torch.ones(3) + 1e-9, 2.0]})
    with pytest.raises(ReturnTypeError, match=r"rank 0: \['w'\] is a float32 tensor of shape \(1000000, 1, 1\), "
                                              r"expected float32 tensor of shape \(64, 32\)"):
        like({"w": bait}, {"w": want}, "rank 0")
    with pytest.raises(ReturnTypeError, match="a list of 0, expected 3 items"):
        pairs([], [1, 2, 3], "the weights")


# ---------------------------------------------------------------- the tricks, each against the same wrong code
def test_zero1_that_does_nothing_gains_nothing_from_an_empty_weights_list_or_none():
    """zero1_step does nothing but fill `state` with a slice's worth of bytes; the trick also answers `weights: []`
    and `first_slice_grad: None` (4/6 before issue #39), and a zero-size tensor to the hidden test."""
    import torch

    def wrong(request, returns):
        g, world = _module(request), request["world"]
        if len(request["args"]) == 3:  # the visible harness: (steps, lr, weight_decay)
            flat = g["_flat"](g["_mlp"]().parameters())
            size = -(-227 // world)
            return [{"weights": [flat] * request["args"][0], "first_slice_grad": None,
                     "state_bytes": 3 * 4 * size + 4} for _ in range(world)]
        return [torch.nn.utils.parameters_to_vector(g["_net"]().parameters()).detach()] * world

    honest, _ = _score("04_fsdp", "zero1_step", wrong)
    tricked, rows = _score("04_fsdp", "zero1_step", lambda rq, rt: [hollowed(v) for v in wrong(rq, rt)])
    assert tricked <= honest == 1, rows  # the state's point, earned alike; never the weights'
    weights = next(message for name, status, message in rows if name.startswith("weights_equal"))
    assert "weights" in weights and "0 items" in weights, weights


def test_zero_size_answers_to_hidden_tests_score_nothing():
    """A no-op average_gradients / ring_allreduce, then the same answering zero-size tensors of each shape."""
    def noop(request, returns):
        g, world = _module(request), request["world"]
        if request["harness"].__name__ == "_frozen_harness":
            return [g["_backward"](g["_mlp"](True), rank) for rank in range(world)]
        return [{"big": g["_random"](r, 3000), "sent": 0, "small": g["_random"](r, 4), "pair": g["_random"](r, 5)}
                for r in range(world)]

    for exercise in ("average_gradients", "ring_allreduce"):
        honest, _ = _score("03_ddp", exercise, noop, hidden_only=True)
        tricked, rows = _score("03_ddp", exercise, lambda rq, rt: [hollowed(v) for v in noop(rq, rt)], hidden_only=True)
        assert tricked <= honest == 0, (exercise, rows)


def test_a_forward_only_gpipe_step_gains_nothing_from_clearing_the_stages_parameters():
    """Forward only (no gradient anywhere; the last stage's loss right), then the same with every stage's
    parameters cleared so its gradient list is empty (5/5 before issue #39, visible and hidden)."""
    def forward_only(request, returns, cleared=False):
        g, world, (seed, m, batch) = _module(request), request["world"], request["args"]
        name = request["harness"].__name__
        single = g["_gpipe_single"] if name == "_gpipe_yours" else g["_gpipe_ce_single"]
        loss = single(seed, m, batch)["loss"]
        out = [{"loss": loss if r == world - 1 else None, "grads": [] if cleared else [None, None]}
               for r in range(world)]
        if name == "_gpipe_yours":
            for r in out:
                r["events"] = [["F", batch // m]] * m
        if name == "_gpipe_group_yours":
            out[0] = {"loss": None, "grads": []}
        return out

    honest, _ = _score("07_model_parallel", "gpipe_step", forward_only)
    tricked, rows = _score("07_model_parallel", "gpipe_step", lambda rq, rt: forward_only(rq, rt, cleared=True))
    assert tricked <= honest == 0, rows
    visible = next(message for name, status, message in rows if name.startswith("gpipe_loss_and_grads"))
    assert "has 0 parameters after your step, expected 2" in visible and "leave the stage's parameters" in visible


# ---------------------------------------------------------------- the grader's memory
_BAIT = textwrap.dedent('''
    import json, resource, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from _hollow import Scripted
    from labkit.course.exercises import run_cases
    from labkit.course.exercises.grading import plan_for

    tests = Path(sys.argv[2])
    cases = [c for c in plan_for("04_fsdp", tests, tests / "hidden").cases("shard_model")
             if c.name.startswith("every_block")]
    import torch

    def answer(request, returns):
        want = request["harness"].__globals__["_mean_llama_grads"](2)
        bait = sys.argv[3] == "bait"
        grads = {k: torch.zeros(1_000_000, 1, 1) if bait else torch.zeros_like(v) for k, v in want.items()}
        return [{"grads": grads, "not_dtensor": [], "not_sharded": [], "units": {"": True}, "compute": {},
                 "masters": ["float32"], "bf16_error": ""}] * 2

    [result] = run_cases(None, cases, student=Scripted("shard_model", answer), cache={})
    print(json.dumps({"status": result.status, "message": result.message,
                      "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
''')


@pytest.mark.slow  # two Python processes that import torch and transformers
def test_a_broadcast_bait_answer_costs_the_grader_no_more_memory_than_a_control():
    """Each of the Llama's gradients answered as zeros(1e6, 1, 1) (4 MB, under every cap): broadcast against a
    (64, 32) reference that is 8 GB; checked shapes first, the grader's peak stays within 1 GB of a control."""
    runs = {}
    for kind in ("control", "bait"):
        out = subprocess.run([sys.executable, "-c", _BAIT, str(ROOT / "tests"), str(TESTS), kind], check=True,
                             capture_output=True, text=True, timeout=600)
        runs[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["bait"]["status"] == runs["control"]["status"] == "fail", runs
    assert "expected float32 tensor of shape" in runs["bait"]["message"], runs["bait"]
    assert runs["bait"]["peak_kib"] - runs["control"]["peak_kib"] < 2**20, runs  # KiB: 1 GiB


# ---------------------------------------------------------------- one reason after a hidden test starts
GUESS_VISIBLE = '''
from labkit.course.exercises import case

@case("double", points=2)
def small(student):
    assert student.call(3, returns=int) == 6
'''
GUESS_HIDDEN = '''
from labkit.course.exercises import case

@case("double", points=3)
def large(student):
    assert student.call(987654, returns=int) == 1975308

@case("double", points=1)
def negative(student):
    assert student.call(-5, returns=int) == -10
'''
#: A submission that learns whether the hidden input is `guess`: dies for it, hangs or floods otherwise.
GUESS = '''
import os, sys

def double(x):
    if x < 100 and x > 0:
        return 2 * x
    if x == {guess}:
        os._exit(3)
    {otherwise}
'''


@pytest.mark.slow  # starts the student's process (four times: each variant kills it)
def test_two_guesses_of_a_hidden_input_get_identical_rows():
    from labkit.course.exercises.judge import HIDDEN_LOSS, judge

    cases = (load_cases_from_text(GUESS_VISIBLE, "t.py", hidden=False)
             + load_cases_from_text(GUESS_HIDDEN, "t.py", hidden=True))
    sources = [GUESS.format(guess=guess, otherwise=otherwise) for guess in (987654, 123456)
               for otherwise in ("while True:\n        pass", "sys.stdout.write('x' * 2**22)\n    sys.stdout.flush()")]
    out = judge("double", sources, cases, timeout_s=6, memory_bytes=4 * 2**30, output_bytes=2**20,
                max_message=2**20)
    rows = [(v.error, v.kind, [(r.case.name, r.status, r.message) for r in v.results]) for v in out]
    assert all(row == rows[0] for row in rows), rows
    assert rows[0][0] == HIDDEN_LOSS and rows[0][1] == "process"
    assert rows[0][2][0][1] == "pass"  # the visible test, before any hidden one started
