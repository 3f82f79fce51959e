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
