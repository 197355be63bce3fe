"""User-facing errors: one line that names the problem and the fix."""

from __future__ import annotations

import errno
import os
import sys

# no room left: a full disk or quota, a file past the size limit (freeing space is the fix)
NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# a write the machine refused (standard output with no room, a failing device)
OUTPUT_ERRNOS = (*NO_ROOM_ERRNOS, errno.EIO)


class AtlasError(Exception):
    """A problem with the user's input (model, checkpoint, flag, environment).

    CLIs print `str(err)` on one line and exit with code 2; no traceback is shown.
    """


def refused_write_line(prog: str, err: OSError) -> str | None:
    """The one error line for a write the machine refused (OUTPUT_ERRNOS), with standard output
    silenced; None for any other OSError."""
    if err.errno not in OUTPUT_ERRNOS:
        return None
    silence_stdout()
    return (f"{prog}: error: cannot write {err.filename or 'the output'} ({err.strerror}); "
            "free some space or write elsewhere")


def silence_stdout() -> None:
    """Point standard output at /dev/null, dropping what is still buffered for it (a second
    failure to write it at exit would print a report)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, AttributeError, ValueError):  # no stdout at all, or not a file
        pass
