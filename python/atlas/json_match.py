"""A byte-level pushdown matcher of JSON texts of a given shape (RFC 8259 bytes, UTF-8 checked as
strictly as Python's decoder). atlas.json_schema compiles a JSON schema into the nodes below;
JSON mode's shape is ANY_OBJECT.

A node is one kind of value; a frame is (node, its state); a stack is a linked list of frames,
innermost first: (frame, outer stack or None). A container that expects a child value names the
node it expects (`child`) and resumes (`accept`) when the child's frame ends. Alternatives (anyOf,
a declared key or an undeclared one, a number that may end or go on) run side by side as separate
stacks, so a Matcher holds a set of them. Transitions are cached per set of stacks, so a shape's
matcher turns into a lazily built DFA over the bytes its tokens actually try.

Whitespace between tokens is one optional line break and up to MAX_INDENT spaces or tabs
(llama.cpp's JSON grammar's rule), so a model cannot stall in blank lines; none before or after
the top-level value."""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from typing import Any, cast

from .json_regex import Regex

MAX_INDENT = 20  # spaces or tabs in one run of whitespace (after its one optional line break)
OTHER_TOKEN = (-1, b"")  # a whole token no token terminal names
CACHE_LIMIT = 50_000  # cached moves per shape before the cache starts over (~420 B each: ~20 MB a shape)
LINE_BREAKS = frozenset(b"\n\r")
INDENT = frozenset(b" \t")
ESCAPES = frozenset(b'"\\/bfnrtu')
HEX = frozenset(b"0123456789abcdefABCDEF")
DIGITS = frozenset(b"0123456789")
QUOTE, BACKSLASH, COLON, COMMA = (ord(c) for c in '"\\:,')
NO_SPACE = -1  # no whitespace yet in the current run (else 2 * indent + line break)

State = Any  # hashable: stacks are deduplicated by their frames' states
Stack = tuple  # ((node, state), outer stack | None)


def space(run: int, byte: int) -> int | None:
    """The run of whitespace after `byte`, None if the byte is not whitespace or breaks the rule."""
    if byte in LINE_BREAKS:
        return 1 if run == NO_SPACE else None  # the line break comes first, once
    if byte not in INDENT:
        return None
    indent, line_break = (0, 0) if run == NO_SPACE else (run >> 1, run & 1)
    return (indent + 1) << 1 | line_break if indent < MAX_INDENT else None


class Node:
    """One kind of JSON value. Subclasses are immutable once built and compare by identity."""

    __slots__ = ()

    def begin(self) -> State:
        raise NotImplementedError

    def step(self, state: State, byte: int) -> State | None:
        """The state after this frame takes `byte`; None if the byte cannot come here."""
        raise NotImplementedError

    def step_token(self, state: State, token: int, text: bytes) -> State | None:
        """The state after this frame takes a whole token (id, its text): only a grammar's token
        terminal does (atlas.gbnf's <[id]>, <text>); other nodes take text a byte at a time."""
        return None

    def child(self, state: State) -> Node | None:
        """The value this frame waits for here (it may still take whitespace itself)."""
        return None

    def accept(self, state: State, child: Node, child_state: State) -> State:
        """This frame's state once the child it waited for has ended in child_state."""
        raise AssertionError(f"{type(self).__name__} has no children")

    def final(self, state: State) -> bool:
        """The value may end here."""
        raise NotImplementedError

    def open(self, state: State) -> bool:
        """Some byte may still follow inside the value (False only where none can)."""
        return True


