"""The bench scripts' shared ending (bench/quant.py's form, atlas.cli's rule): bad input (a flag, a
path, an AtlasError from the model or the run, no GPU) is one line on stderr and exit code 2, never
a traceback."""

from __future__ import annotations

import sys
from typing import Any

USAGE_EXIT = 2


class NoGpu(Exception):
    """No GPU can be used here (the message says why): `no GPU: ...`, exit code 2."""


def gpu_missing() -> str | None:
    """Why no GPU can be used here, or None."""
    from atlas.errors import AtlasError

    try:
        from atlas.backends.cuda.driver import open_driver

        open_driver()
    except (AtlasError, ImportError, OSError) as err:
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    return None


def fail(prog: str, message: str) -> int:
    """`<prog>: error: <message>` on one line of stderr; the exit code to return."""
    from atlas.cli import one_line

    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return USAGE_EXIT


def no_gpu(missing: str) -> int:
    """bench/quant.py's line for a machine without a usable GPU; the exit code to return."""
    print(f"no GPU: {missing}", file=sys.stderr)
    return USAGE_EXIT


def run_click(command: Any, prog: str) -> int:
    """atlas.cli.run_command for a click script run as `python <prog>`: an AtlasError or a flag
    click rejects is `<prog>: error: ...` and exit code 2."""
    from atlas.cli import run_command

    return run_command(command, None, prog, usage=f"python {prog}")
