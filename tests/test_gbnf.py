"""GBNF grammars (atlas.gbnf): the matcher against independent oracles (Python's json on random and
damaged documents, Python's re on a regular grammar, a brute-force checker of a recursive one on
every short string), the syntax, the one-line errors (left recursion among them), and generation
on the demo model through LLM, the CLI and OutputFormat."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest

from atlas import LLM
from atlas.errors import AtlasError
from atlas.gbnf import GrammarError, compile_grammar, compile_grammar_tokens, on_cycles, reaching
from atlas.json_match import Matcher, Transitions
from atlas.json_regex import RegexError
from atlas.structured import OutputConstraint
from _json_grammar import JSON_GRAMMAR
from test_json_mode import damage, dumps, python_accepts, random_object


def accepts(shape: Transitions, data: bytes) -> bool:
    """The whole of data is a text the grammar derives."""
    matcher = Matcher(shape)
    return matcher.feed(data) and matcher.can_end


def begins(shape: Transitions, data: bytes) -> bool:
    return Matcher(shape).feed(data)


@pytest.fixture(scope="module")
def json_shape() -> Transitions:
    return Transitions(compile_grammar(JSON_GRAMMAR))


def test_json_grammar_accepts_what_json_loads_accepts(json_shape: Transitions, rng: np.random.Generator) -> None:
    """Random documents (indented or not) and one-byte damage to compact ones: accepted whole exactly
    when Python's json reads one object; every prefix of a good document begins one."""
    differing = 0
    for _ in range(300):
        data = dumps(rng, random_object(rng))
        assert accepts(json_shape, data), data
        cut = int(rng.integers(0, len(data)))
        assert begins(json_shape, data[:cut]), data[:cut]
        damaged = damage(data, rng)
        differing += not python_accepts(damaged)
        assert accepts(json_shape, damaged) == python_accepts(damaged), damaged
    assert differing > 30


def test_regular_grammar_matches_as_python_re(rng: np.random.Generator) -> None:
    """A grammar without recursion (one NFA) against the same language in Python's re, on random
    strings over its alphabet: whole matches, and prefixes that some match extends."""
    grammar = r"""
    root  ::= word ( sep word ){0,2} end?
    word  ::= [a-c]+ | "x" [0-9]{2,3}
    sep   ::= "-" | "--"
    end   ::= "!" | "?"
    """
    pattern = re.compile(r"(?:[a-c]+|x[0-9]{2,3})(?:(?:-|--)(?:[a-c]+|x[0-9]{2,3})){0,2}[!?]?")
    shape = Transitions(compile_grammar(grammar))
    alphabet = "abcx019-!?"
    for _ in range(3000):
        text = "".join(alphabet[int(i)] for i in rng.integers(0, len(alphabet), int(rng.integers(0, 12))))
        assert accepts(shape, text.encode()) == bool(pattern.fullmatch(text)), text


def balanced(text: str) -> bool:
    """The language of NESTED below, checked by hand: items "a" or a parenthesised list of items
    separated by "+", with at least one item in each list."""
    def item(at: int) -> int | None:
        if text[at : at + 1] == "a":
            return at + 1
        if text[at : at + 1] != "(":
            return None
        end = items(at + 1)
        return end + 1 if end is not None and text[end : end + 1] == ")" else None

    def items(at: int) -> int | None:
        end = item(at)
        while end is not None and text[end : end + 1] == "+":
            end = item(end + 1)
        return end

    return items(0) == len(text)


NESTED = r"""
root  ::= items
items ::= item ( "+" item )*
item  ::= "a" | "(" items ")"
"""


def test_recursive_grammar_on_every_short_string() -> None:
    """Every string of up to 7 characters over ( ) a +: accepted exactly when the hand-written
    checker accepts it, and (up to 4 characters) begun exactly when some accepted string of up
    to 9 extends it (depth d needs "a" and d closes: at most 5 more)."""
    shape = Transitions(compile_grammar(NESTED))
    words = ["".join(w) for n in range(8) for w in itertools.product("()a+", repeat=n)]
    longer = ["".join(w) for n in range(10) for w in itertools.product("()a+", repeat=n)]
    prefixes = {w[:i] for w in longer if balanced(w) for i in range(len(w) + 1)}
    for word in words:
        assert accepts(shape, word.encode()) == balanced(word), word
        if len(word) <= 4:
            assert begins(shape, word.encode()) == (word in prefixes), word