class Union(Node):
    """Alternatives: anyOf, a type list, a $ref's target. Never a frame itself: each alternative
    runs as its own stack. `options` may be filled after construction (recursive schemas)."""

    __slots__ = ("options", "_flat")

    def __init__(self, options: Sequence[Node] = ()) -> None:
        self.options = tuple(options)
        self._flat: tuple[Node, ...] | None = None

    def flat(self) -> tuple[Node, ...]:
        """The concrete nodes this union stands for; ValueError if it reaches itself through
        unions alone (a schema that refers to itself without a container in between). Asked only
        once the schema is compiled: a reference being compiled has no options yet."""
        if self._flat is None:
            found: dict[Node, None] = {}
            self._collect(found, set())
            self._flat = tuple(found)
        return self._flat

    def _collect(self, found: dict[Node, None], path: set[int]) -> None:
        if id(self) in path:
            raise ValueError("it refers to itself without an object or array in between")
        path.add(id(self))
        for option in self.options:
            if isinstance(option, Union):
                option._collect(found, path)
            else:
                found[option] = None
        path.discard(id(self))


def alternatives(node: Node) -> tuple[Node, ...]:
    return node.flat() if isinstance(node, Union) else (node,)


class Literal(Node):
    """One of a few exact texts: a const or enum value, true / false / null, a declared key.
    State: (lo, hi, taken): the sorted options lo..hi-1 all start with the `taken` bytes read so
    far. Memory stays the options' own length (a set of every prefix would be quadratic in a long
    const, and each state a copy of the text)."""

    __slots__ = ("options", "sorted")

    def __init__(self, options: Iterable[bytes]) -> None:
        self.options = frozenset(options)
        self.sorted = tuple(sorted(self.options))  # shorter before longer among equal prefixes

    def begin(self) -> State:
        return 0, len(self.sorted), 0

    def step(self, state: tuple[int, int, int], byte: int) -> State | None:
        lo, hi, taken = state
        options = self.sorted
        # options[lo:hi] share `taken` bytes: those that end there come first, then by the next byte
        start = bisect_left(options, byte, lo, hi, key=lambda o: o[taken] if len(o) > taken else -1)
        stop = bisect_right(options, byte, start, hi, key=lambda o: o[taken] if len(o) > taken else -1)
        return (start, stop, taken + 1) if start < stop else None

    def final(self, state: tuple[int, int, int]) -> bool:
        lo, hi, taken = state
        return lo < hi and len(self.sorted[lo]) == taken

    def open(self, state: tuple[int, int, int]) -> bool:
        lo, hi, taken = state
        return lo < hi and len(self.sorted[hi - 1]) > taken

    def text(self, state: tuple[int, int, int]) -> bytes:
        """The option a final state has read."""
        return self.sorted[state[0]]


def utf8_next(lead: int) -> tuple[int, int, int] | None:
    """(continuation bytes due, range of the next one) after a lead byte; None for a byte that
    cannot lead (a stray continuation, an overlong C0 / C1, F5 and above). The first
    continuation's range excludes overlongs (E0, F0), surrogates (ED) and code points past
    U+10FFFF (F4), as Python's decoder does."""
    if lead < 0x80:
        return 0, 0, 0
    if lead < 0xC2 or lead > 0xF4:
        return None
    due = 1 if lead < 0xE0 else 2 if lead < 0xF0 else 3
    low, high = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(lead, (0x80, 0xBF))
    return due, low, high


SIMPLE_ESCAPES = {ord('"'): 0x22, ord("\\"): 0x5C, ord("/"): 0x2F, ord("b"): 0x08, ord("f"): 0x0C, ord("n"): 0x0A,
                  ord("r"): 0x0D, ord("t"): 0x09}
CONTINUATION_BITS = 6


def utf8_span(bits: int, due: int, low: int, high: int) -> tuple[int, int]:
    """The code points a UTF-8 character may still be: `bits` known, `due` continuation bytes to
    come, the next one in [low, high] (the rest 80..BF)."""
    rest = CONTINUATION_BITS * (due - 1)
    return ((bits << 6 | low & 0x3F) << rest), ((bits << 6 | high & 0x3F) << rest) | ((1 << rest) - 1)


