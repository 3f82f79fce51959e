"""labkit.results: RunRecord on disk (JSONL) and inside really executed notebooks."""
from __future__ import annotations

import json

import pytest

from labkit import results
from labkit.errors import ConfigError
from labkit.results import MIME, RunRecord


def record(strategy: str = "ddp", world_size: int = 2, **changes) -> RunRecord:
    fields = dict(strategy=strategy, model="tiny-resnet", profile="smoke", world_size=world_size, steps=3,
                  losses=[2.0, 1.5, 1.2], step_time_s=0.2, samples_per_s=80.0,
                  peak_bytes=[3 * 2**20] * world_size, param_bytes=[2**20] * world_size,
                  grad_bytes=[2**20] * world_size, optimizer_bytes=[2 * 2**20] * world_size,
                  trainable_params=1000, device="cpu", dtype="float32", extra={"note": "x"})
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
