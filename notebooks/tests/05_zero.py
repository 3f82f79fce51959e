"""Visible tests of notebook 05's exercises (pick_zero, make_ds_config)."""
from labkit.course.exercises import case, spawn

#: LEGACY: these exercises' tests still run in the student's process; port them to `student.call /
#: run / spawn` (docs/grading.md, "Porting a legacy exercise") and remove their names here.
LEGACY = {"pick_zero", "make_ds_config"}


@case("pick_zero", points=2)
def llama7b_scenarios(pick_zero):
    # (budget GiB, model, dp) -> the answer, worked out with labkit's estimator (mixed-bf16 AdamW, 16 B/param)
    scenarios = {(80, "llama2-7b", 4): (1, "none"),       # 2 + 2 + 12/4 = 7 B/param: 44 GiB
                 (24, "llama2-7b", 2): (2, "optimizer"),  # ZeRO-3 alone needs 50 GiB; offload keeps 2 + 2/2 B
                 (1, "llama2-7b", 1): (3, "optimizer+params")}
    for (budget, model, dp), want in scenarios.items():
        got = pick_zero(budget, model, dp)
        assert got is not None and tuple(got) == want, (
            f"pick_zero({budget}, {model!r}, dp={dp}) = {got!r}; the first rung of LADDER that fits is {want}")
    assert pick_zero(0.1, "llama2-7b", 1) is None, "a 7B model in 0.1 GiB: nothing fits, return None"


def _parsed(config: dict):
    """DeepSpeed's own parser of a config for ONE rank (in this process world_size is 1)."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(config)


@case("make_ds_config", points=2)
def deepspeed_parses_zero2_offload(make_ds_config):
    config = make_ds_config(2, "optimizer", dp=1, micro_batch=4, accum=2, lr=3e-4)
    parsed = _parsed(config)
    assert parsed.zero_optimization_stage == 2, f"ZeRO stage {parsed.zero_optimization_stage}, want 2"
    off = parsed.zero_config.offload_optimizer
    assert off is not None and str(off.device).endswith("cpu"), f"offload_optimizer: {off!r}; want device 'cpu'"
    assert not off.pin_memory, "pin_memory must be False: pinning host memory needs a GPU driver"
    assert parsed.zero_config.offload_param is None, "stage 2 offloads the optimizer only, not the parameters"
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) \
        == (8, 4, 2), "batch sizes: 4 per rank per micro-batch, 2 accumulation steps, 1 rank -> 8 per step"
    assert parsed.optimizer_name == "adamw" and parsed.optimizer_params.get("lr") == 3e-4, (
        f"optimizer {parsed.optimizer_name!r} with {parsed.optimizer_params}; want AdamW with lr 3e-4")
    assert not parsed.bfloat16_config.enabled, "bf16=False must leave bf16 off"
    two = make_ds_config(2, "optimizer", dp=2, micro_batch=4, accum=2)
    assert two["train_batch_size"] == 16, f"2 ranks x 4 x 2 accumulation = 16 per step, got {two['train_batch_size']}"


def _train_rank(rank, world, config):
    """deepspeed.initialize on a small MLP with `config`, two steps; the optimizer DeepSpeed built."""
    import os
    from pathlib import Path

    import labkit
    os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed is imported
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(labkit.__file__).resolve().parents[1] / "build" / "torch_extensions"))
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(config["train_micro_batch_size_per_gpu"], 8)
    losses = []
    for _ in range(2):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    inner = getattr(optimizer, "optimizer", optimizer)
    return {"optimizer": type(inner).__name__, "stage": engine.zero_optimization_stage(), "losses": losses}


@case("make_ds_config", points=2)
def deepspeed_trains_on_two_ranks(make_ds_config):
    config = make_ds_config(2, "optimizer", dp=2, micro_batch=2)
    out = spawn(_train_rank, world=2, args=(config,), timeout=240)[0]
    assert out["stage"] == 2, f"the engine runs ZeRO stage {out['stage']}"
    assert out["optimizer"] == "DeepSpeedCPUAdam", (
        f"the engine steps with {out['optimizer']}; offloading the optimizer makes DeepSpeed use its CPU Adam")
    assert out["losses"][1] < out["losses"][0], f"the loss did not fall: {out['losses']}"
