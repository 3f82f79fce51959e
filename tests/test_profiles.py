"""labkit.profiles: named, frozen, validated run profiles with typed overrides."""
from __future__ import annotations

import dataclasses

import pytest

from labkit.errors import ConfigError
from labkit.profiles import PROFILES, Profile, get_profile


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_constructs_and_is_consistent(name):
    profile = get_profile(name)
    assert isinstance(profile, Profile) and profile.name == name
    if profile.device == "cuda":
        assert profile.backend == "nccl" and profile.gpu_memory_gb > 0 and profile.peak_tflops > 0
    else:
        assert profile.backend == "gloo" and profile.gpu_name == ""


def test_smoke_is_cpu_gloo_two_ranks():
    smoke = get_profile("smoke")
    assert (smoke.device, smoke.backend, smoke.nproc) == ("cpu", "gloo", 2)


def test_unknown_profile_names_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        get_profile("a100x8")
    message = str(info.value)
    assert "'a100x8'" in message
    assert all(name in message for name in PROFILES)


def test_unknown_field_names_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        get_profile("smoke", stepz=3)
    message = str(info.value)
    assert "'stepz'" in message and "steps" in message and "timeout_s" in message


@pytest.mark.parametrize("field, value, expected", [
    ("steps", "10", "int"), ("steps", True, "int"), ("lr", "1e-3", "float"), ("device", 0, "str"),
])
def test_bad_override_type_names_field_and_expected_type(field, value, expected):
    with pytest.raises(ConfigError, match=rf"{field}={value!r}.*expected {expected}"):
        get_profile("smoke", **{field: value})


@pytest.mark.parametrize("overrides, fragment", [
    (dict(steps=0), "steps=0"), (dict(lr=-1.0), "lr=-1.0"), (dict(dtype="fp8"), "dtype='fp8'"),
    (dict(backend="nccl"), "nccl needs CUDA"), (dict(device="tpu"), "device='tpu'"),
])
def test_bad_override_values_are_rejected(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        get_profile("smoke", **overrides)


def test_overrides_apply_and_leave_the_rest():
    base = get_profile("smoke")
    changed = get_profile("smoke", steps=3, lr=1)
    assert changed.steps == 3
    assert changed.lr == 1.0 and isinstance(changed.lr, float)  # an int is accepted for a float field
    assert dataclasses.replace(changed, steps=base.steps, lr=base.lr) == base


def test_overrides_on_a_profile_instance():
    custom = get_profile(get_profile("a100x4"), nproc=2)
    assert custom.name == "a100x4" and custom.nproc == 2
    assert get_profile("a100x4").nproc == 4  # the named profile is unchanged


def test_profiles_are_frozen():
    profile = get_profile("smoke")
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.steps = 1  # type: ignore[misc]