def test_unicode_escapes_classes_and_any_character() -> None:
    shape = Transitions(compile_grammar(r'root ::= "\u00e9\x41" [\U0001F600-\U0001F64F]+ . [^a-z\n]'))
    assert accepts(shape, "éA😀😃xZ".encode())
    assert accepts(shape, "éA😀\n1".encode())  # "." takes a line break too
    assert not accepts(shape, "éA😀xz".encode()) and not accepts(shape, "éAxxZ".encode())
    assert begins(shape, b"\xc3\xa9A\xf0\x9f\x98")  # an emoji's first three bytes
    assert not begins(shape, b"\xc3\xa9A\xe2")  # no code point of the class starts with E2


def test_repetition_bounds_and_empty_items() -> None:
    """{m}, {m,}, {m,n}, {,n}, and an item that may be empty repeated without bound (its count
    stays finite: the matcher must not loop)."""
    cases = {
        'root ::= "a"{3}': (["aaa"], ["aa", "aaaa"]),
        'root ::= "a"{2,}': (["aa", "aaaaaaa"], ["a"]),
        'root ::= "a"{1,3} "b"': (["ab", "aaab"], ["b", "aaaab"]),
        'root ::= "a"{,2}': (["", "a", "aa"], ["aaa"]),
        'root ::= ("a"?)* "b"': (["b", "ab", "aaab"], ["a", "ba"]),
        'root ::= x* "b"\nx ::= "a" | ""': (["b", "aab"], ["ba"]),
    }
    for grammar, (good, bad) in cases.items():
        shape = Transitions(compile_grammar(grammar))
        assert all(accepts(shape, w.encode()) for w in good), grammar
        assert not any(accepts(shape, w.encode()) for w in bad), grammar


def test_regular_parts_too_large_for_one_nfa_are_split() -> None:
    """A bounded repetition or a literal past json_regex.MAX_STATES states becomes Repeat /
    Literal nodes instead of being refused."""
    shape = Transitions(compile_grammar('root ::= ("abcde" [0-9]){2,1000} "."'))
    assert accepts(shape, b"abcde1" * 1000 + b".") and not accepts(shape, b"abcde1" * 1001 + b".")
    assert not accepts(shape, b"abcde1.") and accepts(shape, b"abcde1abcde2.")
    long = "xy" * 2500
    shape = Transitions(compile_grammar(f'root ::= "{long}" [a-z]'))
    assert accepts(shape, (long + "q").encode()) and not accepts(shape, long.encode())


SCHEMA_STYLE = r"""
root ::= "[" space item ("," space item){1,3} "]" space
item ::= "{" space "\"name\"" space ":" space name "," space "\"age\"" space ":" space age "}" space
name ::= "\"" char{1,12} "\"" space
age ::= ([0-9] | [1-8] [0-9] | [9] [0-9] | "1" ([0-4] [0-9] | [5] "0")) space
char ::= [^"\\\x7F\x00-\x1F] | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})
space ::= | " " | "\n" [ \t]{0,20}
"""


def test_grammar_in_the_style_json_schema_converters_write(rng: np.random.Generator) -> None:
    """An empty first alternative, escaped quotes and backslashes in literals and classes, bounded
    repetitions: the documents Python's json writes for random data of the shape are accepted,
    and ones outside it (an age past 150, a name too long, one item) are not."""
    import json

    shape = Transitions(compile_grammar(SCHEMA_STYLE))
    for _ in range(200):
        items = [{"name": "".join(rng.choice(list('ab"\\é\n'), int(rng.integers(1, 6)))), "age": int(rng.integers(0, 151))}
                 for _ in range(int(rng.integers(2, 5)))]
        text = json.dumps(items, indent=int(rng.integers(0, 3)) or None)
        assert accepts(shape, text.encode()), text
    for bad in ('[{"name": "a", "age": 151}, {"name": "b", "age": 1}]', '[{"name": "a", "age": 1}]',
                '[{"name": "abcdefghijklm", "age": 1}, {"name": "b", "age": 1}]'):
        assert not accepts(shape, bad.encode()), bad


