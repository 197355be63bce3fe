"""Context-free grammars in llama.cpp's GBNF (its `--grammar` / `grammar` field, vLLM's
guided_grammar / structured_outputs grammar): the whole output is one `root` the grammar derives.

    root   ::= answer "."
    answer ::= "yes" | "no" | [0-9]+ ( "," [0-9]+ )*   # comments run to the line's end

Syntax (llama.cpp's): rules `name ::= alternatives`, one per line (a rule goes on over line breaks
inside parentheses and after `|`); names of letters, digits, `-` and `_`; items are "literals",
[classes] and [^negated classes] of code points (escapes \\t \\n \\r \\\\ \\" \\[ \\] \\- \\xHH
\\uHHHH \\UHHHHHHHH), `.` (any character), token terminals (llama.cpp's: <[id]> the token of that id, <text> the token
whose text that is, tags included, e.g. <think>; !<[id]> and !<text> any one token but that one),
rule names and ( groups ), each optionally repeated by * + ? {m} {m,} {m,n} {,n}.

Compilation: what does not reach a recursive rule is regular and becomes one NFA over code points
(atlas.json_regex.compile_tree) in a json_match.Text node; recursive rules become pushdown nodes
(Union of alternatives, Sequence, Repeat) whose regular runs are Text nodes again. A token terminal
takes a whole token, not text (TokenTerminal): the rules that reach one are pushdown nodes too. A regular part
too large for one NFA (json_regex.MAX_STATES) is split the same way. A rule that
may reach itself before taking a character (left recursion) is refused, as llama.cpp does."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import AtlasError
from .json_match import Literal, Node, State, Text, Union
from .json_regex import ANY, MAX_CP, RegexError, Ranges, compile_tree, complement, normalize

# AST: ("lit", str) | ("chars", Ranges) | ("ref", name) | ("seq", [items]) | ("alt", [seqs])
#      | ("rep", item, min, max | None) | ("tok", id | text, negated)
Ast = tuple
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
ESCAPES = {"t": 0x09, "n": 0x0A, "r": 0x0D, "\\": 0x5C, '"': 0x22, "[": 0x5B, "]": 0x5D, "-": 0x2D}
HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
MAX_REPEAT = 1000  # {m,n} bounds: a larger count is refused


class GrammarError(AtlasError):
    pass


class Sequence(Node):
    """Items one after another. State: how many have ended."""

    __slots__ = ("items",)

    def __init__(self, items: tuple[Node, ...]) -> None:
        self.items = items

    def begin(self) -> State:
        return 0

    def step(self, state: State, byte: int) -> State | None:
        return None

    def child(self, state: State) -> Node | None:
        return self.items[state] if state < len(self.items) else None

    def accept(self, state: State, child: Node, child_state: State) -> State:
        return state + 1

    def final(self, state: State) -> bool:
        return state == len(self.items)

    def open(self, state: State) -> bool:
        return False


class TokenTerminal(Node):
    """One whole token: the one of an id (int) or of a text (bytes), or with `negated` any token
    but that one. State: taken (0 / 1)."""

    __slots__ = ("token", "negated")

    def __init__(self, token: int | bytes, negated: bool) -> None:
        self.token, self.negated = token, negated

    def begin(self) -> State:
        return 0

    def step(self, state: State, byte: int) -> State | None:
        return None

    def step_token(self, state: State, token: int, text: bytes) -> State | None:
        named = token == self.token if isinstance(self.token, int) else text == self.token
        return 1 if state == 0 and named != self.negated else None

    def final(self, state: State) -> bool:
        return state == 1

    def open(self, state: State) -> bool:
        return state == 0


class Repeat(Node):
    """`item` low..high times (high None: no bound). State: the count, kept at `low` once there
    when unbounded, so an item that may be empty cannot make states without end."""

    __slots__ = ("item", "low", "high")

    def __init__(self, item: Node, low: int, high: int | None) -> None:
        self.item, self.low, self.high = item, low, high

    def begin(self) -> State:
        return 0

    def step(self, state: State, byte: int) -> State | None:
        return None

    def child(self, state: State) -> Node | None:
        return self.item if self.high is None or state < self.high else None

    def accept(self, state: State, child: Node, child_state: State) -> State:
        return min(state + 1, self.low) if self.high is None else state + 1

    def final(self, state: State) -> bool:
        return state >= self.low

    def open(self, state: State) -> bool:
        return False


# --- parsing -------------------------------------------------------------------------------------
class Parser:
    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0

    def fail(self, problem: str) -> GrammarError:
        line = self.text.count("\n", 0, self.i) + 1
        column = self.i - (self.text.rfind("\n", 0, self.i) + 1) + 1
        return GrammarError(f"grammar line {line}, column {column}: {problem}")

    def peek(self, ahead: int = 0) -> str:
        at = self.i + ahead
        return self.text[at] if at < len(self.text) else ""

    def space(self, newlines: bool) -> None:
        """Skips blanks and comments (and line breaks when `newlines`)."""
        while self.peek():
            char = self.peek()
            if char == "#":
                end = self.text.find("\n", self.i)
                self.i = len(self.text) if end < 0 else end
            elif char in " \t" or (newlines and char in "\r\n"):
                self.i += 1
            else:
                return

    def rules(self) -> dict[str, Ast]:
        found: dict[str, Ast] = {}
        self.space(True)
        while self.peek():
            start = self.i
            name = self.name()
            if name in found:
                self.i = start
                raise self.fail(f"rule {name!r} is defined twice")
            self.space(False)
            if not self.text.startswith("::=", self.i):
                raise self.fail(f"expected '::=' after the rule name {name!r}")
            self.i += 3
            self.space(True)
            found[name] = self.alternatives(nested=False)
            if self.peek() not in ("", "\n", "\r"):
                raise self.fail(f"unexpected {self.peek()!r}")
            self.space(True)
        return found

    def name(self) -> str:
        start = self.i
        while self.peek() and self.peek() in NAME_CHARS:
            self.i += 1
        if self.i == start:
            raise self.fail("expected a rule name" if self.peek() else "the grammar ends too early")
        return self.text[start : self.i]

    def alternatives(self, nested: bool) -> Ast:
        options = [self.sequence(nested)]
        while self.peek() == "|":
            self.i += 1
            self.space(True)
            options.append(self.sequence(nested))
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self, nested: bool) -> Ast:
        items = []
        while self.peek() and self.peek() not in "|)\r\n":
            items.append(self.repeated(self.primary()))
            self.space(nested)
        return items[0] if len(items) == 1 else ("seq", items)

    def primary(self) -> Ast:
        char = self.peek()
        if char == '"':
            self.i += 1
            chars = []
            while self.peek() != '"':
                if not self.peek():
                    raise self.fail("unterminated literal")
                chars.append(chr(self.char()))
            self.i += 1
            return ("lit", "".join(chars))
        if char == "[":
            return ("chars", self.char_class())
        if char == ".":
            self.i += 1
            return ("chars", ANY)
        if char == "(":
            self.i += 1
            self.space(True)
            inner = self.alternatives(nested=True)
            if self.peek() != ")":
                raise self.fail("expected ')'")
            self.i += 1
            return inner
        if char in NAME_CHARS:
            return ("ref", self.name())
        if char == "<" or (char == "!" and self.peek(1) == "<"):
            return self.token_terminal()
        raise self.fail(f"unexpected {char!r}" if char else "the grammar ends too early")

    def token_terminal(self) -> Ast:
        """<[id]>, <text> (the text with its angle brackets) or either after '!'."""
        negated = self.peek() == "!"
        self.i += negated
        close = self.text.find(">", self.i)
        inner = self.text[self.i + 1 : close] if close >= 0 else ""
        if close < 0 or not inner or any(c in inner for c in "<\r\n"):
            raise self.fail("a token terminal is <[id]> or <text> on one line, e.g. <[151668]> or <think>")
        is_id = inner.startswith("[") and inner.endswith("]")
        digits = inner[1:-1]
        if is_id and not (digits.isdigit() and digits.isascii() and len(digits.lstrip("0")) <= 10 and int(digits) < 2**31):
            raise self.fail(f"<{inner[:24]}>: a token id is a whole number below 2^31, e.g. <[151668]>")
        self.i = close + 1
        return ("tok", int(inner[1:-1]) if is_id else f"<{inner}>".encode(), negated)

    def char_class(self) -> Ranges:
        self.i += 1
        negated = self.peek() == "^"
        self.i += negated
        ranges = []
        while self.peek() != "]":
            if not self.peek():
                raise self.fail("unterminated character class")
            low = self.char()
            high = low
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                high = self.char()
                if high < low:
                    raise self.fail(f"the range {chr(low)!r}-{chr(high)!r} runs backwards")
            ranges.append((low, high))
        found = normalize(ranges)
        found = complement(found) if negated else found
        if not found:
            raise self.fail("the character class matches no character")
        self.i += 1
        return found

    def char(self) -> int:
        """One code point of a literal or class, escapes decoded."""
        char = self.peek()
        self.i += 1
        if char != "\\":
            return ord(char)
        code = self.peek()
        self.i += 1
        if code in ESCAPES:
            return ESCAPES[code]
        if code in HEX_ESCAPES:
            digits = self.text[self.i : self.i + HEX_ESCAPES[code]]
            if len(digits) != HEX_ESCAPES[code] or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"\\{code} needs {HEX_ESCAPES[code]} hex digits")
            self.i += len(digits)
            value = int(digits, 16)
            if value > MAX_CP or 0xD800 <= value <= 0xDFFF:
                raise self.fail(f"\\{code}{digits} is not a character")
            return value
        raise self.fail(f"unknown escape \\{code}" if code else "the grammar ends too early")

    def repeated(self, item: Ast) -> Ast:
        char = self.peek()
        if char in ("*", "+", "?"):
            self.i += 1
            return ("rep", item, int(char == "+"), 1 if char == "?" else None)
        if char != "{":
            return item
        close = self.text.find("}", self.i)
        if close < 0:
            raise self.fail("unterminated repetition: '{' without '}'")
        body = self.text[self.i + 1 : close]
        low_text, comma, high_text = body.partition(",")
        try:
            low = int(low_text.strip() or "0")
            high = (int(high_text) if high_text.strip() else None) if comma else low
        except ValueError:
            raise self.fail("a repetition is {m}, {m,}, {m,n} or {,n} with whole numbers") from None
        if low < 0 or (high is not None and (high < low or high > MAX_REPEAT)) or low > MAX_REPEAT:
            raise self.fail(f"the repetition {{{body}}} must have 0 <= m <= n <= {MAX_REPEAT}")
        self.i = close + 1
        return ("rep", item, low, high)


# --- compiling -----------------------------------------------------------------------------------
def refs(ast: Ast) -> set[str]:
    kind = ast[0]
    if kind == "ref":
        return {ast[1]}
    if kind in ("seq", "alt"):
        return set().union(*(refs(part) for part in ast[1]))
    return refs(ast[1]) if kind == "rep" else set()


def token_terminals(ast: Ast) -> set[tuple[int | bytes, bool]]:
    """(the token named, negated) of `ast`'s own token terminals (not through its rule references)."""
    kind = ast[0]
    if kind == "tok":
        return {(ast[1], ast[2])}
    if kind in ("seq", "alt"):
        return set().union(*(token_terminals(part) for part in ast[1]))
    return token_terminals(ast[1]) if kind == "rep" else set()


