"""`python -m atlas.run --interactive`: a conversation in the terminal. Each line on stdin is a user
turn; the reply streams to stdout; the model's chat template renders the whole conversation each
turn, and the prompt cache resumes after what the previous turns already ran. `/reset` starts over,
`/exit` (or end of input) leaves; Ctrl-C stops a reply and keeps the conversation as it was."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import click

from .errors import AtlasError
from .llm import LLM, GenerateOptions, GenerationResult

COMMANDS = {"/exit": "leave", "/quit": "leave", "/reset": "forget the conversation"}


@dataclass
class Conversation:
    llm: LLM
    opts: GenerateOptions  # chat=False: the prompt is the rendered conversation
    messages: list[dict[str, str]] = field(default_factory=list)

    def turn(self, text: str, on_text: Callable[[str], None]) -> GenerationResult:
        """One user turn -> the reply (appended to the conversation only once it is complete)."""
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt_ids = self.llm.prepare(self.llm.tokenizer.encode_chat(messages), self.opts)
        result = self.llm.generate_with(prompt_ids, self.opts, on_text)
        self.messages = [*messages, {"role": "assistant", "content": result.text}]
        return result


def converse(llm: LLM, opts: GenerateOptions, first: str | None, stats: Callable[[GenerationResult], str]) -> None:
    """The loop: `first` (the --prompt) is the first turn; then stdin, a line a turn."""
    conversation = Conversation(llm, replace(opts, chat=False))
    click.echo("atlas: interactive chat; /reset starts over, /exit or end of input leaves", err=True)
    pending = [first] if first else []
    while (line := pending.pop() if pending else read_turn()) is not None:
        command = line.strip()
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            conversation.messages = []
            continue
        if command:
            reply(conversation, command, stats)


def reply(conversation: Conversation, text: str, stats: Callable[[GenerationResult], str]) -> None:
    try:
        result = conversation.turn(text, write_stdout)
    except KeyboardInterrupt:
        click.echo("\natlas: reply stopped; the conversation is as it was before this turn", err=True)
        return
    except AtlasError as err:  # e.g. the conversation outgrew the context
        click.echo(f"atlas: {err}; /reset starts over", err=True)
        return
    write_stdout("\n")
    click.echo(stats(result), err=True)


def read_turn() -> str | None:
    """The next line of stdin (None at its end), after a "> " prompt on stderr."""
    click.echo("> ", err=True, nl=False)
    line = sys.stdin.readline()
    return line if line else None


def write_stdout(text: str) -> None:
    """Generated text goes out unaltered (click.echo would strip escape sequences off a pipe)."""
    sys.stdout.write(text)
    sys.stdout.flush()