def test_rules_span_lines_inside_parentheses_and_after_bars() -> None:
    grammar = 'root ::= ( "a"\n  | "b" ) | # a comment\n  "c" x\n\nx ::= "!"  # another\n'
    shape = Transitions(compile_grammar(grammar))
    assert [w for w in ("a", "b", "c!", "c", "ab") if accepts(shape, w.encode())] == ["a", "b", "c!"]


@pytest.mark.parametrize(("grammar", "message"), [
    ("", "non-empty"),
    ('answer ::= "yes"', "no root rule"),
    ("root ::= item", "'item', which is not defined"),
    ('root ::= "a"\nroot ::= "b"', "line 2, column 1: rule 'root' is defined twice"),
    ("root = \"a\"", "line 1, column 6: expected '::='"),
    ('root ::= "abc', "unterminated literal"),
    ("root ::= [a-", "unterminated character class"),
    ("root ::= [z-a]", "runs backwards"),
    ("root ::= ( \"a\"", "expected ')'"),
    ('root ::= "\\q"', "unknown escape \\q"),
    ('root ::= "\\u12"', "\\u needs 4 hex digits"),
    ('root ::= "\\UDEADBEEF"', "is not a character"),
    ('root ::= "a"{3,2}', "0 <= m <= n"),
    ("root ::= [^\\x00-\\U0010FFFF]", "matches no character"),
    ('root ::= "a"{x}', "whole numbers"),
    ('root ::= "a"{2', "line 1, column 13: unterminated repetition"),
    ("root ::= 'a'", "line 1, column 10: unexpected \"'\""),
    ('root ::= root "a" | "b"', "'root' is left-recursive"),
    ('root ::= x "!"\nx ::= y "a" | "b"\ny ::= x', "left-recursive"),
    ('root ::= z root "a" | "b"\nz ::= "c"?', "'root' is left-recursive"),  # through an empty prefix
    ('root ::= "a" ")"\n)', "line 2, column 1: expected a rule name"),
    ('root ::= "a"\n  | "b"', "line 2, column 3: expected a rule name"),  # a rule's line ends it, as in llama.cpp
    ("root ::= <[12x]>", "line 1, column 10: <[12x]>: a token id is a whole number"),
    ("root ::= <>", "a token terminal is <[id]> or <text>"),
    ("root ::= <think", "a token terminal is <[id]> or <text>"),
    ("root ::= !\"a\"", "unexpected '!'"),
])
def test_errors_are_one_line(grammar: str, message: str) -> None:
    with pytest.raises(GrammarError) as caught:
        compile_grammar(grammar)
    text = str(caught.value)
    assert message in text and "\n" not in text, text
    assert isinstance(caught.value, AtlasError)


def test_nesting_past_the_parsers_depth_is_one_line() -> None:
    from atlas.structured import OutputFormat

    output = OutputFormat.of(grammar="root ::= " + "(" * 3000 + '"a"' + ")" * 3000)
    assert output is not None
    with pytest.raises(AtlasError, match="grammar: nested too deeply to compile; flatten it"):
        output.shape()


def test_right_recursion_and_nesting_compile() -> None:
    shape = Transitions(compile_grammar('root ::= "a" root | "b"'))
    assert accepts(shape, b"aaab") and not accepts(shape, b"aaa")


def test_cycle_analysis_matches_a_search_from_every_rule(rng: np.random.Generator) -> None:
    """on_cycles / reaching (linear: the grammar's recursion and left-recursion checks) against a
    plain search from each name, over random graphs with self-loops and long chains."""
    for _ in range(60):
        names = [f"r{i}" for i in range(int(rng.integers(1, 40)))]
        density = float(rng.uniform(0.0, 0.15))
        graph = {n: {m for m in names if rng.random() < density} for n in names}

        def reached(start: str) -> set[str]:
            seen, todo = set(), list(graph[start])
            while todo:
                name = todo.pop()
                if name not in seen:
                    seen.add(name)
                    todo.extend(graph[name])
            return seen

        cyclic = {n for n in names if n in reached(n)}
        assert on_cycles(graph) == cyclic
        targets = {n for n in names if rng.random() < 0.1}
        assert reaching(graph, targets) == {n for n in names if n in targets or reached(n) & targets}