def nullable_rules(rules: dict[str, Ast]) -> set[str]:
    """The rules that derive the empty text (a fixpoint)."""
    found: set[str] = set()
    while True:
        more = {name for name, ast in rules.items() if name not in found and nullable(ast, found)}
        if not more:
            return found
        found |= more


def nullable(ast: Ast, empty_rules: set[str]) -> bool:
    kind = ast[0]
    if kind == "lit":
        return not ast[1]
    if kind in ("chars", "tok"):
        return False
    if kind == "ref":
        return ast[1] in empty_rules
    if kind == "seq":
        return all(nullable(part, empty_rules) for part in ast[1])
    if kind == "alt":
        return any(nullable(part, empty_rules) for part in ast[1])
    return ast[2] == 0 or nullable(ast[1], empty_rules)


def first_refs(ast: Ast, empty_rules: set[str]) -> set[str]:
    """The rules `ast` may enter before taking a character."""
    kind = ast[0]
    if kind == "ref":
        return {ast[1]}
    if kind == "alt":
        return set().union(*(first_refs(part, empty_rules) for part in ast[1]))
    if kind == "rep":
        return first_refs(ast[1], empty_rules)
    if kind != "seq":
        return set()
    found: set[str] = set()
    for part in ast[1]:
        found |= first_refs(part, empty_rules)
        if not nullable(part, empty_rules):
            break
    return found