def utf8_byte(regex: Regex | None, chars: int, utf8: tuple[int, int, int], bits: int, rx: Any, byte: int) -> tuple | None:
    """One raw byte of a UTF-8 character, stepped through `regex` when given: (characters, the one
    being written included; UTF-8 bytes due, low, high; its code point bits; the regex's states),
    or None. A lead or middle byte is taken only while some character it may become can come."""
    if utf8[0]:
        if not utf8[1] <= byte <= utf8[2]:
            return None
        utf8, bits = (utf8[0] - 1, 0x80, 0xBF), bits << 6 | byte & 0x3F
    else:
        lead = utf8_next(byte)
        if lead is None:
            return None
        chars, utf8, bits = chars + 1, lead, byte & (0x3F >> lead[0]) if lead[0] else byte
    if utf8[0]:
        may = regex is None or regex.may_take(rx, *utf8_span(bits, *utf8), chars - 1)
        return (chars, utf8, bits, rx) if may else None
    if regex is not None:
        rx = regex.step(rx, bits, chars - 1)
        if rx is None:
            return None
    return chars, (0, 0, 0), 0, rx


class String(Node):
    """A string of min_len..max_len characters (code points; an escape is one), matching `regex`
    when given (atlas.json_regex; it then holds the length bounds), other than the `exclude` texts
    (raw bytes between the quotes; compared after decoding).
    State: (phase: 0 before the quote, 1 inside, 2 closed; characters so far, the one being
    written included; escape; UTF-8 bytes due, next byte's low, high; the raw bytes while they
    could still equal an excluded text, else None; the code point bits of the character being
    written; the regex's states, None without one).
    escape: 0 none, 1 after the backslash, 2..5 hex digits of \\u due + 1, 6 three due after a 'd'
    that must not start a surrogate (bounded strings refuse those: a pair is one character)."""

    __slots__ = ("min_len", "max_len", "exclude", "track", "regex", "bounded")

    def __init__(self, min_len: int = 0, max_len: int | None = None, exclude: Iterable[str] = (),
                 regex: Regex | None = None) -> None:
        self.min_len, self.max_len, self.regex = min_len, max_len, regex
        self.exclude = frozenset(exclude)
        self.track = 12 * max((len(e) for e in self.exclude), default=0)  # a surrogate pair: 12 bytes a character
        self.bounded = min_len > 0 or max_len is not None or regex is not None

    def begin(self) -> State:
        return 0, 0, 0, (0, 0, 0), b"" if self.exclude else None, 0, None if self.regex is None else self.regex.start

    def step(self, state: State, byte: int) -> State | None:
        phase, chars, escape, utf8, raw, bits, rx = state
        if phase != 1:
            return (1, *state[1:]) if phase == 0 and byte == QUOTE else None
        raw = self._raw(raw, byte)
        if utf8[0]:
            return self._moved(utf8_byte(self.regex, chars, utf8, bits, rx, byte), raw)
        if escape:
            return self._escape(state, byte, raw)
        if byte == QUOTE:
            return self._close(chars, state[4], rx)
        if self.max_len is not None and chars >= self.max_len:
            return None
        if byte == BACKSLASH:
            return self._if_may(rx, 0, 0xFFFF, chars, (1, chars + 1, 1, utf8, raw, 0, rx))
        if byte < 0x20:
            return None
        return self._moved(utf8_byte(self.regex, chars, utf8, bits, rx, byte), raw)

    @staticmethod
    def _moved(moved: tuple | None, raw: bytes | None) -> State | None:
        """utf8_byte's result inside the string's state."""
        return None if moved is None else (1, moved[0], 0, moved[1], raw, moved[2], moved[3])

    def _escape(self, state: State, byte: int, raw: bytes | None) -> State | None:
        _, chars, escape, utf8, _, bits, rx = state
        if escape == 1:
            if byte == ord("u"):
                return 1, chars, 5, utf8, raw, 0, rx
            return self._char_done(chars, raw, SIMPLE_ESCAPES[byte], rx) if byte in SIMPLE_ESCAPES else None
        if escape == 6:  # after \ud in a bounded string: no surrogate
            if byte not in b"01234567":
                return None
            escape = 3
        elif byte not in HEX:
            return None
        elif escape == 5 and self.bounded and byte in b"dD":
            escape = 6
        else:
            escape -= 1
        bits = bits << 4 | int(chr(byte), 16)
        if escape == 1:  # the four digits are in
            return self._char_done(chars, raw, bits, rx)
        due = escape - 1 if escape != 6 else 3
        low, high = bits << 4 * due, (bits << 4 * due) | ((1 << 4 * due) - 1)
        return self._if_may(rx, low, min(high, 0xD7FF) if escape == 6 else high, chars - 1,
                            (1, chars, escape, utf8, raw, bits, rx))

    def _if_may(self, rx: Any, low: int, high: int, before: int, state: State) -> State | None:
        """state, if the regex may take a character in [low, high] after `before` characters."""
        return state if rx is None or self.regex.may_take(rx, low, high, before) else None  # type: ignore[union-attr]

    def _char_done(self, chars: int, raw: bytes | None, char: int, rx: Any) -> State | None:
        if rx is not None:
            rx = self.regex.step(rx, char, chars - 1)  # type: ignore[union-attr]
            if rx is None:
                return None
        return 1, chars, 0, (0, 0, 0), raw, 0, rx

    def _raw(self, raw: bytes | None, byte: int) -> bytes | None:
        return None if raw is None or len(raw) >= self.track else raw + bytes((byte,))

    def _close(self, chars: int, raw: bytes | None, rx: Any) -> State | None:
        whole = self.regex.ends(rx, chars) if self.regex is not None else chars >= self.min_len
        if not whole or (raw is not None and self._excluded(raw)):
            return None
        return 2, chars, 0, (0, 0, 0), None, 0, None

    def _excluded(self, raw: bytes) -> bool:
        try:
            return json.loads(b'"' + raw + b'"') in self.exclude
        except ValueError:  # a lone surrogate escape: no excluded text
            return False

    def final(self, state: State) -> bool:
        return state[0] == 2

    def open(self, state: State) -> bool:
        return state[0] != 2


