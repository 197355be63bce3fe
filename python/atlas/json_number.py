"""A JSON number within bounds (a schema's minimum / maximum / exclusiveMinimum / exclusiveMaximum
on type number), for atlas.json_match.

Generation keeps to plain decimals (-?(0|[1-9][0-9]*)(.[0-9]+)?, no exponent) and takes a byte
only when some decimal that starts with the text so far lies within the bounds, reasoned exactly
with fractions: digits after a decimal point narrow the value to [v, v + 10^-n); digits before it
to the union over k of [d * 10^k, (d + 1) * 10^k). A text ends where its value is within the
bounds both exactly and as the float a JSON parser reads (validators compare floats)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .json_match import NUMBER_ENDS, Node, State, number_step


def is_finite_number(value: Any) -> bool:
    """A JSON number a schema may bound with: any int (exact at every size) or a finite float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)


def parsed_float(x: Fraction | int) -> float:
    """x as the float a JSON parser reads its decimal as: past the largest double, infinity."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


@dataclass(frozen=True)
class Interval:
    """Values x with low < x (low_open) or low <= x, and likewise below high; None: unbounded."""

    low: Fraction | None = None
    high: Fraction | None = None
    low_open: bool = False
    high_open: bool = False

    def mirrored(self) -> Interval:
        """The interval of -x."""
        return Interval(None if self.high is None else -self.high, None if self.low is None else -self.low,
                        self.high_open, self.low_open)

    def holds(self, x: Fraction) -> bool:
        above = self.low is None or (x > self.low if self.low_open else x >= self.low)
        return above and (self.high is None or (x < self.high if self.high_open else x <= self.high))

    def meets(self, a: Fraction, b: Fraction | None) -> bool:
        """Some x in [a, b) (b None: unbounded) lies inside: decimals are dense, so some decimal
        in [a, b) does too (a itself where the intersection is that one point)."""
        lower, lower_open = (a, False) if self.low is None or self.low < a else (self.low, self.low_open)
        if b is None or (self.high is not None and self.high < b):
            upper, upper_open = (self.high, self.high_open) if self.high is not None else (None, True)
        else:
            upper, upper_open = b, True
        return upper is None or lower < upper or (lower == upper and not lower_open and not upper_open)

    def holds_float(self, x: float) -> bool:
        """holds() as a validator comparing parsed floats decides it."""
        low = None if self.low is None else parsed_float(self.low)
        high = None if self.high is None else parsed_float(self.high)
        above = low is None or (x > low if self.low_open else x >= low)
        return above and (high is None or (x < high if self.high_open else x <= high))

    def readable(self) -> bool:
        """Not ruled out by a validator that reads numbers as doubles: an exclusive bound past the
        largest double reads as infinity, and no number is above infinity (or below -infinity)."""
        above_all = self.low is not None and self.low_open and parsed_float(self.low) == math.inf
        below_all = self.high is not None and self.high_open and parsed_float(self.high) == -math.inf
        return not (above_all or below_all)

    def empty(self) -> bool:
        if self.low is None or self.high is None:
            return False
        return self.low > self.high or (self.low == self.high and (self.low_open or self.high_open))


class DecimalRange(Node):
    """A plain decimal within `interval`. State: (phase, negative, magnitude so far, the weight of
    the next fraction digit)."""

    __slots__ = ("interval",)

    def __init__(self, interval: Interval) -> None:
        self.interval = interval

    def begin(self) -> State:
        return "start", False, Fraction(0), Fraction(1)

    def step(self, state: State, byte: int) -> State | None:
        phase, negative, value, weight = state
        nxt = number_step(phase, byte, integer=False)
        if nxt is None or nxt.startswith("exp"):
            return None
        if nxt == "minus":
            negative = True
        elif nxt in ("zero", "int"):
            value = value * 10 + (byte - 0x30)
        elif nxt == "frac":
            weight /= 10
            value += weight * (byte - 0x30)
        return (nxt, negative, value, weight) if self._viable(nxt, negative, value, weight) else None

    def _viable(self, phase: str, negative: bool, value: Fraction, weight: Fraction) -> bool:
        """Some decimal that starts with the text so far lies within the bounds."""
        window = self.interval.mirrored() if negative else self.interval  # on the magnitude
        if phase == "minus":
            return window.meets(Fraction(0), None)
        if phase in ("zero", "dot", "frac"):
            return window.meets(value, value + weight)
        scale = 1  # "int": k more integer digits give [d * 10^k, (d + 1) * 10^k)
        while window.high is None or value * scale <= window.high:
            if window.meets(value * scale, (value + 1) * scale) or window.high is None:
                return True
            scale *= 10
        return False

    def final(self, state: State) -> bool:
        phase, negative, value, _ = state
        if phase not in NUMBER_ENDS:
            return False
        signed = -value if negative else value
        return self.interval.holds(signed) and self.interval.holds_float(parsed_float(signed))

    def open(self, state: State) -> bool:
        return True