# --- generation ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM(device="cpu", prompt_cache=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_follows_a_recursive_grammar(demo: LLM, rng: np.random.Generator, temperature: float) -> None:
    """Every generated text is a prefix of one the hand-written checker accepts (a whole one when
    it stops), greedy and sampled, stream() as generate()."""
    for _ in range(3):
        options = {"max_tokens": 30, "temperature": temperature, "seed": int(rng.integers(1 << 30)), "grammar": NESTED}
        result = demo.generate(str(rng.choice(["Flat is", "(a+", "Beautiful"])), **options)
        text = result.text
        assert text in {w[: len(text)] for w in [text + tail for tail in completions(text)] if balanced(w)}, text
        if result.finish_reason == "stop":
            assert balanced(text), text
        assert "".join(demo.stream("Flat is", **options)) == demo.generate("Flat is", **options).text


def completions(text: str) -> list[str]:
    """Short tails that may finish `text` in NESTED's language: closing parentheses after an a."""
    depth = text.count("(") - text.count(")")
    need = "" if text and text[-1] in "a)" else "a"
    return [need + ")" * max(depth, 0)]


def test_output_format_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from atlas.run import main
    from atlas.structured import OutputFormat

    with pytest.raises(AtlasError, match="regex and grammar exclude each other"):
        OutputFormat.of(regex="a", grammar='root ::= "a"')
    with pytest.raises(AtlasError, match="grammar must be a string"):
        OutputFormat.of(grammar=["root ::= a"])
    path = tmp_path / "yes.gbnf"
    path.write_text('root ::= ("yes" | "no") "!"\n', encoding="utf-8")
    assert main(["--device", "cpu", "--max-tokens", "8", "--grammar-file", str(path)]) == 0
    assert capsys.readouterr().out.strip() in ("yes!", "no!")
    assert main(["--device", "cpu", "--grammar", "root ::= x"]) == 2
    assert "rule 'root' uses 'x'" in capsys.readouterr().err
    assert main(["--device", "cpu", "--grammar", "root ::= \"a\"", "--grammar-file", str(path)]) == 2
    assert "exclude each other" in capsys.readouterr().err


# --- token terminals ----------------------------------------------------------------------------------
# A made-up vocabulary: token i's text; 9 is a special token (no text in the output) named <|sep|>.
TOKEN_TEXTS = [b"a", b"b", b"ab", b"<think>", b"</think>", b"1", b"12", b"\n", b" ", None]
SPECIAL = {9: b"<|sep|>"}
END = 10


def token_constraint(grammar: str, texts: list[bytes | None] = TOKEN_TEXTS) -> OutputConstraint:
    node, tokens = compile_grammar_tokens(grammar)
    return OutputConstraint(texts, {END}, Transitions(node, tokens), SPECIAL)


DIGIT_TOKENS = {5, 6}


def token_language(tokens: list[int], whole: bool) -> bool:
    """TOKEN_GRAMMAR by hand: the <think> token, any tokens but </think>, the </think> token, then
    nothing, or digits as text (tokens 1 and 12) and the <|sep|> token. whole: the sequence is
    one of those, else it begins one."""
    if not tokens:
        return not whole
    if tokens[0] != 3:
        return False
    if 4 not in tokens[1:]:
        return not whole
    rest = tokens[tokens.index(4, 1) + 1:]
    if not rest:
        return True
    digits = all(t in DIGIT_TOKENS for t in rest[:-1])
    if whole:
        return digits and len(rest) > 1 and rest[-1] == 9
    return digits and (rest[-1] in DIGIT_TOKENS or (rest[-1] == 9 and len(rest) > 1))


TOKEN_GRAMMAR = """root ::= <think> (!</think>)* <[4]> tail?
tail ::= [0-9]+ <|sep|>"""


