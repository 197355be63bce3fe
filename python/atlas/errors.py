"""User-facing errors: one line that names the problem and the fix."""

from __future__ import annotations


class AtlasError(Exception):
    """A problem with the user's input (model, checkpoint, flag, environment).

    CLIs print `str(err)` on one line and exit with code 2; no traceback is shown.
    """
