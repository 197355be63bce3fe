"""What every op wrapper module shares: ceil division for grids, the int32 limit of the kernels'
index math, and argument checks (ValueError: a wrong call is a bug in the caller, not user input)."""

from __future__ import annotations

INT32_MAX = 2**31 - 1


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