def on_cycles(graph: dict[str, set[str]]) -> set[str]:
    """The names that reach themselves in one or more steps: Tarjan's strongly connected
    components (iterative, linear in the grammar: one search per rule was quadratic), those
    of two or more names and the names with an edge to themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cyclic: set[str] = set()
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            name, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on_stack:
                    low[name] = min(low[name], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[name])
            if low[name] == index[name]:
                component = [stack.pop()]
                while component[-1] != name:
                    component.append(stack.pop())
                on_stack.difference_update(component)
                if len(component) > 1 or name in graph[name]:
                    cyclic.update(component)
    return cyclic


def reaching(graph: dict[str, set[str]], targets: set[str]) -> set[str]:
    """The names that reach one of `targets` in zero or more steps (a search of the reversed graph)."""
    callers: dict[str, list[str]] = {name: [] for name in graph}
    for name, called in graph.items():
        for other in called:
            callers[other].append(name)
    found, todo = set(targets), list(targets)
    while todo:
        for caller in callers[todo.pop()]:
            if caller not in found:
                found.add(caller)
                todo.append(caller)
    return found


@dataclass
class Compiler:
    rules: dict[str, Ast]
    pushdown: set[str] = field(default_factory=set)  # rules on a cycle, with a token terminal, or reaching one
    nodes: dict[str, Union] = field(default_factory=dict)

    def regular(self, ast: Ast) -> bool:
        return not (refs(ast) & self.pushdown) and not token_terminals(ast)

    def node(self, ast: Ast) -> Node:
        """ast as a matcher node: one Text where it is regular (and its NFA not too large), else
        pushdown nodes."""
        regular = self.regular(ast)
        if regular:
            made = self.text(ast)
            if made is not None:
                return made
        kind = ast[0]
        if kind == "tok":
            return TokenTerminal(ast[1], ast[2])
        if kind == "lit":  # a literal too long for one NFA: its exact bytes
            return Literal((ast[1].encode(),))
        if kind == "ref":
            return self.rule(ast[1])
        if kind == "alt":
            return Union([self.node(part) for part in ast[1]])
        if kind == "rep":
            return Repeat(self.node(ast[1]), ast[2], ast[3])
        if regular:  # a sequence too large for one NFA: item by item
            return Sequence(tuple(self.node(part) for part in ast[1]))
        items: list[Node] = []
        run: list[Ast] = []  # regular items in a row: one node
        for part in [*ast[1], None]:
            if part is not None and self.regular(part):
                run.append(part)
                continue
            items += [self.node(("seq", run))] if run else []
            items += [self.node(part)] if part is not None else []
            run = []
        return Sequence(tuple(items))

    def rule(self, name: str) -> Union:
        if name not in self.nodes:
            self.nodes[name] = Union()  # filled after: the rule may refer to itself
            self.nodes[name].options = (self.node(self.rules[name]),)
        return self.nodes[name]

    def text(self, ast: Ast) -> Text | None:
        """The regular ast's NFA in a Text node; None when it needs more than MAX_STATES states."""
        try:
            return Text(compile_tree(self.tree(ast), "grammar"))
        except RegexError:
            return None

    def tree(self, ast: Ast) -> tuple:
        """ast, regular, as a json_regex AST (rules inlined)."""
        kind = ast[0]
        if kind == "lit":
            return ("cat", [("chars", ((ord(c), ord(c)),)) for c in ast[1]])
        if kind == "chars":
            return ast
        if kind == "ref":
            return self.tree(self.rules[ast[1]])
        if kind == "seq":
            return ("cat", [self.tree(part) for part in ast[1]])
        if kind == "alt":
            return ("alt", [("cat", [self.tree(part)]) for part in ast[1]])
        return ("rep", self.tree(ast[1]), ast[2], ast[3])


