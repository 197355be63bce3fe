"""Regular expressions of JSON schema's `pattern` (and of the string formats generation follows),
compiled into an NFA over Unicode code points that atlas.json_match's String steps one character
at a time, with the string's minLength / maxLength folded in: each state knows the lengths of the
paths from it to the end, so a prefix is taken only while some way to finish it remains.

The subset of ECMA-262 taken: literals and escapes (\\d \\D \\w \\W \\s \\S, \\t \\n \\r \\f \\v,
\\xHH, \\uHHHH, escaped metacharacters), classes ([a-z_], [^...]), '.', groups ((...), (?:...),
(?<name>...) and Python's (?P<name>...)), alternation, the quantifiers * + ? {n} {n,} {n,m} (lazy forms too: the language is
the same), '^' / '$' at the start / end of a top-level alternative, the inline flags i (ignore
case) and s ('.' takes line ends too) opening the pattern ((?i), Python's) or scoping a group
((?i:...), (?-i:...), ECMA-262 2025's modifiers and Python's). A side not anchored matches
anything (a pattern matches anywhere in the string, as JSON schema says). Refused (RegexError):
backreferences, lookaround, \\b / \\B, anchors elsewhere, other inline flags, more than
MAX_STATES states.

Ignoring case, as \\d \\w \\s (see shorthand), keeps to what every reading admits: a character
takes its other case only where the two map to each other (k and K, not the Kelvin sign, which
Python and ECMA-262's Unicode mode match to k and its legacy mode does not); a negated class
leaves out every character any reading folds onto one of its members (case_variants)."""

from __future__ import annotations

import re
import _sre  # the simple lower-case mapping Python's re folds with (str.lower() is the full one)
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from functools import cache

MAX_CP = 0x10FFFF
MAX_STATES = 4000
LENGTH_FOLD_LIMIT = 1 << 16  # characters: length bounds the NFA's per-state path bitsets track (cost ~ bound^2)
Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code point ranges

DIGIT: Ranges = ((0x30, 0x39),)
WORD: Ranges = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE: Ranges = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
                 (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))  # ECMA-262's \s
LINE_ENDS: Ranges = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
CONTROL_ESCAPES = {"t": 0x09, "n": 0x0A, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}
META = set("^$\\.*+?()[]{}|/-")
INLINE_FLAGS = re.compile(r"\?([a-zA-Z]*)(?:-([a-zA-Z]+))?([:)])")  # after "(": (?i) (?is:...) (?-i:...) (?:...)
SUPPORTED_FLAGS = frozenset("is")


class RegexError(ValueError):
    pass


