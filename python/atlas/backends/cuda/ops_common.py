"""What every op wrapper module shares: ceil division for grids, the int32 limit of the kernels'
index math, argument checks (ValueError: a wrong call is a bug in the caller, not user input), and
the environment switches that pick a kernel form (AtlasError: user input)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ...errors import AtlasError

INT32_MAX = 2**31 - 1


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class FormSwitch:
    """An environment variable choosing a kernel form: `forms[0]` is the default (also when the
    variable is empty); the CUDA backend reads each once, when it is built."""

    env: str
    what: str  # "router form": the message says "... is not a router form"
    forms: tuple[str, ...]

    def read(self, form: str | None = None, environ: Mapping[str, str] = os.environ) -> str:
        """`form` when given (checked), else the variable's value."""
        chosen = (environ.get(self.env, "").strip() or self.forms[0]) if form is None else form
        if chosen not in self.forms:
            others = " or ".join(repr(f) for f in self.forms[1:])
            raise AtlasError(f"{self.env}={chosen!r} is not a {self.what}; use {self.forms[0]!r} (default) or {others}")
        return chosen
