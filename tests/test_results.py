"""labkit.results: RunRecord on disk (JSONL) and inside really executed notebooks."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import results
from labkit.errors import ConfigError
from labkit.facts import CommFacts, PipelineFacts, TrainFacts
from labkit.results import MIME, RunRecord

#: results.jsonl as the labkit before typed facts wrote it (schema 1: flat `extra` keys).
SCHEMA1 = Path(__file__).parent / "data" / "results" / "schema1.jsonl"


def record(strategy: str = "ddp", world_size: int = 2, **changes) -> RunRecord:
    fields = dict(strategy=strategy, model="tiny-resnet", profile="smoke", world_size=world_size, steps=3,
                  losses=[2.0, 1.5, 1.2], step_time_s=0.2, samples_per_s=80.0,
                  peak_bytes=[3 * 2**20] * world_size, param_bytes=[2**20] * world_size,
                  grad_bytes=[2**20] * world_size, optimizer_bytes=[2 * 2**20] * world_size,
                  trainable_params=1000, device="cpu", dtype="float32", notes={"note": "x"},
                  train=TrainFacts(run_id="t", dp_size=world_size), comm=CommFacts(all_reduce=10))
    fields.update(changes)
    return RunRecord(**fields)


def test_round_trip_through_jsonl(tmp_path):
    first, second = record("ddp"), record("fsdp", cpu_offload_bytes=[5, 6])
    path = results.append(first, tmp_path)
    results.append(second, tmp_path)
    assert path == tmp_path / "results.jsonl"
    assert results.load(tmp_path) == [first, second]
    assert results.load(path) == [first, second]
    assert results.latest(tmp_path, strategy="ddp") == first
    assert first.versions["torch"] and first.timestamp  # filled in when not given


def test_facts_are_attributes_and_a_typo_fails_at_once(tmp_path):
    rec = record(pipeline={"pp": 2, "microbatches": 4, "bubble_theory": 0.2})  # JSON data becomes the facts
    assert isinstance(rec.pipeline, PipelineFacts) and rec.pipeline.bubble_theory == 0.2
    assert rec.comm.total == 10 and rec.peft is None
    with pytest.raises(AttributeError):
        rec.comm.allreduce_bytes_per_rank  # noqa: B018 - the old string key is no attribute
    with pytest.raises(AttributeError):
        rec.peft.trainable_fraction  # noqa: B018 - not recorded by this strategy: fails, never a silent None
    with pytest.raises(ConfigError, match=r"unknown PipelineFacts fields \['bubble'\]"):
        record(pipeline={"bubble": 0.2})
    with pytest.raises(ConfigError, match=r"RunRecord.comm is a int; give a labkit.facts.CommFacts"):
        record(comm=5)
    results.append(rec, tmp_path)
    assert results.load(tmp_path) == [rec] and json.loads((tmp_path / "results.jsonl").read_text())["schema"] == 2


def test_schema1_results_written_before_typed_facts_still_load():
    ddp, fsdp, pipe, lora = results.load(SCHEMA1)
    assert ddp.schema == results.SCHEMA_VERSION and ddp.train.run_id == "r1" and ddp.train.epoch_time_s == 0.4
    assert ddp.comm == CommFacts(all_reduce=441600, bucket_cap_mb=25)
    assert ddp.optim.name == "adamw" and ddp.optim.state_bits == {"32": 110400}
    assert fsdp.comm.all_gather == 441600 and fsdp.comm.total == 441600 + 220800
    assert fsdp.sharding.mesh_shape == [2] and fsdp.memory.param_bytes_after_forward == 300000
    assert pipe.pipeline.max_in_flight == [2, 1] and pipe.pipeline.schedule_trace[0]["kind"] == "F"
    assert lora.peft.trainable_fraction == 0.032 and lora.notes == {"note_from_a_fork": "kept"}
    assert RunRecord.from_dict(lora.to_dict()) == lora  # upgraded once, then schema 2 round trips


def test_a_record_from_a_newer_labkit_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({**record().to_dict(), "schema": 99}) + "\n")
    with pytest.raises(ConfigError) as info:
        results.load(tmp_path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}:1: RunRecord schema 99 is newer")
    assert "pip install -U labkit" in message


def test_the_core_does_not_import_the_course_layer():
    code = "import sys, labkit.results; print(sorted(m for m in sys.modules if m.startswith('labkit.course.grading')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_publishers_see_every_payload_before_it_is_displayed(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda data, raw: shown.append(data))
    monkeypatch.setattr(results, "_PUBLISHERS", dict(results._PUBLISHERS))
    results.register_publisher("tag", lambda payload, text: {**payload, "tag": text})
    results.answer("q1", 3)
    assert shown[0][MIME]["tag"] == "answer q1 = 3" and shown[0][MIME]["value"] == 3
    assert "fingerprint" in shown[0][MIME]  # the course seal labkit/__init__.py registers ran too


def test_per_rank_length_must_match_world_size():
    with pytest.raises(ConfigError, match=r"peak_bytes has 1 entries for world_size=2"):
        record(peak_bytes=[1])


def test_unknown_fields_and_bad_lines_are_reported(tmp_path):
    with pytest.raises(ConfigError, match="unknown RunRecord fields"):
        RunRecord.from_dict({**record().to_dict(), "bogus": 1})
    (tmp_path / "results.jsonl").write_text(json.dumps(record().to_dict()) + "\nnot json\n")
    with pytest.raises(ConfigError, match=r"results.jsonl:2 is not a RunRecord"):
        results.load(tmp_path)


def test_missing_results_and_no_match_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="labkit train"):
        results.load(tmp_path / "nowhere")
    results.append(record(), tmp_path)
    with pytest.raises(ConfigError, match="'zero3'"):
        results.latest(tmp_path, strategy="zero3")


def test_answer_rejects_non_json_values():
    with pytest.raises(TypeError):
        results.answer("q1", object())


@pytest.mark.slow
def test_show_and_answer_land_in_an_executed_notebook(run_cells):
    rec = record()
    nb = run_cells(
        "from labkit import results\n"
        f"rec = results.RunRecord.from_dict({rec.to_dict()!r})\n"
        "results.show(rec, key='ddp-baseline')",
        "results.answer('q_speedup', {'speedup': 1.8, 'why': 'two ranks'})",
    )
    assert MIME in nb.cells[0].outputs[0]["data"]  # the data really is in the cell output
    payloads = results.from_notebook(nb)
    assert [(p["cell"], p["kind"], p["key"]) for p in payloads] == [(0, "run", "ddp-baseline"),
                                                                    (1, "answer", "q_speedup")]
    assert RunRecord.from_dict(payloads[0]["record"]) == rec
    from labkit.course.grading.fingerprint import seal_problem
    for payload, cell in zip(payloads, nb.cells):  # sealed by the course hook, with no extra line in the notebook
        out = cell.outputs[0]["data"]
        assert payload["fingerprint"]["cell_sha256"] and seal_problem(out[MIME], out["text/plain"]) is None
    assert payloads[1]["value"] == {"speedup": 1.8, "why": "two ranks"}


def test_compare_returns_rows_and_a_figure():
    import matplotlib.pyplot as plt

    recs = [record("single", world_size=1), record("ddp"), record("fsdp", losses=[2.0, 1.0])]
    rows, fig = results.compare(recs, title="t")
    try:
        assert [r["strategy"] for r in rows] == ["single", "ddp", "fsdp"]
        assert set(rows[0]) == set(results.COLUMNS)
        assert rows[2]["final_loss"] == 1.0 and rows[1]["optim_MiB"] == 2.0
        ax_loss, ax_mem = fig.axes[:2]
        assert len(ax_loss.get_lines()) == 3
        assert len(ax_mem.patches) == 3 * 3  # params, grads, optimizer bars per record
        assert "single" in results.format_table(rows)
    finally:
        plt.close(fig)
