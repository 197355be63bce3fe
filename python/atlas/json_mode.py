"""JSON mode (OpenAI's `response_format: {"type": "json_object"}`): the generated text is one JSON
object. A byte-level pushdown recognizer of JSON prefixes (RFC 8259) says which tokens may come
next; the pick is made among those: greedy takes the most likely allowed token, sampling draws from
the allowed tokens' distribution (top-k / top-p / min_p applied to it). The text starts with '{'
and, once the object is closed, only an end-of-sequence id may follow. Whitespace between tokens
is one optional line break and up to MAX_INDENT spaces or tabs (llama.cpp's JSON grammar's rule),
so a model cannot stall in blank lines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, auto

import numpy as np

from .errors import AtlasError

MAX_INDENT = 20  # spaces or tabs in one run of whitespace (after its one optional line break)
GREEDY_CANDIDATES = 64  # the most likely tokens tried first; the full order only when none fits
NEGLIGIBLE_MASS = 1e-6  # sampling: tokens are checked until the unchecked mass is below this share
LINE_BREAKS = frozenset(b"\n\r")
INDENT = frozenset(b" \t")
ESCAPES = frozenset(b'"\\/bfnrtu')
HEX = frozenset(b"0123456789abcdefABCDEF")
DIGITS = frozenset(b"0123456789")
LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}


class Expect(Enum):
    START = auto()  # whitespace, then the top-level '{'
    VALUE = auto()  # any value (after ':' or an array's ',')
    FIRST_KEY = auto()  # after '{': a key or '}'
    KEY = auto()  # after an object's ',': a key
    COLON = auto()  # after a key
    FIRST_ITEM = auto()  # after '[': a value or ']'
    NEXT = auto()  # after a value in a container: ',' or its closer
    STRING = auto()
    NUMBER = auto()
    LITERAL = auto()
    DONE = auto()  # the object is closed


# Number states: those a number may end in, and the byte classes each accepts.
NUMBER_ENDS = {"zero", "int", "frac", "exp_digits"}


def _number_step(state: str, byte: int) -> str | None:
    digit = byte in DIGITS
    table = {
        "minus": "zero" if byte == 0x30 else "int" if digit else None,
        "zero": "dot" if byte == 0x2E else "exp" if byte in b"eE" else None,
        "int": "int" if digit else "dot" if byte == 0x2E else "exp" if byte in b"eE" else None,
        "dot": "frac" if digit else None,
        "frac": "frac" if digit else "exp" if byte in b"eE" else None,
        "exp": "exp_digits" if digit else "exp_sign" if byte in b"+-" else None,
        "exp_sign": "exp_digits" if digit else None,
        "exp_digits": "exp_digits" if digit else None,
    }
    return table[state]


@dataclass
class JsonPrefix:
    """Where a byte stream stands in a JSON object; feed() says whether it is still a prefix of one."""

    expect: Expect = Expect.START
    stack: list[int] = field(default_factory=list)  # open containers: ord('{') or ord('[')
    indent: int = -1  # spaces / tabs in the current run of whitespace; -1: none yet
    line_break: bool = False  # the current run of whitespace holds its line break
    string_is_key: bool = False
    escape: int = 0  # in a string: 1 after a backslash, 2..5 hex digits of \u still due (5 = 4 due)
    utf8_due: int = 0  # continuation bytes still due in a string
    number: str = ""
    literal: bytes = b""  # bytes of true / false / null still due

    def copy(self) -> JsonPrefix:
        return JsonPrefix(self.expect, list(self.stack), self.indent, self.line_break, self.string_is_key,
                          self.escape, self.utf8_due, self.number, self.literal)

    @property
    def complete(self) -> bool:
        return self.expect is Expect.DONE

    def feed(self, data: bytes) -> bool:
        """Consume `data`; False as soon as it cannot continue a JSON object (the state is then
        undefined: feed a copy to test)."""
        return all(self._byte(b) for b in data)

    def _byte(self, b: int) -> bool:
        if self.expect is Expect.STRING:
            return self._string(b)
        if self.expect is Expect.LITERAL:
            if b != self.literal[0]:
                return False
            self.literal = self.literal[1:]
            if not self.literal:
                self._value_done()
            return True
        if self.expect is Expect.NUMBER:
            step = _number_step(self.number, b)
            if step is not None:
                self.number = step
                return True
            if self.number not in NUMBER_ENDS:
                return False
            self._value_done()  # the byte ends the number; it belongs to what follows
        if b in LINE_BREAKS or b in INDENT:
            return self._whitespace(b)
        self.indent, self.line_break = -1, False
        return self._structural(b)

    def _whitespace(self, b: int) -> bool:
        if self.expect in (Expect.START, Expect.DONE):
            return False
        if b in LINE_BREAKS:  # first in its run, and only once
            ok = self.indent <= 0 and not self.line_break
            self.line_break, self.indent = True, 0
            return ok
        self.indent = max(self.indent, 0) + 1
        return self.indent <= MAX_INDENT

    def _structural(self, b: int) -> bool:
        e = self.expect
        if e is Expect.START:
            return b == ord("{") and self._open(b)
        if e in (Expect.FIRST_KEY, Expect.KEY) and b == ord('"'):
            return self._open_string(is_key=True)
        if e is Expect.COLON:
            if b == ord(":"):
                self.expect = Expect.VALUE
            return b == ord(":")
        if (e is Expect.FIRST_KEY and b == ord("}")) or (e is Expect.FIRST_ITEM and b == ord("]")):
            return self._close()
        if e is Expect.NEXT:
            return self._after_value(b)
        if e in (Expect.VALUE, Expect.FIRST_ITEM):
            return self._start_value(b)
        return False

    def _start_value(self, b: int) -> bool:
        if b in b"{[":
            return self._open(b)
        if b == ord('"'):
            return self._open_string(is_key=False)
        if b == ord("-") or b in DIGITS:
            self.expect, self.number = Expect.NUMBER, "minus" if b == ord("-") else "zero" if b == ord("0") else "int"
            return True
        if b in LITERALS:
            self.expect, self.literal = Expect.LITERAL, LITERALS[b]
            return True
        return False

    def _after_value(self, b: int) -> bool:
        top = self.stack[-1]
        if b == ord(","):
            self.expect = Expect.KEY if top == ord("{") else Expect.VALUE
            return True
        if b == top + 2:  # '{' + 2 = '}', '[' + 2 = ']'
            return self._close()
        return False

    def _open(self, b: int) -> bool:
        self.stack.append(b)
        self.expect = Expect.FIRST_KEY if b == ord("{") else Expect.FIRST_ITEM
        return True

    def _close(self) -> bool:
        self.stack.pop()
        self._value_done()
        return True

    def _open_string(self, is_key: bool) -> bool:
        self.expect, self.string_is_key, self.escape, self.utf8_due = Expect.STRING, is_key, 0, 0
        return True

    def _value_done(self) -> None:
        self.expect = Expect.NEXT if self.stack else Expect.DONE

    def _string(self, b: int) -> bool:
        if self.utf8_due:
            self.utf8_due -= 1
            return 0x80 <= b <= 0xBF
        if self.escape == 1:
            self.escape = 5 if b == ord("u") else 0
            return b in ESCAPES
        if self.escape:
            self.escape = 0 if self.escape == 2 else self.escape - 1
            return b in HEX
        if b == ord('"'):
            if self.string_is_key:
                self.expect = Expect.COLON
            else:
                self._value_done()
            return True
        if b == ord("\\"):
            self.escape = 1
            return True
        if b < 0x20 or 0x80 <= b < 0xC2 or b > 0xF4:
            return False  # a control byte, a stray continuation byte, or no UTF-8 lead byte
        self.utf8_due = 0 if b < 0x80 else 1 if b < 0xE0 else 2 if b < 0xF0 else 3
        return True


class JsonConstraint:
    """One generation's JSON-mode state: which tokens may come next, and the pick among them."""

    def __init__(self, token_bytes: Sequence[bytes | None], end_ids: set[int]) -> None:
        if not end_ids:
            raise AtlasError("JSON mode needs an end-of-sequence token to end the object; "
                             "the model has none (or ignore_eos is set)")
        self.token_bytes = token_bytes
        self.end_ids = end_ids
        self.state = JsonPrefix()

    def allows(self, token: int) -> bool:
        if self.state.complete:
            return token in self.end_ids
        data = self.token_bytes[token] if token < len(self.token_bytes) else None
        return bool(data) and self.state.copy().feed(data)  # type: ignore[arg-type]

    def advance(self, token: int) -> None:
        if not self.state.complete:
            data = self.token_bytes[token]
            assert data and self.state.feed(data), f"token {token} was not allowed"

    def greedy(self, logits: np.ndarray) -> int:
        """The most likely allowed token of logits [V] (NaN never; ties: the lower id)."""
        z = np.where(np.isnan(logits), -np.inf, logits)  # [V]
        head = np.argpartition(-z, min(GREEDY_CANDIDATES, z.size - 1))[:GREEDY_CANDIDATES]  # [C]
        for order in (head[np.lexsort((head, -z[head]))], np.lexsort((np.arange(z.size), -z))):
            for token in order:
                if self.allows(int(token)):
                    return int(token)
        raise AtlasError("JSON mode: no token of the vocabulary continues the JSON text")

    def mask(self, logits: np.ndarray, probs: np.ndarray) -> np.ndarray:
        """logits [V] with every token that is not allowed at -inf. Tokens are checked from the most
        likely (probs [V]) until the unchecked ones hold under NEGLIGIBLE_MASS of the allowed mass;
        those are left out too."""
        order = np.argsort(-probs, kind="stable")  # [V]
        masked = np.full(logits.shape, -np.inf, dtype=np.float32)  # [V]
        checked = allowed = 0.0
        for token in order:
            if allowed > 0 and 1.0 - checked < NEGLIGIBLE_MASS * allowed:
                break
            checked += float(probs[token])
            if self.allows(int(token)):
                masked[token] = logits[token]
                allowed += float(probs[token])
        if not np.isfinite(masked).any():
            raise AtlasError("JSON mode: no token of the vocabulary continues the JSON text")
        return masked
