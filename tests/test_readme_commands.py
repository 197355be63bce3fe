"""README.md stays true: every `python -m atlas.*` command in its shell blocks runs, in the order
written, with the embedded demo standing in for the checkpoints it names (Qwen3.6 is not on this
machine) and the files it reads made beforehand (the server on a free port, until it listens),
and its Python API block runs as written. A GPU-only command skips without a GPU; the openai
client's block, which talks to a server, is tests/test_serve.py's."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from _demo_copy import demo_copy  # noqa: E402
from _served import serving  # noqa: E402
from atlas.demo import zen_of_python  # noqa: E402
from bench_cli import gpu_missing  # noqa: E402

STAND_INS = {"qwen3.6-35b-a3b": "./my-checkpoint"}  # registry names -> a demo copy in the working directory
CHECKPOINTS = ("my-checkpoint", "bf16-checkpoint")  # the README's own paths, made as demo copies
QWEN_CONTEXT = 262144  # the stand-ins' max_position_embeddings, as Qwen3.6's (the demo's is 2048)
INPUTS = ("long-prompt.txt", "wiki.test.raw")
STDIN = "Flat is better\n/exit\n"  # for --interactive
SERVERS = ("atlas.serve",)  # run until stopped: started on a free port, stopped once listening
TIMEOUT_S = 300


def readme_blocks(language: str) -> list[tuple[int, str]]:
    """(first line number, text) of each ```language block."""
    blocks, start, lines = [], 0, (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if not start and line == f"```{language}":
            start = number + 1
        elif start and line.startswith("```"):
            blocks.append((start, "\n".join(lines[start - 1 : number - 1])))
            start = 0
    return blocks


def readme_commands() -> list[tuple[int, list[str]]]:
    """(line number, argv with its leading VAR=value words) of each atlas command in a bash block."""
    commands = []
    for start, text in readme_blocks("bash"):
        for number, line in enumerate(text.splitlines(), start):
            command = line.split("&&")[-1]  # `pip install . && python -m atlas.run`: the command after the install
            if re.search(r"(^|\s)python -m atlas\.", command):
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
    failed = []
    for number, argv in commands:
        extra, command = runnable(argv)
        if gpu_absent and "cuda" in command:
            continue
        env = {**os.environ, "PYTHONPATH": str(REPO / "python"), **extra}
        if command[2] in SERVERS:
            code, said = served(command, tmp_path, env)
        else:
            done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                                  input=STDIN if {"-i", "--interactive"} & set(command) else "")
            code, said = done.returncode, done.stderr
        if code != 0:
            failed.append(f"README.md:{number}: exit {code}: {said.strip().splitlines()[-1:]}")
    assert not failed, "\n".join(failed)


def served(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """A server command on a free port: (its exit code after Ctrl-C once it listens, what went wrong)."""
    try:
        with serving(command, cwd, env) as (process, _):
            process.send_signal(signal.SIGINT)
            return process.wait(TIMEOUT_S), "it did not stop on Ctrl-C"
    except AssertionError as err:
        return 1, str(err)

def test_the_readme_python_blocks_run(tmp_path: Path) -> None:
    blocks = [(start, text) for start, text in readme_blocks("python") if "openai" not in text]
    assert blocks and "LLM(" in blocks[0][1]
    for start, text in blocks:
        done = subprocess.run([sys.executable, "-c", text], cwd=tmp_path, capture_output=True, text=True,
                              timeout=TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(REPO / "python")})
        assert done.returncode == 0, f"README.md:{start}: {done.stderr[-2000:]}"
