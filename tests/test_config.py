"""TrainConfig sections: flat names in, nested sections out, old flat JSON still loads, clear errors."""
from __future__ import annotations

import dataclasses
import json

import pytest

from labkit.errors import ConfigError
from labkit.train.config import FIELD_SECTION, SECTIONS, TrainConfig, from_dict

# What labkit before the sections wrote (TrainConfig.to_json of a resolved lora run, 40 flat fields):
# worker/run_many command lines and anything saved from them hold this shape.
OLD_FLAT_JSON = (
    '{"accum": 1, "amp": "bf16", "batch": 8, "channels_last": false, "checkpoint_every": 0, "checkpointing": false, '
    '"compile": false, "data": "synthetic", "deadline": null, "deadline_margin_s": 30.0, "eval_at_start": false, '
    '"eval_batches": 2, "find_max_batch": false, "image_size": 32, "lora_alpha": 16.0, "lora_dropout": 0.0, '
    '"lora_parallel": "ddp", "lora_rank": 4, "lora_targets": "q,v", "lr": 0.003, "memory_budget_mb": null, '
    '"memory_cap_gb": null, "microbatches": null, "model": "tiny-llama", "nnodes": 1, "node_rank": 0, "nproc": 2, '
    '"optimizer": null, "out": "runs", "profile": "smoke", "progress": true, "rdzv_endpoint": null, "resume": false, '
    '"run_id": "abc123", "seed": 0, "seq_len": 32, "steps": 20, "strategy": "lora", "trace_steps": 0, '
    '"trace_with": "torch", "warmup_steps": 2, "workers": 0}')


def lora() -> TrainConfig:
    return TrainConfig.of(strategy="lora", model="tiny-llama", nproc=2, amp="bf16", lora_rank=4,
                          deadline_margin_s=30.0, run_id="abc123").resolve()


def test_flat_names_land_in_their_sections_through_one_generated_table():
    cfg = lora()
    assert (cfg.run.strategy, cfg.launch.nproc, cfg.precision.amp, cfg.peft.lora_rank) == ("lora", 2, "bf16", 4)
    assert (cfg.optim.batch, cfg.run.seq_len, cfg.checkpoint.deadline_margin_s) == (8, 32, 30.0)  # profile, arg
    fields = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert sorted(fields) == sorted(FIELD_SECTION) and len(fields) == len(set(fields))  # flat names are unique
    assert list(SECTIONS) + ["resolved_profile"] == [f.name for f in dataclasses.fields(TrainConfig)]
    assert from_dict(cfg.flat()).resolve() == cfg  # flat names carry no Profile: resolve() looks it up


def test_old_flat_json_loads_and_new_json_round_trips():
    old = TrainConfig.from_json(OLD_FLAT_JSON)
    assert old.resolved_profile is None and old.resolve() == lora()  # resolved against its named profile
    new = json.loads(lora().to_json())
    assert set(new) == {*SECTIONS, "resolved_profile"} and new["precision"]["amp"] == "bf16"
    assert new["resolved_profile"]["name"] == "smoke"
    assert TrainConfig.from_json(lora().to_json()) == lora()
    assert TrainConfig.from_json(old.to_json()) == old


def test_unknown_names_are_errors_listing_the_valid_ones():
    with pytest.raises(ConfigError, match="unknown train option 'stepz'.*steps"):
        from_dict({"strategy": "single", "model": "tiny-llama", "stepz": 3})
    with pytest.raises(ConfigError, match="unknown precision option 'lora_rank'; valid precision options are: amp"):
        from_dict({"strategy": "single", "model": "tiny-llama", "precision": {"lora_rank": 3}})
    with pytest.raises(ConfigError, match="unknown train option 'ampp'"):
        lora().replace(ampp="bf16")
    with pytest.raises(ConfigError, match="training needs model"):
        from_dict({"strategy": "single"})


def test_validation_names_the_bad_value_and_the_fix():
    cases = [({"nproc": 0}, "nproc=0; it must be a positive integer"),
             ({"amp": "fp8"}, "unknown amp mode 'fp8'; valid amp modes are: bf16, fp16, none"),
             ({"lora_rank": 0}, "lora_rank=0; it must be a positive integer such as 8"),
             ({"nnodes": 2}, "nnodes=2 needs --rdzv-endpoint HOST:PORT"),
             ({"channels_last": True}, "--channels-last applies to image models, not 'tiny-llama'"),
             ({"trace_steps": -1}, "trace_steps=-1; it must be an integer >= 0"),
             ({"threads": 0}, "threads=0; it must be a positive integer")]
    for change, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            TrainConfig.of(strategy="single", model="tiny-llama", **change)
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            lora().replace(**change)  # replace validates too


def test_replace_keeps_the_rest_and_flat_names_point_to_their_section():
    cfg = lora()
    changed = cfg.replace(amp="none", steps=3)
    assert (changed.precision.amp, changed.run.steps, changed.peft.lora_rank) == ("none", 3, 4)
    assert cfg.precision.amp == "bf16"  # frozen: the original is unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.precision.amp = "fp16"
    with pytest.raises(AttributeError, match=r"it is cfg\.precision\.amp"):
        cfg.amp  # noqa: B018


def _counting_profiles(monkeypatch) -> list[str]:
    """Every lookup of a profile by name from now on, in order (labkit.profiles.get_profile's table)."""
    from labkit import profiles

    looked_up: list[str] = []

    def counted(name, make):
        def lookup():
            looked_up.append(name)
            return make()
        return lookup

    monkeypatch.setattr(profiles, "PROFILES", {n: counted(n, f) for n, f in profiles.PROFILES.items()})
    return looked_up


def test_a_resolved_config_carries_its_profile_and_the_ranks_get_that_object(monkeypatch):
    """resolve() keeps the Profile (cfg.profile); to_json carries it, so the ranks rebuild the very profile the
    caller resolved against (a changed one too: course.profile_check sizes such profiles), never a lookup."""
    from labkit.profiles import get_profile
    from labkit.train import api, worker

    changed = dataclasses.replace(get_profile("smoke"), timeout_s=77.0, collective_timeout_s=33.0)
    cfg = TrainConfig.of(strategy="ddp", model="tiny-llama", nproc=2, run_id="r1").resolve(changed)
    assert cfg.profile == changed and cfg.resolve() == cfg  # idempotent: keeps its Profile
    looked_up = _counting_profiles(monkeypatch)
    again = TrainConfig.from_json(cfg.to_json())
    assert again == cfg and again.profile.timeout_s == 77.0
    profile, _ = worker.parse_job(["--config-json", cfg.to_json()])
    assert profile == changed
    assert api._timeout(cfg, None) == 77.0 and api.process_group(cfg) == "gloo/cpu/33"
    assert looked_up == []
    with pytest.raises(ConfigError, match=r"not resolved yet.*make_config"):
        TrainConfig.of(strategy="ddp", model="tiny-llama").profile
    assert cfg.replace(profile="smoke-bf16").resolved_profile is None  # another profile: resolve again
    assert cfg.replace(amp="bf16").profile == changed


def test_a_run_looks_its_profile_up_once(monkeypatch, tmp_path):
    """From `labkit.train.run` (the CLI's and the notebooks' entry) through the loop of an in-process run,
    the profile is looked up by name once: where the config is resolved."""
    from labkit import train

    looked_up = _counting_profiles(monkeypatch)
    record = train.run("single", "tiny-llama", steps=2, out=str(tmp_path), progress=False, eval_batches=0)
    assert record.steps == 2
    assert looked_up == ["smoke"]
