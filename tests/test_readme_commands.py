"""README.md stays true: every `python -m atlas.*` command in its shell blocks runs, in the order
written, with the embedded demo standing in for the checkpoints it names (Qwen3.6 is not on this
machine) and the files it reads made beforehand. A GPU-only command skips without a GPU; the
server, which runs until stopped, is covered by tests/test_serve.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from _demo_copy import demo_copy  # noqa: E402
from atlas.demo import zen_of_python  # noqa: E402
from bench_cli import gpu_missing  # noqa: E402

STAND_INS = {"qwen3.6-35b-a3b": "./my-checkpoint"}  # registry names -> a demo copy in the working directory
CHECKPOINTS = ("my-checkpoint", "bf16-checkpoint")  # the README's own paths, made as demo copies
QWEN_CONTEXT = 262144  # the stand-ins' max_position_embeddings, as Qwen3.6's (the demo's is 2048)
INPUTS = ("long-prompt.txt", "wiki.test.raw")
STDIN = "Flat is better\n/exit\n"  # for --interactive
LONG_RUNNING = ("atlas.serve",)
TIMEOUT_S = 300


def readme_commands() -> list[tuple[int, list[str]]]:
    """(line number, argv with its leading VAR=value words) of each atlas command in a shell block."""
    commands, in_block = [], False
    for number, line in enumerate((REPO / "README.md").read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            in_block = not in_block
            continue
        command = line.split("&&")[-1]  # `pip install . && python -m atlas.run`: the command after the install
        if in_block and re.search(r"(^|\s)python -m atlas\.", command):
            commands.append((number, shlex.split(command, comments=True)))
    return commands


def runnable(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """The argv's environment words and the command, models swapped for their stand-ins."""
    env = {}
    while "=" in argv[0] and not argv[0].startswith("-"):
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    command = [sys.executable if word == "python" else STAND_INS.get(word, word) for word in argv]
    return env, command


def test_the_readme_commands_run(tmp_path: Path) -> None:
    commands = readme_commands()
    assert len(commands) >= 15, commands  # the blocks were found
    for name in CHECKPOINTS:
        config_path = demo_copy(tmp_path / name) / "config.json"
        config = json.loads(config_path.read_text())
        config_path.write_text(json.dumps({**config, "max_position_embeddings": QWEN_CONTEXT}))
    for name in INPUTS:
        (tmp_path / name).write_text(zen_of_python(), encoding="utf-8")
    gpu_absent = gpu_missing() is not None
    ran, failed = 0, []
    for number, argv in commands:
        extra, command = runnable(argv)
        if command[2] in LONG_RUNNING or (gpu_absent and "cuda" in command):
            continue
        env = {**os.environ, "PYTHONPATH": str(REPO / "python"), **extra}
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                              input=STDIN if {"-i", "--interactive"} & set(command) else "")
        ran += 1
        if done.returncode != 0:
            failed.append(f"README.md:{number}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    assert not failed, "\n".join(failed)
    assert ran >= 13
