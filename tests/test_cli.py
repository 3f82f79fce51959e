"""The `labkit` command group: lazy subcommands, LabkitError -> exit code 2 with the message."""
from __future__ import annotations

import subprocess
import sys

import click
import pytest

from labkit import cli


def run_main(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    out, err = capsys.readouterr()
    return info.value.code, out, err


def test_help_lists_the_subcommands_and_each_loads():
    proc = subprocess.run([sys.executable, "-m", "labkit", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    names = cli.cli.list_commands(None)
    assert {"env", "launch"} <= set(names)
    for name in names:
        assert name in proc.stdout
        assert isinstance(cli.cli.get_command(None, name), click.Command), name


def test_help_does_not_import_torch():
    code = "import sys; from labkit import cli; cli.cli.list_commands(None); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_labkit_error_becomes_exit_2_with_its_message(capsys):
    code, out, err = run_main(["launch", "emit", "slurm", "--time", "2h", "--", "--strategy", "ddp"], capsys)
    assert code == 2
    assert err.strip() == "error: time='2h'; use HH:MM:SS or D-HH:MM:SS, e.g. 02:00:00"
    assert out == ""


def test_usage_errors_keep_clicks_exit_code(capsys):
    code, _, err = run_main(["no-such-command"], capsys)
    assert code == 2 and "No such command" in err


def test_success_exits_0(capsys):
    code, out, _ = run_main(["launch", "emit", "k8s", "--nodes", "1", "--", "--strategy", "ddp"], capsys)
    assert code == 0 and "kind: PyTorchJob" in out


# ------------------------------------------------------------------ `labkit train` options from TrainConfig
def test_every_train_config_field_has_exactly_one_option_with_help_and_the_dataclass_default():
    import dataclasses

    from labkit.cli.options import option_name
    from labkit.cli.train import command
    from labkit.train.config import SECTIONS

    ctx = click.Context(command)
    options = {p.name: p for p in command.params}
    fields = [f for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert sorted(options) == sorted(f.name for f in fields)  # one option per field, nothing else
    for f in fields:
        opt = options[f.name]
        assert opt.opts[0] == option_name(f) and opt.help and opt.help.strip(), f.name
        if f.default is dataclasses.MISSING:
            assert opt.required and opt.default is None, f.name
            continue
        assert opt.default == f.default and type(opt.default) is type(f.default), f.name
        shown = opt.get_help_record(ctx)[1]
        if f.default is not None and not isinstance(f.default, bool) and f.default != "":
            assert f"[default: {f.default}]" in shown, f.name


def test_train_options_keep_todays_names_and_parse_into_a_config():
    from labkit.cli.train import command
    from labkit.train.config import from_dict

    argv = ["--strategy", "lora", "--model", "tiny-llama", "--amp", "bf16", "--lora-rank", "4", "--deadline-margin",
            "30", "--no-progress", "--compile", "--checkpointing", "--nproc", "2"]
    params = command.make_context("train", argv).params
    cfg = from_dict(params)
    assert (cfg.precision.amp, cfg.peft.lora_rank, cfg.checkpoint.deadline_margin_s) == ("bf16", 4, 30.0)
    assert (cfg.run.progress, cfg.precision.compile, cfg.memory.checkpointing, cfg.launch.nproc) == (False, True, True, 2)
    with pytest.raises(click.BadParameter):
        command.make_context("train", ["--strategy", "ddp", "--model", "tiny-llama", "--amp", "fp8"])


def test_train_help_groups_the_options_by_section(capsys):
    from labkit.train.config import SECTIONS

    code, out, _ = run_main(["train", "--help"], capsys)
    assert code == 0
    headings = [out.index(f"{name.capitalize()} options (cfg.{name}):") for name in SECTIONS]
    assert headings == sorted(headings)  # in TrainConfig's order
    assert headings[0] < out.index("--strategy") < headings[1] < out.index("--nproc") < headings[2]
    assert out.index("Peft options") < out.index("--lora-rank") < out.index("Profiling options")
