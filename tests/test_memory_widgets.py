"""The memory calculator widget and the memory-stack figure, headless (no frontend)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from labkit.errors import ConfigError  # noqa: E402
from labkit.memory.estimate import MemoryConfig, estimate  # noqa: E402
from labkit.viz.plots import memory_stack  # noqa: E402
from labkit.viz.widgets import memory_calculator  # noqa: E402


def test_calculator_renders_headless_and_finds_the_fix():
    calc = memory_calculator("llama2-7b", gpu="RTX 4090 24GB", batch=1, seq=512)
    assert calc.controls is not None  # built, never waited on
    assert calc.message.startswith("does not fit") and "single change that fits" in calc.message
    assert "GiB (2^30 B)" in calc.text()
    full = calc.estimate.total
    msg = calc.update(lora_rank=8, quant="nf4-dq")
    assert msg.startswith("fits") and calc.estimate.total < full / 10


def test_controls_drive_the_estimate():
    calc = memory_calculator("tiny-llama", gpu="A100 80GB", precision="fp32")
    calc.controls.children[2].value = "mixed-bf16"  # the precision dropdown
    assert calc.config.precision == "mixed-bf16"
    calc.update(batch=0)  # 0 in the control = no batch
    assert calc.config.batch is None and calc.estimate.activations == 0


def test_invalid_change_keeps_the_last_valid_setup():
    calc = memory_calculator("llama2-7b", interactive=False)
    before = calc.config
    msg = calc.update(quant="nf4")  # quantization without LoRA
    assert msg.startswith("invalid setup") and "LoRA" in msg
    assert calc.config == before
    with pytest.raises(ConfigError, match="RTX 4090"):
        memory_calculator("llama2-7b", gpu="RTX 5090")


def test_memory_stack_draws_four_parts_per_bar():
    results = {"fp32": estimate(MemoryConfig(model="tiny-llama", precision="fp32", batch=2)),
               "bf16": estimate(MemoryConfig(model="tiny-llama", precision="bf16", batch=2))}
    fig = memory_stack(results)
    ax = fig.axes[0]
    assert len(ax.containers) == 4 and all(len(c) == 2 for c in ax.containers)
    tops = [sum(c[i].get_height() for c in ax.containers) for i in range(2)]
    assert tops == pytest.approx([r.total / 1e9 for r in results.values()])


@pytest.mark.slow
def test_planner_widget_prints_its_first_ranking_as_ordinary_output(run_cells):
    from conftest import stream_text

    nb = run_cells("from labkit.viz.widgets import planner_widget\nform = planner_widget()")
    cell = nb.cells[0]
    assert "layout(s) fit" in stream_text(cell)  # a papermill-run notebook keeps this
