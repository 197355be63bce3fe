"""`python -m atlas.run --interactive`: a conversation in the terminal. Each line on stdin is a user
turn; the reply streams to stdout; the model's chat template renders the whole conversation each
turn, and the prompt cache resumes after what the previous turns already ran. A conversation that
outgrows the context loses its oldest turns (system messages stay), as chat front ends do, and says
so. `/reset` starts over, `/exit` (or end of input) leaves; Ctrl-C stops a reply and keeps the
conversation as it was."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field, replace

import click

from .errors import AtlasError
from .llm import LLM, GenerateOptions, GenerationResult, context_capacity

COMMANDS = {"/exit": "leave", "/quit": "leave", "/reset": "forget the conversation"}
REPLY_ROOM = 256  # -n -1: the reply tokens a conversation keeps room for before it drops its oldest turns


@dataclass
class Conversation:
    llm: LLM
    opts: GenerateOptions  # chat=False: the prompt is the rendered conversation
    messages: list[dict[str, str]] = field(default_factory=list)

    def turn(self, text: str, on_text: Callable[[str], None]) -> GenerationResult:
        """One user turn -> the reply (appended to the conversation only once it is complete)."""
        messages = self.fitted([*self.messages, {"role": "user", "content": text}])
        prompt_ids = self.llm.prepare(self.llm.tokenizer.encode_chat(messages), self.opts)
        result = self.llm.generate_with(prompt_ids, self.opts, on_text)
        self.messages = [*messages, {"role": "assistant", "content": result.text}]
        return result

    def fitted(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """The conversation without its oldest turns (a user message and the replies after it;
        system messages and the new turn stay) until its prompt and max_tokens fit the context
        (max_tokens None, -n -1: a reply of up to REPLY_ROOM tokens; it may then go on to the
        context's end). A new turn too long alone is left to prepare's one-line refusal."""
        capacity = context_capacity(self.llm.parts.spec, self.llm.parts.engine)
        reply = self.opts.max_tokens if self.opts.max_tokens is not None else min(REPLY_ROOM, capacity // 2)
        room = capacity - reply + 1  # the prompt tokens that fit
        kept, dropped = messages, 0
        length = len(self.llm.tokenizer.encode_chat(kept))
        while length > room and (turn := oldest_turn(kept)) is not None:
            kept = kept[: turn.start] + kept[turn.stop :]
            dropped += 1
            length = len(self.llm.tokenizer.encode_chat(kept))
        over = length > room
        # The new turn alone leaves less room than that: under a max_tokens, nothing is left out for
        # it (prepare refuses it in one line); under None it is answered in what room the context has.
        if over and (self.opts.max_tokens is not None or length >= capacity):
            return messages
        if dropped:
            click.echo(f"atlas: the conversation outgrew the context ({capacity} positions with room for a reply of "
                       f"{reply} tokens); its oldest {dropped} turn(s) are left out", err=True)
        return kept


def oldest_turn(messages: list[dict[str, str]]) -> slice | None:
    """The first user message and what follows it up to the next user message, unless that first
    one is the newest (the turn being asked)."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return slice(users[0], users[1]) if len(users) > 1 else None


def converse(llm: LLM, opts: GenerateOptions, first: str | None, stats: Callable[[GenerationResult], str],
             system: list[dict[str, str]] | None = None) -> None:
    """The loop: `first` (the --prompt) is the first turn; then stdin, a line a turn; `system`
    (--system) opens the conversation and stays through /reset."""
    conversation = Conversation(llm, replace(opts, chat=False), list(system or []))
    click.echo("atlas: interactive chat; /reset starts over, /exit or end of input leaves", err=True)
    pending = [first] if first else []
    while (line := pending.pop() if pending else read_turn()) is not None:
        command = line.strip()
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            conversation.messages = list(system or [])
            continue
        if command:
            reply(conversation, command, stats)


def reply(conversation: Conversation, text: str, stats: Callable[[GenerationResult], str]) -> None:
    out = TextOut()
    try:
        result = conversation.turn(text, out.write)
    except KeyboardInterrupt:
        click.echo("\natlas: reply stopped; the conversation is as it was before this turn", err=True)
        return
    except AtlasError as err:  # e.g. a turn too long for the context alone
        out.end_line()
        click.echo(f"atlas: {err}", err=True)
        return
    out.write("\n")
    click.echo(stats(result), err=True)


def read_turn() -> str | None:
    """The next line of stdin (None at its end), after a "> " prompt on stderr."""
    click.echo("> ", err=True, nl=False)
    line = sys.stdin.readline()
    return line if line else None


@dataclass
class TextOut:
    """Generated text to stdout, unaltered (click.echo would strip escape sequences off a pipe).
    It knows whether its last line is unterminated, so that an error line after a reply cut short
    starts a line of its own on a terminal that shows both streams."""

    line_open: bool = False

    def write(self, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.line_open = not text.endswith("\n")

    def end_line(self) -> None:
        """A newline after unterminated text, when standard output still takes one (the error
        being reported may be its own)."""
        if self.line_open:
            with suppress(OSError, ValueError):
                self.write("\n")