def normalize(ranges: list[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CP:
        out.append((start, MAX_CP))
    return tuple(out)


def meets(ranges: Ranges, lo: int, hi: int) -> bool:
    """Some code point of [lo, hi] is in ranges."""
    at = bisect_right(ranges, (hi, MAX_CP + 1)) - 1  # the last range starting at or before hi
    return at >= 0 and ranges[at][1] >= lo


ANY: Ranges = ((0, MAX_CP),)
DOT: Ranges = complement(LINE_ENDS)


# AST: ("chars", Ranges) | ("cat", [nodes]) | ("alt", [nodes]) | ("rep", node, min, max | None)
class Parser:
    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0
        self.ignore_case = self.dot_all = False  # the inline flags i and s in force at the cursor

    def fail(self, problem: str) -> RegexError:
        return RegexError(f"pattern {self.text!r} at {self.i}: {problem}")

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def take(self) -> str:
        char = self.peek()
        if not char:
            raise self.fail("ends too early")
        self.i += 1
        return char

    def top(self, search: bool = True) -> tuple:
        """The whole pattern; with `search`, unanchored sides of each top-level alternative match
        anything (JSON schema's pattern), else the pattern matches the whole text (vLLM's regex)."""
        while self.text.startswith("(?", self.i) and (flags := INLINE_FLAGS.match(self.text, self.i + 1)) and \
                flags.group(3) == ")" and not flags.group(2):
            self.flag_group(flags)  # (?i): the whole pattern
            self.i = flags.end()
        branches = []
        while True:
            start = self.peek() == "^"
            self.i += start
            parts = self.sequence(top=True)
            end = self.peek() == "$"
            self.i += end
            loose = ("rep", ("chars", ANY), 0, None)
            head, tail = [] if start or not search else [loose], [] if end or not search else [loose]
            branches.append(("cat", head + parts + tail))
            if self.peek() != "|":
                break
            self.i += 1
        if self.i != len(self.text):
            raise self.fail(f"unexpected {self.peek()!r}")
        return ("alt", branches)

    def sequence(self, top: bool = False) -> list:
        parts = []
        while self.peek() and self.peek() not in "|)" and not (top and self.peek() == "$" and self.text[self.i + 1 : self.i + 2] in ("", "|")):
            parts.append(self.quantified(self.atom()))
        return parts

    def alternation(self) -> tuple:
        branches = [("cat", self.sequence())]
        while self.peek() == "|":
            self.i += 1
            branches.append(("cat", self.sequence()))
        return ("alt", branches)

    def atom(self) -> tuple:
        char = self.take()
        if char == "(":
            return self.group()
        if char == "[":
            return ("chars", self.char_class())
        if char == ".":
            return ("chars", ANY if self.dot_all else DOT)
        if char == "\\":
            return ("chars", self.cased(self.escape(in_class=False)))
        if char in "^$":
            raise self.fail("anchors are supported only at the start and end of the pattern")
        if char in "*+?)":
            raise self.fail(f"{char!r} has nothing to repeat")
        return ("chars", self.cased(((ord(char), ord(char)),)))

    def cased(self, ranges: Ranges) -> Ranges:
        return fold_case(ranges, wide=False) if self.ignore_case else ranges

    def flag_group(self, flags: re.Match[str]) -> None:
        """(?on-off:...) at the cursor (past its "("): Python's and ECMA-262's syntax checks."""
        on, off = flags.group(1), flags.group(2) or ""
        if not on and not off and flags.group(3) == ")":
            raise self.fail("(?) sets no flag")
        if set(on) & set(off):
            raise self.fail("an inline flag cannot be turned both on and off")
        self.set_flags(on, True)
        self.set_flags(off, False)

    def set_flags(self, letters: str, on: bool) -> None:
        for letter in letters:
            if letter not in SUPPORTED_FLAGS:
                raise self.fail(f"the inline flag {letter!r} is not supported (i and s are)")
            if letter == "i":
                self.ignore_case = on
            else:
                self.dot_all = on

    def group(self) -> tuple:
        outer = self.ignore_case, self.dot_all
        if flags := INLINE_FLAGS.match(self.text, self.i):  # (?:...) and (?flags-flags:...)
            if flags.group(3) == ")" and (flags.group(1) or flags.group(2)):
                raise self.fail("inline flags such as (?i) must open the pattern; scope them with (?i:...)")
            self.flag_group(flags)
            self.i = flags.end()
        elif self.text.startswith(("?<", "?P<"), self.i) and self.text[self.i + 2 : self.i + 3] not in ("=", "!"):
            close = self.text.find(">", self.i)
            if close < 0:
                raise self.fail("unterminated group name")
            self.i = close + 1
        elif self.text.startswith(("?=", "?!", "?<=", "?<!"), self.i):
            raise self.fail("lookaround is not supported")
        elif self.peek() == "?":
            raise self.fail("this (?...) group is not supported (groups: (...), (?:...), (?<name>...), (?i:...))")
        node = self.alternation()
        if self.peek() != ")":
            raise self.fail("unbalanced parenthesis")
        self.i += 1
        self.ignore_case, self.dot_all = outer
        return node

    def quantified(self, node: tuple) -> tuple:
        char = self.peek()
        if char in ("*", "+", "?"):
            self.i += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        elif char == "{" and (bounds := self.braces()) is not None:
            low, high = bounds
        else:
            return node
        if self.peek() == "?":  # lazy: the same language
            self.i += 1
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self.braces(look=True) is not None):
            raise self.fail("a quantifier cannot follow a quantifier")
        return ("rep", node, low, high)

    def braces(self, look: bool = False) -> tuple[int, int | None] | None:
        """{n}, {n,} or {n,m} at the cursor (consumed unless look), else None (a literal '{')."""
        close = self.text.find("}", self.i)
        body = self.text[self.i + 1 : close] if close > 0 else ""
        low, comma, high = body.partition(",")
        if not (low.isascii() and low.isdigit()) or (high and not (high.isascii() and high.isdigit())):
            return None
        if max(len(low.lstrip("0")), len(high.lstrip("0"))) > len(str(MAX_STATES)):  # int() of 4300+ digits raises
            raise self.fail(f"a repetition bound past {MAX_STATES}, which no pattern here can hold")
        if not look:
            self.i = close + 1
        bounds = int(low), (int(high) if high else None if comma else int(low))
        if bounds[1] is not None and bounds[1] < bounds[0]:
            raise self.fail("{n,m} with m < n")
        return bounds

    def char_class(self) -> Ranges:
        negate = self.peek() == "^"
        self.i += negate
        ranges: list[tuple[int, int]] = []
        while self.peek() != "]":
            if not self.peek():
                raise self.fail("unterminated character class")
            lo_set = self.class_atom(negate)
            if self.peek() == "-" and self.text[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                hi_set = self.class_atom(negate)
                if len(lo_set) != 1 or len(hi_set) != 1 or lo_set[0][0] != lo_set[0][1] or hi_set[0][0] != hi_set[0][1]:
                    raise self.fail("a class range needs single characters at both ends")
                if hi_set[0][0] < lo_set[0][0]:
                    raise self.fail("a class range out of order")
                ranges.append((lo_set[0][0], hi_set[0][0]))
            else:
                ranges.extend(lo_set)
        self.i += 1
        out = normalize(ranges)
        if self.ignore_case:  # a negated class leaves out whatever any reading folds onto a member
            out = fold_case(out, wide=negate)
        return complement(out) if negate else out

    def class_atom(self, wide: bool) -> Ranges:
        char = self.take()
        if char == "\\":
            return self.escape(in_class=True, wide=wide)
        return ((ord(char), ord(char)),)

    def escape(self, in_class: bool, wide: bool = False) -> Ranges:
        """An escape's characters; wide: inside a negated class, whose complement must still be
        within every reading (see shorthand)."""
        char = self.take()
        if char.lower() in "dws":
            return shorthand(char.lower(), wide) if char.islower() else complement(shorthand(char.lower(), not wide))
        if char in CONTROL_ESCAPES:
            return ((CONTROL_ESCAPES[char],) * 2,)
        if char in "xu":
            digits = 2 if char == "x" else 4
            text = self.text[self.i : self.i + digits]
            if len(text) != digits or any(c not in "0123456789abcdefABCDEF" for c in text):
                raise self.fail(f"\\{char} needs {digits} hex digits")
            self.i += digits
            return ((int(text, 16),) * 2,)
        if char == "b" and in_class:
            return ((0x08, 0x08),)
        if char in "bB":
            raise self.fail("word boundaries are not supported")
        if char.isdigit():
            raise self.fail("backreferences are not supported")
        if char in META or not char.isalnum():
            return ((ord(char), ord(char)),)
        raise self.fail(f"unknown escape \\{char}")


def shorthand(letter: str, wide: bool) -> Ranges:
    """\\d, \\w or \\s. ECMA-262 reads them as ASCII digits / word characters and its own
    spaces, Python's re and Rust's regex (jsonschema, pydantic) as Unicode classes. Generation
    keeps to what every reading admits: the narrow set (both readings' intersection) where the
    class is taken as it is, the wide set (their union) where it is complemented (\\D, [^\\d])."""
    if not wide:
        python_spaces = [(c, c) for low, high in SPACE for c in range(low, high + 1) if chr(c).isspace()]
        return {"d": DIGIT, "w": WORD, "s": normalize(python_spaces)}[letter]
    return normalize(list({"d": DIGIT, "w": WORD, "s": SPACE}[letter]) + list(unicode_class(letter)))


def fold_case(ranges: Ranges, wide: bool) -> Ranges:
    """ranges with the other cases of their characters (case_variants): the narrow variants,
    or with `wide` every character some reading folds together with one of them."""
    cased, narrow, wide_variants = case_variants()
    extra: list[tuple[int, int]] = []
    for lo, hi in ranges:
        for cp in cased[bisect_left(cased, lo) : bisect_right(cased, hi)]:
            extra.extend((v, v) for v in (wide_variants if wide else narrow)[cp])
    return normalize([*ranges, *extra]) if extra else ranges


@cache
def case_variants() -> tuple[list[int], dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
    """The code points with case, and for each its narrow variants (the single characters of its
    lower and upper case that map back: k <-> K, not the Kelvin sign, whose upper case is itself)
    and its wide ones (every code point tied to it through lower(), upper() or casefold(): what
    Python's re and ECMA-262 in either mode may match it with)."""
    parent: dict[tuple[str, object], tuple[str, object]] = {}

    def root(key: tuple[str, object]) -> tuple[str, object]:
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for cp in range(MAX_CP + 1):
        char = chr(cp)
        forms = {char, char.lower(), char.upper(), char.casefold(), chr(_sre.unicode_tolower(cp))}  # İ -> i: re's
        for form in forms if len(forms) > 1 else ():
            parent[root(("text", form))] = root(("cp", cp))
    for key in list(parent):
        if key[0] == "text" and len(key[1]) == 1:  # type: ignore[arg-type]
            parent[root(("cp", ord(key[1])))] = root(key)  # type: ignore[arg-type]
    members: dict[tuple[str, object], list[int]] = {}
    for key in list(parent):
        if key[0] == "cp":
            members.setdefault(root(key), []).append(key[1])  # type: ignore[arg-type]
    wide = {cp: tuple(sorted(group)) for group in members.values() if len(group) > 1 for cp in group}
    narrow = {cp: tuple(ord(x) for x in {chr(cp).lower(), chr(cp).upper()} if round_trip(chr(cp), x)) for cp in wide}
    return sorted(wide), narrow, wide


def round_trip(char: str, other: str) -> bool:
    """other is char's other case in every reading: one character each way, both in the Basic
    Multilingual Plane (ECMA-262 without the u flag folds UTF-16 units, which above it have no
    case), the same upper case and lower case (not the Kelvin sign for k), and an upper case of
    one character (ECMA-262 without u keeps a letter whose upper case is longer, e.g. U+1F88)."""
    return (len(other) == 1 and other != char and max(ord(char), ord(other)) <= 0xFFFF
            and other.lower() == char.lower() and other.upper() == char.upper() and len(char.upper()) == 1)


@cache
def unicode_class(letter: str) -> Ranges:
    """Every code point Python's str methods count as a digit, word character or space."""
    test = {"d": lambda c: c.isdigit() or c.isdecimal() or c.isnumeric(), "w": lambda c: c.isalnum() or c == "_",
            "s": str.isspace}[letter]
    ranges: list[tuple[int, int]] = []
    for cp in range(MAX_CP + 1):
        if test(chr(cp)):
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1] = (ranges[-1][0], cp)
            else:
                ranges.append((cp, cp))
    return tuple(ranges)


@dataclass
class Regex:
    """The NFA: char edges (ranges, target) and epsilon edges per state; `reach[s]`: a bitset of
    the lengths (in characters) of the paths from s to the end, lengths >= `cap` in bit `cap`."""

    edges: list[list[tuple[Ranges, int]]]
    eps: list[list[int]]
    accept: int
    start: frozenset[int]
    reach: list[int]
    cap: int
    min_len: int
    max_len: int | None

    def closure(self, states: set[int]) -> frozenset[int]:
        todo, seen = list(states), set(states)
        while todo:
            for nxt in self.eps[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return frozenset(seen)

    def fits(self, state: int, chars: int) -> bool:
        """Some path from state ends the string within its length bounds (chars: written so far)."""
        low = max(self.min_len - chars, 0)
        high = self.cap if self.max_len is None else min(self.max_len - chars, self.cap)
        if high < low:
            return False
        return bool(self.reach[state] >> low & ((1 << (high - low + 1)) - 1))

    def may_take(self, states: frozenset[int], low: int, high: int, chars: int) -> bool:
        """Some character in [low, high] may come next (chars: written before it)."""
        return any(meets(ranges, low, high) and self.fits(nxt, chars + 1)
                   for s in states for ranges, nxt in self.edges[s])

    def step(self, states: frozenset[int], char: int, chars: int) -> frozenset[int] | None:
        """The states after `char`, the (chars + 1)-th character; None if it cannot come."""
        nxt = {t for s in states for ranges, t in self.edges[s] if meets(ranges, char, char)}
        return self.settle(nxt, chars + 1) or None

    def settle(self, states: set[int], chars: int) -> frozenset[int]:
        """The epsilon closure of states, kept to those that matter from here: states with a
        character edge, and the accepting one, from which the string may still end within its
        length bounds (epsilon-only states, often half a Thompson NFA, would only make every set
        larger to hash and compare; a fitting state always leaves a fitting one that matters)."""
        return frozenset(s for s in self.closure(states) if (self.edges[s] or s == self.accept) and self.fits(s, chars))

    def ends(self, states: frozenset[int], chars: int) -> bool:
        return self.accept in states and chars >= self.min_len and (self.max_len is None or chars <= self.max_len)


def compile_regex(pattern: str, min_len: int = 0, max_len: int | None = None, search: bool = True) -> Regex:
    """RegexError: a pattern outside the subset, or one no string of the lengths matches.
    search: the pattern may match anywhere (JSON schema's reading), else the whole text."""
    return compile_tree(Parser(pattern).top(search), f"pattern {pattern!r}", min_len, max_len)


@dataclass(frozen=True)
class Nfa:
    """Char edges (ranges, target) and epsilon edges per state, before the lengths are folded in."""

    edges: list[list[tuple[Ranges, int]]]
    eps: list[list[int]]
    start: int
    accept: int


def compile_tree(tree: tuple, label: str, min_len: int = 0, max_len: int | None = None) -> Regex:
    """The NFA of a parsed pattern (the Parser's AST; atlas.gbnf builds them too); `label` names
    it in errors."""
    return finish(build_nfa(tree, label), label, min_len, max_len)


def compile_patterns(patterns: list[str], min_len: int = 0, max_len: int | None = None) -> Regex:
    """Strings every pattern matches (each as JSON schema reads it: anywhere in the string), the
    product of their NFAs: a schema's pattern beside a format's."""
    label = " and ".join(f"pattern {p!r}" for p in patterns)
    nfas = [build_nfa(Parser(p).top(True), f"pattern {p!r}") for p in patterns]
    product = nfas[0]
    for nfa in nfas[1:]:
        product = intersect(product, nfa, label)
    return finish(product, label, min_len, max_len)


def build_nfa(tree: tuple, label: str) -> Nfa:
    edges: list[list[tuple[Ranges, int]]] = []
    eps: list[list[int]] = []

    def new() -> int:
        if len(edges) >= MAX_STATES:
            raise RegexError(f"{label} needs more than {MAX_STATES} states; simplify it")
        edges.append([])
        eps.append([])
        return len(edges) - 1

    def build(node: tuple, state: int) -> int:
        kind = node[0]
        if kind == "chars":
            end = new()
            if node[1]:  # an empty class ([^\s\S]) matches no character: no way on
                edges[state].append((node[1], end))
            return end
        if kind == "cat":
            for part in node[1]:
                state = build(part, state)
            return state
        if kind == "alt":
            end = new()
            for branch in node[1]:
                head = new()
                eps[state].append(head)
                eps[build(branch, head)].append(end)
            return end
        _, body, low, high = node
        for _ in range(low):
            state = build(body, state)
        if high is None:
            loop = new()
            eps[state].append(loop)
            eps[build(body, loop)].append(loop)
            return loop
        for _ in range(high - low):
            end = new()
            eps[state].append(end)
            eps[build(body, state)].append(end)
            state = end
        return state

    start = new()
    return Nfa(edges, eps, start, build(tree, start))


def overlap(a: Ranges, b: Ranges) -> Ranges:
    """The code points in both."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def intersect(a: Nfa, b: Nfa, label: str) -> Nfa:
    """The product NFA (states: pairs reached from the starts; a char edge where both take the
    character, an epsilon edge where either moves alone): the strings both match."""
    index: dict[tuple[int, int], int] = {}
    edges: list[list[tuple[Ranges, int]]] = []
    eps: list[list[int]] = []
    todo: list[tuple[int, int]] = []

    def state(pair: tuple[int, int]) -> int:
        if pair not in index:
            if len(edges) >= MAX_STATES:
                raise RegexError(f"{label} together need more than {MAX_STATES} states; simplify them")
            index[pair] = len(edges)
            edges.append([])
            eps.append([])
            todo.append(pair)
        return index[pair]

    start = state((a.start, b.start))
    while todo:
        p, q = todo.pop()
        here = index[(p, q)]
        eps[here] += [state((nxt, q)) for nxt in a.eps[p]] + [state((p, nxt)) for nxt in b.eps[q]]
        for ranges_a, to_a in a.edges[p]:
            for ranges_b, to_b in b.edges[q]:
                both = overlap(ranges_a, ranges_b)
                if both:
                    edges[here].append((both, state((to_a, to_b))))
    accept = index.get((a.accept, b.accept))
    if accept is None:
        raise RegexError(f"no string matches {label}")
    return Nfa(edges, eps, start, accept)


def finish(nfa: Nfa, label: str, min_len: int, max_len: int | None) -> Regex:
    """The Regex of an NFA with the length bounds folded in. A maxLength past LENGTH_FOLD_LIMIT is
    not folded (every longer path counts as fitting; the closing check still holds the bound):
    the path bitsets would take minutes, and no generation writes that much into one string."""
    if min_len > LENGTH_FOLD_LIMIT:
        raise RegexError(f"a minLength of {min_len} beside the {label} is past {LENGTH_FOLD_LIMIT} characters; lower it")
    folded = max_len if max_len is not None and max_len <= LENGTH_FOLD_LIMIT else None
    cap = (folded + 1) if folded is not None else min_len
    reach = path_lengths(nfa.edges, nfa.eps, nfa.accept, cap)
    regex = Regex(nfa.edges, nfa.eps, nfa.accept, frozenset(), reach, cap, min_len, max_len)
    regex.start = regex.settle({nfa.start}, 0)
    if not regex.start:
        raise RegexError(f"no string of the allowed lengths matches the {label}")
    return regex


def path_lengths(edges: list[list[tuple[Ranges, int]]], eps: list[list[int]], accept: int, cap: int) -> list[int]:
    """Per state, the bitset of path lengths to `accept` (lengths >= cap saturate into bit cap)."""
    full = (1 << (cap + 1)) - 1
    reach = [0] * len(edges)
    reach[accept] = 1
    changed = True
    while changed:
        changed = False
        for state in reversed(range(len(edges))):  # built forwards: later states are nearer the end
            bits = reach[state]
            for nxt in eps[state]:
                bits |= reach[nxt]
            for _, nxt in edges[state]:
                shifted = reach[nxt] << 1
                bits |= (shifted & full) | ((1 << cap) if shifted >> cap else 0)
            if bits != reach[state]:
                reach[state], changed = bits, True
    return reach
