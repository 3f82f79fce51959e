"""Visible tests of notebook 05's exercises (pick_zero, make_ds_config).

`pick_zero` answers plain data, compared with the rung of LADDER labkit's estimator gives (the scenarios'
answers and the mistakes that give other rungs are listed below). `make_ds_config` returns a dict: DeepSpeed's
own parser reads it here, and two fresh ranks that never load the student's code train with it.
"""
from labkit.course.exercises import ANY, case, reference, trusted_spawn
from labkit.course.exercises.expect import conform

# ---------------------------------------------------------------- pick_zero
#: (budget GiB, model, dp, precision) -> (the answer, {a wrong answer: the mistake that gives it}).
#: Model states per GPU from labkit's estimator (mixed-bf16 AdamW: 2 + 2 + 12 B per parameter before sharding).
SCENARIOS = {
    (80, "llama2-7b", 4, "mixed-bf16"): ((1, "none"), {
        (2, "optimizer"): "pass dp=dp to MemoryConfig: ZeRO divides the states over the dp GPUs",
        (3, "optimizer+params"): "return the FIRST rung of LADDER that fits (the cheapest), not the last"}),
    (24, "llama2-7b", 8, "mixed-bf16"): ((2, "none"), {
        (3, "none"): "ZeRO-2 keeps 23.5 GiB = 25.3e9 bytes, which fits 24 GiB: a GiB is 2**30 bytes, not 1e9"}),
    (60, "llama2-7b", 4, "fp32"): ((2, "none"), {
        (1, "none"): "pass precision=precision to MemoryConfig: fp32 AdamW keeps 4 + 4 + 8 B per parameter"}),
    (24, "llama2-7b", 2, "mixed-bf16"): ((2, "optimizer"), {
        None: "pass offload=offload to MemoryConfig: offloading the optimizer leaves 2 + 2/2 B per parameter on "
              "the GPU"}),
    (14, "llama2-7b", 3, "mixed-bf16"): ((3, "optimizer"), {}),
    (0.1, "llama2-7b", 1, "mixed-bf16"): (None, {
        (3, "optimizer+params"): "when no rung fits, return None"}),
}


def _model_states_gib(model, dp, precision, rung):
    from labkit.memory.estimate import MemoryConfig, estimate

    stage, offload = rung
    cfg = MemoryConfig(model=model, precision=precision, zero=stage, offload=offload, dp=dp)
    return estimate(cfg).model_states / 2**30


def _rung(student, budget, model, dp, precision):
    got = student.call(budget, model, dp, precision, returns=ANY)
    if got is not None:  # a (stage, offload) pair, as a tuple or a list
        got = conform(got, (int, str), f"pick_zero({budget}, {model!r}, {dp}, {precision!r})")
    return got


@case("pick_zero", points=2)
def first_rung_that_fits_in_each_scenario(student):
    for (budget, model, dp, precision), (want, mistakes) in SCENARIOS.items():
        got = _rung(student, budget, model, dp, precision)
        if got == want:
            continue
        call = f"pick_zero({budget}, {model!r}, dp={dp}, precision={precision!r}) = {got!r}, expected {want!r}"
        if got in mistakes:
            raise AssertionError(f"{call}: {mistakes[got]}")
        held = "" if want is None else (
            f" ({want} keeps {reference(_model_states_gib, model, dp, precision, want):.2f} GiB of model states "
            "per GPU)")
        raise AssertionError(f"{call}{held}: the first (stage, offload) of LADDER whose "
                             "estimate(MemoryConfig(...)).model_states fit budget_gib * 2**30 bytes")


# ---------------------------------------------------------------- make_ds_config
#: What each config must hold, checked on the returned dict in this order, with the fix of each mistake.
def _batch_sizes(config, micro_batch, accum, dp):
    got = tuple(config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                        "gradient_accumulation_steps"))
    want = (micro_batch * accum * dp, micro_batch, accum)
    if got[1:] == want[1:] and got[0] == micro_batch * dp and accum > 1:
        raise AssertionError(f"train_batch_size {got[0]}, expected {want[0]}: train_batch_size = micro_batch x "
                             f"accum x dp = {micro_batch} x {accum} x {dp}, the samples of one optimizer step")
    assert got == want, (f"(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps) = "
                         f"{got}, expected {want}: train_batch_size = micro_batch x accum x dp")


def _offloads(config, offload):
    zero = config.get("zero_optimization")
    assert type(zero) is dict, f"\"zero_optimization\" is {zero!r}: a dict with the stage and the offloads"
    want = {"none": (), "optimizer": ("offload_optimizer",),
            "optimizer+params": ("offload_optimizer", "offload_param")}[offload]
    for key in ("offload_optimizer", "offload_param"):
        if key not in want:
            assert key not in zero, f"offload={offload!r}: no {key!r} in zero_optimization (got {zero[key]!r})"
            continue
        what = {"offload_optimizer": "the optimizer's states and step", "offload_param": "the parameters"}[key]
        assert key in zero, (f"offload={offload!r}: zero_optimization has no {key!r}: offload {what} to the CPU "
                             f"with \"{key}\": {{\"device\": \"cpu\", \"pin_memory\": False}}")
        part = zero[key]
        assert type(part) is dict and part.get("device") == "cpu", f"{key} = {part!r}: its \"device\" is \"cpu\""
        assert part.get("pin_memory") is False, (f"{key} = {part!r}: set \"pin_memory\": False; pinning host memory "
                                                 "needs a GPU driver")