def compile_grammar(text: str) -> Node:
    """The root rule's node; GrammarError (one line naming the place) on a malformed grammar,
    an undefined rule, no root, or left recursion."""
    return compile_grammar_tokens(text)[0]


def compile_grammar_tokens(text: str) -> tuple[Node, frozenset[tuple[int | bytes, bool]]]:
    """compile_grammar's node, and its token terminals: (the id or text named, negated)."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("grammar must be a non-empty string of GBNF rules with a root rule")
    rules = Parser(text).rules()
    names = set(rules)
    for name, ast in rules.items():
        missing = sorted(refs(ast) - names)
        if missing:
            raise GrammarError(f"grammar: rule {name!r} uses {missing[0]!r}, which is not defined")
    if "root" not in rules:
        raise GrammarError("grammar: there is no root rule (root ::= ...), where the output starts")
    empty_rules = nullable_rules(rules)
    left_recursive = on_cycles({name: first_refs(ast, empty_rules) for name, ast in rules.items()})
    for name in rules:
        if name in left_recursive:
            raise GrammarError(f"grammar: rule {name!r} is left-recursive (it reaches itself before a "
                               "character); rewrite it with repetition, e.g. a ::= b (\",\" b)*")
    graph = {name: refs(ast) for name, ast in rules.items()}
    terminals = {name: token_terminals(ast) for name, ast in rules.items()}
    with_tokens = {name for name, found in terminals.items() if found}
    root = Compiler(rules, reaching(graph, on_cycles(graph) | with_tokens)).node(("ref", "root"))
    return root, frozenset().union(*terminals.values())
