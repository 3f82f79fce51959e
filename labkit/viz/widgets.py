"""Notebook widgets.

`memory_calculator()` (notebook 01_memory): controls for every `MemoryConfig` field, a stacked bar of
one GPU's memory against GPU capacities, a table, and a verdict naming the single change that makes
the setup fit. Headless-safe: the figure and table are ordinary display outputs rendered at once
(papermill keeps them), and the controls only *update* those outputs in place, so nothing ever waits
for a frontend.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from labkit.zoo import presets
from labkit.errors import ConfigError
from labkit.memory.advice import verdict
from labkit.memory.config import CHECKPOINTING, OFFLOADS, OPTIMIZERS, PRECISIONS, QUANTS, MemoryConfig
from labkit.memory.estimate import estimate
from labkit.memory.report import GPU_CAPACITIES, format_table

_CHOICES = {"precision": PRECISIONS, "optimizer": OPTIMIZERS, "zero": (0, 1, 2, 3), "offload": OFFLOADS,
            "quant": QUANTS, "checkpointing": CHECKPOINTING}
_INTS = ("dp", "tp", "pp", "lora_rank", "batch", "seq", "grad_accum")


class MemoryCalculator:
    """State behind the widget: the current config, its estimate, and the rendered outputs."""

    def __init__(self, cfg: MemoryConfig, gpu: str):
        self.config, self.gpu = cfg, gpu
        self.estimate = estimate(cfg)
        self.message = verdict(cfg, GPU_CAPACITIES[gpu], gpu)
        self.controls = None
        self._handles: list = []

    def update(self, **changes: Any) -> str:
        """Apply field changes (and/or gpu=...) and re-render; returns the verdict or the error."""
        self.gpu = changes.pop("gpu", self.gpu)
        if changes.get("batch") == 0:
            changes["batch"] = None  # 0 in the control = no batch: model states only
        try:
            cfg = dataclasses.replace(self.config, **changes)
            self.estimate = estimate(cfg)
        except ConfigError as exc:
            self.message = f"invalid setup: {exc}"
        else:
            self.config = cfg
            self.message = verdict(cfg, GPU_CAPACITIES[self.gpu], self.gpu)
        self._render()
        return self.message

    def figure(self):
        from labkit.viz.plots import memory_stack

        label = self.config.model or f"{self.config.params:,} params"
        return memory_stack({label: self.estimate}, title=self.message[:90])

    def text(self) -> str:
        return self.message + "\n\n" + format_table(self.estimate)

    def _render(self) -> None:
        import matplotlib.pyplot as plt
        from IPython.display import display

        fig = self.figure()
        outputs = (_png(fig), _Pre(self.text()))
        if not self._handles:
            self._handles = [display(o, display_id=True) for o in outputs]
        else:
            for handle, o in zip(self._handles, outputs):
                if handle is not None:
                    handle.update(o)
        plt.close(fig)  # displayed once; keep the inline backend from drawing it again

    def _ipython_display_(self) -> None:  # the calculator renders itself; nothing more to show
        return None


def _png(fig):
    """The figure as a PNG display object: an image output under any matplotlib backend (Agg too)."""
    import io

    from IPython.display import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return Image(data=buf.getvalue(), format="png")


class _Pre:
    def __init__(self, text: str):
        self.text = text

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(self.text)}</pre>"

    def __repr__(self) -> str:
        return self.text


def _controls(calc: MemoryCalculator):
    import ipywidgets as w

    cfg = calc.config
    fields: dict[str, Any] = {
        "model": w.Dropdown(options=list(dict.fromkeys([*presets.ALL_MODELS, cfg.model])), value=cfg.model,
                            description="model"),
        "gpu": w.Dropdown(options=list(GPU_CAPACITIES), value=calc.gpu, description="GPU"),
    }
    for name, options in _CHOICES.items():
        fields[name] = w.Dropdown(options=list(options), value=getattr(cfg, name), description=name)
    for name in _INTS:
        value = getattr(cfg, name)
        fields[name] = w.BoundedIntText(value=value or 0, min=0 if name in ("batch", "seq", "lora_rank") else 1,
                                        max=1_000_000, description=name)
    fields["lora_targets"] = w.Text(value=",".join(cfg.lora_targets), description="LoRA on")
    for name in ("flash_attention", "sequence_parallel"):
        fields[name] = w.Checkbox(value=getattr(cfg, name), description=name)

    def on_change(change, name):
        value = change["new"]
        if name == "seq" and value == 0:
            value = None
        calc.update(**{name: value})

    for name, widget in fields.items():
        widget.observe(lambda change, name=name: on_change(change, name), names="value")
    boxes = list(fields.values())
    return w.GridBox(boxes, layout=w.Layout(grid_template_columns="repeat(3, 320px)"))


def memory_calculator(model: str = "llama2-7b", *, gpu: str = "RTX 4090 24GB", interactive: bool = True,
                      **fields: Any) -> MemoryCalculator:
    """Render the calculator for `model` (any `MemoryConfig` field may be given) on `gpu`.

    The figure and table are displayed immediately; with `interactive` the controls are displayed
    too and update them in place. Returns the `MemoryCalculator` (its `.update(**changes)` does what
    the controls do, for scripted exercises)."""
    if gpu not in GPU_CAPACITIES:
        raise ConfigError(f"unknown GPU {gpu!r}; valid GPUs are: {', '.join(GPU_CAPACITIES)}")
    calc = MemoryCalculator(MemoryConfig(model=model, **fields), gpu)
    calc._render()
    if interactive:
        from IPython.display import display

        calc.controls = _controls(calc)
        display(calc.controls)
    return calc


def planner_widget(model: str = "gpt3-175b", gpus: int = 64, gpus_per_node: int = 8, gpu: str = "a100-80gb"):
    """The planner's live form (`_planner_form`), after printing its first ranking as ordinary output, so a
    saved or papermill-run notebook shows it (an ipywidgets Output keeps its text in widget state only).
    Introduced in notebook 07_model_parallel."""
    from labkit.parallel import planner

    try:
        request = planner.PlanRequest(model=model, gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu)
        print(planner.format_plan(planner.plan(request), top=8))  # the form shows 8
    except ConfigError as exc:
        print(f"error: {exc}")
    return _planner_form(model, gpus, gpus_per_node, gpu)


def _planner_form(model: str = "gpt3-175b", gpus: int = 64, gpus_per_node: int = 8, gpu: str = "a100-80gb"):
    """An ipywidgets form around `labkit.parallel.planner.plan`: change the model, GPU count or batch and the ranking updates."""
    import ipywidgets as w

    from labkit.parallel.planner import GPUS, PlanRequest, format_plan, plan

    models = [m for m in (*presets.LLM_PRESETS, *presets.GPT_PRESETS)]
    controls = dict(
        model=w.Dropdown(options=models, value=model, description="model"),
        gpus=w.BoundedIntText(value=gpus, min=1, max=16384, description="GPUs"),
        gpus_per_node=w.BoundedIntText(value=gpus_per_node, min=1, max=64, description="per node"),
        gpu=w.Dropdown(options=list(GPUS), value=gpu, description="GPU"),
        batch=w.BoundedIntText(value=0, min=0, max=1 << 20, description="batch (0=auto)"),
        top=w.BoundedIntText(value=8, min=1, max=100, description="show"),
    )
    out = w.Output()

    def show(model, gpus, gpus_per_node, gpu, batch, top):
        try:
            req = PlanRequest(model=model, gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, batch=batch or None)
            result = plan(req)
            text = format_plan(result, top=top)
        except ConfigError as exc:
            text = f"error: {exc}"
        out.clear_output()
        with out:
            print(text)

    w.interactive_output(show, controls)
    return w.VBox([w.HBox(list(controls.values())[:3]), w.HBox(list(controls.values())[3:]), out])