def test_token_terminals_against_a_hand_checker() -> None:
    """Every token sequence up to length 5 over the made-up vocabulary: the constraint allows each
    token exactly when some accepted sequence continues that way, and ends exactly on the
    accepted ones. The text "<think>" written as "<" pieces would not do: only the token counts."""
    vocab = range(len(TOKEN_TEXTS))
    checked = 0
    for n in range(5):
        for sequence in map(list, itertools.product(vocab, repeat=n)):
            if not token_language(sequence, whole=False):
                continue
            constraint = token_constraint(TOKEN_GRAMMAR)
            for token in sequence:
                constraint.advance(token)
            for token in vocab:
                assert constraint.allows(token) == token_language([*sequence, token], whole=False), (sequence, token)
            assert constraint.allows(END) == token_language(sequence, whole=True), sequence
            checked += 1
    assert checked > 500


def test_a_token_terminal_and_a_literal_of_the_same_text() -> None:
    """The literal "<think>" is that text in any tokens; <think> is the one token whose text it is."""
    texts: list[bytes | None] = [b"<th", b"ink>", b"<think>", b"x"]
    literal, token = token_constraint('root ::= "<think>"', texts), token_constraint("root ::= <think>", texts)
    assert literal.allows(0) and literal.allows(2) and not token.allows(0) and token.allows(2)
    both = token_constraint('root ::= <think> "x" | "<think>" "y"', texts)  # both ways at once: a stack each
    both.advance(2)
    assert both.allows(3)


def test_generation_with_token_terminals(demo: LLM, rng: np.random.Generator) -> None:
    """The demo model held to a token by id, a token excluded everywhere, and a special token by
    its text; a text no token spells is one line before generating."""
    tokenizer = demo.tokenizer
    first = int(rng.integers(3, 500))
    result = demo.generate("Flat is", max_tokens=6, grammar=f"root ::= <[{first}]> (!<[{first}]>)*",
                           temperature=1.0, seed=int(rng.integers(1 << 30)))
    assert result.token_ids[0] == first and first not in result.token_ids[1:]
    start = tokenizer.text_ids[b"<|im_start|>"]
    result = demo.generate("Flat is", max_tokens=4, grammar='root ::= " better" <|im_start|> [a-z]+')
    assert start in result.token_ids and tokenizer.decode(result.token_ids[: result.token_ids.index(start)]) == " better"
    with pytest.raises(AtlasError, match="token terminal <nothing> is not one token"):
        demo.generate("Flat is", max_tokens=4, grammar="root ::= <nothing>")
    with pytest.raises(AtlasError, match=r"token terminal <\[70000\]> is outside the vocabulary"):
        demo.generate("Flat is", max_tokens=4, grammar="root ::= <[70000]>")


def test_ids_without_text_are_never_taken_and_the_cache_stays_small() -> None:
    """An id past the tokenizer's table (model padding) has no text: not even a negated terminal
    takes it. Tokens no terminal names share one cached move, so checking a large vocabulary
    adds a handful of moves, not one per token."""
    constraint = token_constraint("root ::= (!<[3]>)* <[4]>")
    assert not constraint.allows(len(TOKEN_TEXTS) + 1) and constraint.allows(9)  # padding no; the special <|sep|> yes
    texts = [bytes([97 + i % 26]) * (1 + i // 26) for i in range(5000)]
    texts[3], texts[4] = b"<think>", b"</think>"
    big = token_constraint("root ::= (!<[3]>)* <[4]> [a-z]+", texts)
    for token in range(len(texts)):
        big.allows(token)
    assert len(big.matcher.transitions.moves) < 200


def test_a_terminal_naming_an_end_token_is_refused(demo: LLM) -> None:
    end = min(demo.eos_ids())
    with pytest.raises(AtlasError, match=rf"token terminal <\[{end}\]> is an end-of-sequence token"):
        demo.generate("Flat is", max_tokens=4, grammar=f'root ::= "x" <[{end}]>')
    text = demo.generate("Flat is", max_tokens=4, grammar=f'root ::= (!<[{end}]>)+').text  # negated: any other token
    assert text


def test_token_ids_past_int32_and_regex_bounds_with_zeros() -> None:
    from atlas.json_regex import compile_regex

    with pytest.raises(GrammarError, match="below 2\\^31"):
        compile_grammar('root ::= <[9999999999]>')
    compile_regex("a{00001}", search=False)  # leading zeros: a bound of 1
    with pytest.raises(RegexError, match="repetition bound past"):
        compile_regex("a{" + "9" * 6 + "}", search=False)