def _parsed(config: dict):
    """DeepSpeed's own parser of a config for ONE rank (in this process world_size is 1)."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(config)


def _check_config(config, stage, offload, *, dp, micro_batch, accum=1, lr=1e-4, bf16=False):
    _batch_sizes(config, micro_batch, accum, dp)
    _offloads(config, offload)
    got_stage = config["zero_optimization"].get("stage")
    assert got_stage == stage, f"zero_optimization.stage = {got_stage!r}, expected {stage}"
    opt = config.get("optimizer")
    assert type(opt) is dict and opt.get("type") == "AdamW" and type(opt.get("params")) is dict, (
        f"\"optimizer\" = {opt!r}: {{\"type\": \"AdamW\", \"params\": {{\"lr\": lr}}}}")
    assert opt["params"].get("lr") == lr, f"optimizer params {opt['params']!r}: pass the lr ({lr:g})"
    on = config["bf16"].get("enabled") if type(config.get("bf16")) is dict else None  # no key: DeepSpeed's off
    assert bool(on) is bf16, (f"bf16={bf16}: the config has \"bf16\" = {config.get('bf16')!r}; set "
                              f"\"bf16\": {{\"enabled\": bf16}}")
    if dp == 1:  # DeepSpeed checks the batch sizes against this process's world size, 1
        parsed = _parsed(config)
        assert parsed.zero_optimization_stage == stage and parsed.bfloat16_config.enabled is bf16, (
            f"DeepSpeed read stage {parsed.zero_optimization_stage} and bf16 {parsed.bfloat16_config.enabled}")


def _config(student, stage, offload, **kw):
    return student.call(stage, offload, returns={str: ANY}, **kw)


@case("make_ds_config", points=2)
def zero2_offload_with_accumulation(student):
    kw = dict(dp=1, micro_batch=4, accum=2, lr=3e-4)
    _check_config(_config(student, 2, "optimizer", **kw), 2, "optimizer", **kw)
    kw = dict(dp=3, micro_batch=2, accum=5)
    _check_config(_config(student, 2, "optimizer", **kw), 2, "optimizer", **kw)


@case("make_ds_config", points=2)
def zero3_offloads_params_too_and_bf16(student):
    kw = dict(dp=1, micro_batch=2, bf16=True)
    _check_config(_config(student, 3, "optimizer+params", **kw), 3, "optimizer+params", **kw)
    kw = dict(dp=1, micro_batch=2)
    _check_config(_config(student, 1, "none", **kw), 1, "none", **kw)


def _documented(config: dict) -> dict:
    """The keys the exercise's docstring defines, and only those: the grader's ranks run DeepSpeed outside any
    sandbox, so a key that makes it write files (tensorboard, csv_monitor, checkpoints) never reaches them."""
    zero = config["zero_optimization"]
    return {**{k: config[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                      "gradient_accumulation_steps", "bf16") if k in config},
            "optimizer": {"type": config["optimizer"]["type"], "params": {"lr": config["optimizer"]["params"]["lr"]}},
            "zero_optimization": {"stage": zero["stage"], **{k: {"device": "cpu", "pin_memory": False}
                                                            for k in ("offload_optimizer", "offload_param") if k in zero}}}


def _train_rank(rank, world, config):
    """REFERENCE ranks (never load student code): deepspeed.initialize on a small MLP with the student's
    config (plain data), two steps; the optimizer DeepSpeed built and the losses. DeepSpeed's log lines and
    warnings go to /dev/null: they are not the student's business (an error still comes back, by file)."""
    import os
    from pathlib import Path

    import labkit
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed is imported
    os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                          str(Path(labkit.__file__).resolve().parents[1] / "build" / "torch_extensions"))
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
        losses.append(float(loss.detach()))
    inner = getattr(optimizer, "optimizer", optimizer)
    return {"optimizer": type(inner).__name__, "stage": engine.zero_optimization_stage(), "losses": losses}


@case("make_ds_config", points=2)
def deepspeed_trains_with_it_on_two_ranks(student):
    kw = dict(dp=2, micro_batch=2)
    config = _config(student, 2, "optimizer", **kw)
    _check_config(config, 2, "optimizer", **kw)
    out = trusted_spawn(_train_rank, world=2, args=(_documented(config),), timeout=300)[0]
    assert out["stage"] == 2, f"the engine runs ZeRO stage {out['stage']}"
    assert out["optimizer"] == "DeepSpeedCPUAdam", (
        f"the engine steps with {out['optimizer']}; offloading the optimizer makes DeepSpeed use its CPU Adam")
    assert out["losses"][1] < out["losses"][0], f"the loss did not fall: {out['losses']}"
