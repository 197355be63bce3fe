"""The command-line entry points' shared ending: bad input (an AtlasError or a click usage error)
is one line on stderr and exit code 2, never a traceback; Ctrl-C is a short message and 130."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

import click

from .errors import AtlasError, refused_write_line

USAGE_EXIT = 2
INTERRUPT_EXIT = 130


def one_line(text: str) -> str:
    return " ".join(text.split())


def run_command(command: click.Command, argv: list[str] | None, prog: str, quiet_interrupt: bool = False,
                usage: str | None = None) -> int:
    """Runs a click command as `python -m <prog>` (or as `usage` says, e.g. `python bench/x.py` or
    `atlas run`: the name its --help shows); returns its exit code (the command's own int, else 0).
    quiet_interrupt: Ctrl-C is the normal way to stop (a server), exit 0 silently."""
    try:
        check_arguments(sys.argv[1:] if argv is None else argv)
        code = command.main(args=argv, prog_name=usage or f"python -m {prog}", standalone_mode=False)
    except click.exceptions.Exit as done:  # --help
        return done.exit_code
    except click.ClickException as err:
        click.echo(f"{prog}: error: {one_line(err.format_message())} (see --help)", err=True)
        return USAGE_EXIT
    except AtlasError as err:
        click.echo(f"{prog}: error: {one_line(str(err))}", err=True)
        return USAGE_EXIT
    except RecursionError:  # a schema or grammar nested past Python's recursion limit
        click.echo(f"{prog}: error: an input nests too deeply to read (a JSON schema, grammar or JSON value); "
                   "flatten it", err=True)
        return USAGE_EXIT
    except OSError as err:
        if (line := refused_write_line(prog, err)) is None:
            raise
        click.echo(line, err=True)
        return USAGE_EXIT
    except (KeyboardInterrupt, click.exceptions.Abort):
        if quiet_interrupt:
            return 0
        click.echo(f"\n{prog}: interrupted", err=True)
        return INTERRUPT_EXIT
    return 0 if code is None else int(code)


def check_arguments(argv: list[str]) -> None:
    """An argument whose bytes are not UTF-8 (Python keeps them as lone surrogates, which no
    tokenizer, regex or template expects) is one line naming its flag; a path that exists is left
    alone (Linux file names may be any bytes)."""
    for i, arg in enumerate(argv):
        joined = arg.startswith("--") and "=" in arg
        flag, value = arg.split("=", 1) if joined else (argv[i - 1] if i and argv[i - 1].startswith("-") else
                                                       f"argument {i + 1}", arg)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            if os.path.lexists(value):
                continue
            byte = ord(value[err.start]) - 0xDC00  # surrogateescape: U+DC80..U+DCFF stand for bytes 0x80..0xFF
            shown = f"byte 0x{byte:02x}" if 0x80 <= byte <= 0xFF else f"U+{ord(value[err.start]):04X}"
            raise AtlasError(f"{flag}: not UTF-8 text ({shown} at character {err.start}); give UTF-8 text "
                             "(a UTF-8 locale, or the text in a file)") from None


@contextlib.contextmanager
def termination_as_exit() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP (kill, timeout, a closed terminal, docker stop) raise
    SystemExit(128 + signal) so the block's cleanup runs (their default ends the process at once,
    leaving a half-written directory behind); a handler someone else set is kept."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for number in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(number) is signal.SIG_DFL:
            previous[number] = signal.signal(number, _exit_on_signal)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _exit_on_signal(number: int, frame: object) -> None:
    raise SystemExit(128 + number)
