"""The `atlas` console script (atlas.commands, and `python -m atlas`): each command is the
`python -m atlas.<command>` of its name, with the same flags and output."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from atlas import commands

REPO = Path(__file__).resolve().parent.parent


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert commands.main(["--help"]) == 0
    listed = capsys.readouterr().out
    for name in commands.COMMANDS:
        assert f"  {name} " in listed
        assert callable(importlib.import_module(f"atlas.{name}").main)


@pytest.mark.parametrize("argv, needle", [([], "Usage: atlas COMMAND"), (["serv"], "unknown command 'serv'")])
def test_no_or_an_unknown_command_is_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    assert commands.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and ("serve" in err)


@pytest.mark.parametrize("name", sorted(commands.COMMANDS))
def test_a_commands_help_names_it_as_typed(capsys: pytest.CaptureFixture[str], name: str) -> None:
    """`atlas serve --help` shows `atlas serve` as the way to run it, not `python -m atlas.serve`."""
    capsys.readouterr()
    assert commands.main([name, "--help"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.lower().startswith(f"usage: atlas {name} ["), first


def test_a_command_runs_its_module(capsys: pytest.CaptureFixture[str], rng: np.random.Generator) -> None:
    """`atlas run ...` writes what `python -m atlas.run ...` writes; a bad flag is its one line."""
    from atlas import run

    words = rng.choice(["Beautiful", "is", "better", "Flat", "than"], size=int(rng.integers(2, 5)))
    argv = ["--device", "cpu", "-p", " ".join(words), "-n", str(int(rng.integers(2, 9)))]
    capsys.readouterr()
    assert commands.main(["run", *argv]) == 0
    via_atlas = capsys.readouterr().out
    assert run.main(argv) == 0
    assert via_atlas == capsys.readouterr().out and via_atlas.strip()
    assert commands.main(["run", "--temp", "-1"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_python_m_atlas_and_the_console_script() -> None:
    """`python -m atlas` dispatches; pyproject's console script names atlas.commands:main, and an
    installed atlas (CI's) declares the same."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    done = subprocess.run([sys.executable, "-m", "atlas", "--version"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("atlas "), done
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"atlas": "atlas.commands:main"}
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        installed = {e.name: e.value for e in distribution("atlas").entry_points if e.group == "console_scripts"}
    except PackageNotFoundError:
        return  # a source checkout run without installing: pyproject's declaration is what a wheel gets
    assert installed == scripts