def number_step(phase: str, byte: int, integer: bool) -> str | None:
    digit = byte in DIGITS
    dot = byte == 0x2E and not integer
    exp = byte in b"eE" and not integer
    table = {
        "start": "minus" if byte == 0x2D else "zero" if byte == 0x30 else "int" if digit else None,
        "minus": "zero" if byte == 0x30 else "int" if digit else None,
        "zero": "dot" if dot else "exp" if exp else None,
        "int": "int" if digit else "dot" if dot else "exp" if exp else None,
        "dot": "frac" if digit else None,
        "frac": "frac" if digit else "exp" if exp else None,
        "exp": "exp_digits" if digit else "exp_sign" if byte in b"+-" else None,
        "exp_sign": "exp_digits" if digit else None,
        "exp_digits": "exp_digits" if digit else None,
    }
    return table[phase]


NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp_digits"})


def reachable(digits: int, exact: bool, low: int | None, high: int | None, multiple: int = 1) -> bool:
    """Some non-negative multiple of `multiple` whose decimal starts with `digits`' (is exactly it
    when `exact`: a leading zero) lies in [low, high] (None: unbounded)."""
    low = 0 if low is None else max(low, 0)
    if exact:
        return low <= digits and (high is None or digits <= high) and digits % multiple == 0
    if high is None and multiple == 1:
        return True  # digits * 10^k outgrows any low bound
    scale = 1
    while high is None or digits * scale <= high:  # with k more digits: [digits * 10^k, digits * 10^k + 10^k - 1]
        first = max(digits * scale, low)
        last = digits * scale + scale - 1 if high is None else min(digits * scale + scale - 1, high)
        if -(-first // multiple) * multiple <= last:  # the first multiple from `first` on
            return True
        scale *= 10  # unbounded: ends once 10^k >= multiple past low (a multiple in every such span)
    return False


class Text(Node):
    """Raw text (no quotes or escapes: the whole output) that `regex` matches (vLLM's regex).
    State: (characters so far, the one being written included; UTF-8 bytes due, low, high; its
    code point bits; the regex's states)."""

    __slots__ = ("regex",)

    def __init__(self, regex: Regex) -> None:
        self.regex = regex

    def begin(self) -> State:
        return 0, (0, 0, 0), 0, self.regex.start

    def step(self, state: State, byte: int) -> State | None:
        nxt = utf8_byte(self.regex, *state, byte)
        if nxt is not None and self.regex.max_len is None and nxt[0] > self.regex.min_len + 1:
            # past min_len an unbounded regex no longer tells counts apart: one state per place
            # in the regex, so the shape's transitions cache (a DFA) repeats instead of growing
            nxt = (self.regex.min_len + 1, *nxt[1:])
        return nxt

    def final(self, state: State) -> bool:
        return not state[1][0] and self.regex.ends(state[3], state[0])

    def open(self, state: State) -> bool:
        return state[1][0] > 0 or any(self.regex.edges[s] for s in state[3])


class Number(Node):
    """A JSON number, or an integer (no fraction or exponent) within [low, high] (None: open), a
    multiple of `multiple`. State: (phase, negative, the digits' value; 0 when unconstrained)."""

    __slots__ = ("integer", "low", "high", "multiple")

    def __init__(self, integer: bool = False, low: int | None = None, high: int | None = None,
                 multiple: int = 1) -> None:
        self.integer, self.low, self.high, self.multiple = integer, low, high, multiple

    def begin(self) -> State:
        return "start", False, 0

    @property
    def constrained(self) -> bool:
        """Its digits' value matters (bounds or a step), so the state carries it."""
        return self.low is not None or self.high is not None or self.multiple != 1

    def step(self, state: State, byte: int) -> State | None:
        phase, negative, value = state
        nxt = number_step(phase, byte, self.integer)
        if nxt is None:
            return None
        if nxt == "minus":
            return (nxt, True, 0) if self._viable(True, None) else None
        if self.constrained and nxt in ("zero", "int"):
            value = value * 10 + byte - 0x30
            if not self._viable(negative, value, exact=nxt == "zero"):
                return None
        return nxt, negative, value

    def _viable(self, negative: bool, value: int | None, exact: bool = False) -> bool:
        """Some completion of the digits so far (value None: none yet) is within the bounds."""
        low, high = (self.low, self.high) if not negative else (
            None if self.high is None else -self.high, None if self.low is None else -self.low)
        if value is None:  # after '-': any integer >= 1 (or 0 as "-0")
            return high is None or high >= max(low or 0, 0)
        return reachable(value, exact, low, high, self.multiple)

    def final(self, state: State) -> bool:
        phase, negative, value = state
        if phase not in NUMBER_ENDS:
            return False
        signed = -value if negative else value
        inside = (self.low is None or signed >= self.low) and (self.high is None or signed <= self.high)
        return inside and value % self.multiple == 0

    def open(self, state: State) -> bool:
        return not self.integer or any(self.step(state, byte) is not None for byte in b"-0123456789")


class Container(Node):
    """An object or array: its opening bracket, whitespace between its tokens (space()), and
    its close; subclasses step the structural bytes in between. State: (phase, a count, the
    whitespace run)."""

    OPEN, FIRST = 0, 1
    CLOSED: int
    OPENER: int
    __slots__ = ()

    def begin(self) -> State:
        return self.OPEN, 0, NO_SPACE

    def step(self, state: State, byte: int) -> State | None:
        phase, count, run = state
        if phase in (self.OPEN, self.CLOSED):
            return (self.FIRST, 0, NO_SPACE) if phase == self.OPEN and byte == self.OPENER else None
        run = space(run, byte)
        return (phase, count, run) if run is not None else self.structural(phase, count, byte)

    def structural(self, phase: int, count: int, byte: int) -> State | None:
        raise NotImplementedError

    def final(self, state: State) -> bool:
        return state[0] == self.CLOSED

    def open(self, state: State) -> bool:
        return state[0] != self.CLOSED


class Object(Container):
    """An object whose declared properties come in their declared order (each optional one may be
    left out), then, where `extra` is set, any other keys with values of that shape.
    State: (phase, at, whitespace run). at: declared properties passed (KEY phases), or the
    property being written (COLON, VALUE; len(keys) for an undeclared key)."""

    OPEN, FIRST, KEY, COLON, VALUE, NEXT, CLOSED = range(7)
    OPENER = ord("{")
    __slots__ = ("keys", "values", "required", "extra", "key_index", "key_nodes", "can_close", "extra_key")

    def __init__(self, properties: Sequence[tuple[str, Node, bool]], extra: Node | None) -> None:
        self.keys = tuple(json.dumps(name, ensure_ascii=False).encode() for name, _, _ in properties)
        self.values = tuple(node for _, node, _ in properties)
        self.extra = extra
        self.key_index = {key: i for i, key in enumerate(self.keys)}
        required = [req for _, _, req in properties]
        self.required = tuple(required)
        n = len(properties)
        self.can_close = tuple(not any(required[at:]) for at in range(n + 1))
        self.extra_key = String(exclude=[name for name, _, _ in properties]) if extra is not None else None
        self.key_nodes = tuple(self._keys_from(at, required) for at in range(n + 1))

    def _keys_from(self, at: int, required: list[bool]) -> Node | None:
        """The key that may come after `at` declared properties: the next declared one, or a later
        one past optional ones; an undeclared key once no declared one is required."""
        declared = []
        for i in range(at, len(self.keys)):
            declared.append(self.keys[i])
            if required[i]:
                break
        options: list[Node] = [Literal(declared)] if declared else []
        if self.extra_key is not None and self.can_close[at]:
            options.append(self.extra_key)
        return None if not options else options[0] if len(options) == 1 else Union(options)

    def structural(self, phase: int, at: int, byte: int) -> State | None:
        if byte == ord("}") and (phase == self.NEXT or phase == self.FIRST) and self.can_close[at]:
            return self.CLOSED, at, NO_SPACE
        if phase == self.COLON and byte == COLON:
            return self.VALUE, at, NO_SPACE
        if phase == self.NEXT and byte == COMMA and self.key_nodes[at] is not None:
            return self.KEY, at, NO_SPACE
        return None

    def child(self, state: State) -> Node | None:
        phase, at, _ = state
        if phase in (self.FIRST, self.KEY):
            return self.key_nodes[at]
        if phase == self.VALUE:
            return self.values[at] if at < len(self.values) else self.extra
        return None

    def accept(self, state: State, child: Node, child_state: State) -> State:
        phase, at, _ = state
        if phase == self.VALUE:
            return self.NEXT, min(at + 1, len(self.keys)), NO_SPACE
        written = len(self.keys) if child is self.extra_key else self.key_index[cast(Literal, child).text(child_state)]
        return self.COLON, written, NO_SPACE


class Array(Container):
    """An array: prefix items in order, then `items` (None: no more), min_items..max_items long.
    State: (phase, items written, whitespace run)."""

    OPEN, FIRST, VALUE, NEXT, CLOSED = range(5)
    OPENER = ord("[")
    __slots__ = ("prefix", "items", "min_items", "max_items")

    def __init__(self, prefix: Sequence[Node], items: Node | None, min_items: int = 0, max_items: int | None = None) -> None:
        self.prefix, self.items = tuple(prefix), items
        self.min_items = min_items
        limit = None if items is not None else len(self.prefix)
        self.max_items = limit if max_items is None else max_items if limit is None else min(max_items, limit)

    def item(self, count: int) -> Node | None:
        if self.max_items is not None and count >= self.max_items:
            return None
        return self.prefix[count] if count < len(self.prefix) else self.items

    def structural(self, phase: int, count: int, byte: int) -> State | None:
        if byte == ord("]") and phase in (self.FIRST, self.NEXT) and count >= self.min_items:
            return self.CLOSED, count, NO_SPACE
        if phase == self.NEXT and byte == COMMA and self.item(count) is not None:
            return self.VALUE, count, NO_SPACE
        return None

    def child(self, state: State) -> Node | None:
        phase, count, _ = state
        return self.item(count) if phase in (self.FIRST, self.VALUE) else None

    def accept(self, state: State, child: Node, child_state: State) -> State:
        return self.NEXT, state[1] + 1, NO_SPACE


class AfterMarker(Node):
    """Free text up to the first `marker` (a reasoning block's end, "</think>"), up to MAX_GAP line
    breaks, then `value`: structured output that starts once a thinking model has thought.
    State: (phase, count): phase 0 in the free text, count the marker's bytes just seen; 1 in the
    gap, count its line breaks; 2 the value written."""

    MAX_GAP = 4
    __slots__ = ("marker", "value")

    def __init__(self, marker: bytes, value: Node) -> None:
        self.marker, self.value = marker, value

    def begin(self) -> State:
        return 0, 0

    def step(self, state: State, byte: int) -> State | None:
        phase, count = state
        if phase == 0:
            seen = self.marker[:count] + bytes((byte,))
            count = next(j for j in range(len(seen), -1, -1) if seen.endswith(self.marker[:j]))  # longest marker prefix seen last
            return (1, 0) if count == len(self.marker) else (0, count)
        return (1, count + 1) if phase == 1 and byte == 0x0A and count < self.MAX_GAP else None

    def child(self, state: State) -> Node | None:
        return self.value if state[0] == 1 else None

    def accept(self, state: State, child: Node, child_state: State) -> State:
        return 2, 0

    def final(self, state: State) -> bool:
        return state[0] == 2

    def open(self, state: State) -> bool:
        return state[0] != 2


def any_value() -> Union:
    """Any JSON value (objects with any keys, arrays of any values)."""
    value = Union()
    value.options = (Object((), value), Array((), value), String(), Number(), Literal((b"true", b"false", b"null")))
    return value


ANY_VALUE = any_value()
ANY_OBJECT = Object((), ANY_VALUE)


class Transitions:
    """The shape's cached moves: set of stacks x byte -> set of stacks, and each set's ending.
    A move may also take a whole token, (id, text) in place of the byte, where the shape has token
    terminals (`tokens`: (the id or text each names, negated)); a token none of them names moves as
    OTHER_TOKEN, since a terminal only tells the tokens it names from the rest (one cached move
    per set of stacks instead of one per token of the vocabulary)."""

    def __init__(self, root: Node, tokens: frozenset[tuple[int | bytes, bool]] = frozenset()) -> None:
        self.tokens = tokens
        self.names = frozenset(name for name, _ in tokens)
        self.start = frozenset(((node, node.begin()), None) for node in alternatives(root))
        self.moves: dict[tuple[frozenset, int], frozenset] = {}
        self.ends: dict[frozenset, tuple[bool, bool]] = {}
        self.closures: dict[Stack, tuple[tuple[Stack, ...], bool]] = {}
        # One object per distinct set of stacks: two paths to the same set (a regex position
        # reached by 'a' or by 'b') then share it, so the cache's key comparisons stop at
        # identity instead of walking both sets (a regex's state set may hold a thousand states).
        self.canonical: dict[frozenset, frozenset] = {}

    @property
    def uses_tokens(self) -> bool:
        return bool(self.tokens)

    def symbol(self, token: int, text: bytes) -> tuple[int, bytes]:
        """A whole token as moves take it."""
        return (token, text) if token in self.names or text in self.names else OTHER_TOKEN

    def move(self, stacks: frozenset, byte: int | tuple[int, bytes]) -> frozenset:
        key = (stacks, byte)
        found = self.moves.get(key)
        if found is None:
            if len(self.moves) > CACHE_LIMIT:
                self.moves.clear()
                self.closures.clear()
                self.ends.clear()
                self.canonical.clear()
            found = frozenset(self._step(stacks, byte))
            found = self.canonical.setdefault(found, found)
            self.moves[key] = found
        return found

    def _step(self, stacks: frozenset, byte: int | tuple[int, bytes]) -> Iterable[Stack]:
        for stack in stacks:
            for (node, state), outer in self.closure(stack)[0]:
                nxt = node.step_token(state, *byte) if isinstance(byte, tuple) else node.step(state, byte)
                if nxt is not None:
                    yield (node, nxt), outer

    def ending(self, stacks: frozenset) -> tuple[bool, bool]:
        """(the value may end here, it must: nothing else can follow)."""
        found = self.ends.get(stacks)
        if found is None:
            closures = [self.closure(stack) for stack in stacks]
            may = any(ends for _, ends in closures)
            found = may, may and not any(movable for movable, _ in closures)
            self.ends[stacks] = found
        return found

    def closure(self, stack: Stack) -> tuple[tuple[Stack, ...], bool]:
        """The stacks reachable from `stack` without taking a byte (pushing the children frames
        wait for, popping frames that may end) whose innermost frame may take one; and whether
        the whole value may end here."""
        found = self.closures.get(stack)
        if found is not None:
            return found
        movable: list[Stack] = []
        ends, todo, seen = False, [stack], set()
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            (node, state), outer = current
            if node.open(state):
                movable.append(current)
            kid = node.child(state)
            if kid is not None:
                todo.extend(((alt, alt.begin()), current) for alt in alternatives(kid))
            if node.final(state):
                if outer is None:
                    ends = True
                else:
                    (parent, parent_state), rest = outer
                    todo.append(((parent, parent.accept(parent_state, node, state)), rest))
        found = tuple(movable), ends
        self.closures[stack] = found
        return found


class Matcher:
    """Where a byte stream stands in a text of one shape; feed() says whether it still begins one.
    Copies share the shape's transition cache."""

    def __init__(self, root: Node | Transitions) -> None:
        self.transitions = root if isinstance(root, Transitions) else Transitions(root)
        self.stacks = self.transitions.start

    def copy(self) -> Matcher:
        twin = Matcher(self.transitions)
        twin.stacks = self.stacks
        return twin

    def feed(self, data: bytes) -> bool:
        """Take `data`; False (the state unchanged) if it cannot continue the text."""
        stacks = self.stacks
        for byte in data:
            stacks = self.transitions.move(stacks, byte)
            if not stacks:
                return False
        self.stacks = stacks
        return True

    def take(self, token: int, data: bytes | None, text: bytes) -> bool:
        """Take a token: its bytes `data` (None: a special token, never text) and, where the
        shape has token terminals, the token whole (id, text) too, both ways kept; False (the
        state unchanged) if neither continues the text."""
        as_text = self.copy()
        fits_text = bool(data) and as_text.feed(data)  # type: ignore[arg-type]
        shape = self.transitions
        whole = shape.move(self.stacks, shape.symbol(token, text)) if shape.uses_tokens else frozenset()
        if not (fits_text or whole):
            return False
        if fits_text and whole:
            both = as_text.stacks | whole
            self.stacks = shape.canonical.setdefault(both, both)
        else:
            self.stacks = as_text.stacks if fits_text else whole
        return True

    @property
    def can_end(self) -> bool:
        return self.transitions.ending(self.stacks)[0]

    @property
    def complete(self) -> bool:
        """The text is whole and nothing may follow it."""
        return self.transitions.ending(self.stacks)[1]
