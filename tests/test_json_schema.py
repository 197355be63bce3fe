"""JSON schemas (atlas.json_schema, atlas.json_match) against the jsonschema package: every text a
random walk over the allowed bytes ends is valid JSON the schema admits; documents written in the
schema's property order are accepted exactly when jsonschema admits them; integer and decimal bounds
and string lengths exactly; what the generator cannot honour is refused with one line."""

from __future__ import annotations

import json
import re
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")  # in the test extras; the GPU machine may lack it (and only collects this file)

from atlas.json_match import ANY_OBJECT, AfterMarker, Matcher, Number, reachable  # noqa: E402
from atlas.json_number import DecimalRange, Interval  # noqa: E402
from atlas.json_schema import SchemaError, compile_schema  # noqa: E402
from test_json_mode import assert_greedy_allowed  # noqa: E402

ADDRESS = {"type": "object", "additionalProperties": False, "required": ["city", "zip"], "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 12},
    "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
}}
PERSON = {  # what pydantic writes: $defs, anyOf with null, titles and defaults
    "$defs": {"Address": ADDRESS},
    "title": "Person", "type": "object", "additionalProperties": False,
    "required": ["name", "age", "tags", "kind"],
    "properties": {
        "name": {"title": "Name", "type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number", "default": 0.5},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "address": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}], "default": None},
        "kind": {"const": "person"},
        "ok": {"type": "boolean"},
    },
}
TREE = {"$ref": "#/$defs/node", "$defs": {"node": {
    "type": "object", "additionalProperties": False, "required": ["v"], "properties": {
        "v": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
    }}}}
PAIR = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 3}], "items": False, "minItems": 1}
SMALL_INT = {"type": ["integer", "null"], "minimum": -3, "maximum": 20}
NUMBERS_BY_ID = {"type": "object", "required": ["id"], "properties": {"id": {"type": "integer"}},
                 "additionalProperties": {"type": "number"}}
MEASURE = {"type": "object", "additionalProperties": False, "required": ["p", "t"], "properties": {  # pydantic's confloat
    "p": {"type": "number", "minimum": 0, "maximum": 1},
    "t": {"type": "number", "exclusiveMinimum": -2.5, "exclusiveMaximum": 0.125},
    "w": {"type": ["number", "null"], "minimum": 0.001, "exclusiveMaximum": 150},
}}
ANYTHING: dict[str, Any] = {}
PET = {"oneOf": [  # a pydantic discriminated union: each object requires its own const
    {"type": "object", "additionalProperties": False, "required": ["kind", "lives"],
     "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 0, "maximum": 9}}},
    {"type": "object", "additionalProperties": False, "required": ["kind"],
     "properties": {"kind": {"enum": ["dog", "wolf"]}, "name": {"type": "string", "maxLength": 4}}},
    {"type": "string", "maxLength": 3}, {"enum": [1, 2]}, {"type": "null"}]}
SCHEMAS = {"person": PERSON, "tree": TREE, "pair": PAIR, "small_int": SMALL_INT, "numbers_by_id": NUMBERS_BY_ID,
           "anything": ANYTHING, "pet": PET, "measure": MEASURE}
CLOSERS = b'}]"'  # drawn more often so that walks end


def random_text(schema: dict[str, Any], rng: np.random.Generator, limit: int = 300) -> bytes | None:
    """A random walk over the bytes the matcher allows, ending where it may (None past `limit`)."""
    matcher, text = Matcher(compile_schema(schema)), bytearray()
    while len(text) < limit:
        if matcher.complete or (matcher.can_end and rng.random() < 0.3):
            return bytes(text)
        allowed = [b for b in range(256) if matcher.copy().feed(bytes((b,)))]
        assert allowed, f"stuck after {bytes(text)!r}"
        weights = np.array([8.0 if b in CLOSERS else 1.0 for b in allowed])
        byte = allowed[int(rng.choice(len(allowed), p=weights / weights.sum()))]
        assert matcher.feed(bytes((byte,)))
        text.append(byte)
    return None


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_walks_end_in_valid_documents(name: str, rng: np.random.Generator) -> None:
    schema, ended = SCHEMAS[name], 0
    for _ in range(60):
        text = random_text(schema, rng)
        if text is None:
            continue
        ended += 1
        value = json.loads(text)  # raises on anything that is not one JSON text
        jsonschema.validate(value, schema)
    assert ended >= 20, f"only {ended} of 60 walks ended"


def recognised(schema: dict[str, Any], data: bytes) -> bool:
    matcher = Matcher(compile_schema(schema))
    return matcher.feed(data) and matcher.can_end


def mutations(value: Any, rng: np.random.Generator) -> list[Any]:
    """Copies of a document with one value replaced (the whole document too), one key dropped or
    one array item dropped."""
    out = []
    replacements: list[Any] = [None, True, 0, -7, 3, 99999, 10000, 151, 1.5, "", "a", "person", "x" * 13, [], ["a"], {},
                               {"kind": "cat"}, {"kind": "dog", "lives": 3}]
    for _ in range(12):
        copy = json.loads(json.dumps(value))
        holder, key = pick_slot(copy, rng)
        if holder is None or rng.random() < 0.1:
            out.append(replacements[int(rng.integers(0, len(replacements)))])
            continue
        if rng.random() < 0.25:
            del holder[key]
        else:
            holder[key] = replacements[int(rng.integers(0, len(replacements)))]
        out.append(copy)
    return out


def pick_slot(value: Any, rng: np.random.Generator) -> tuple[Any, Any]:
    slots: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in list(items):
            slots.append((node, key))
            walk(child)

    walk(value)
    return slots[int(rng.integers(0, len(slots)))] if slots else (None, None)


def admits(schema: dict[str, Any], value: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def writings(value: Any) -> list[bytes]:
    """Three spellings of a document; none when it holds a float past JSON's range (9e999 reads
    as inf, which JSON cannot write)."""
    try:
        return [json.dumps(value, indent=indent, separators=sep, ensure_ascii=False, allow_nan=False).encode()
                for indent, sep in ((None, (",", ":")), (None, (", ", ": ")), (2, (",", ": ")))]
    except ValueError:
        return []


@pytest.mark.parametrize("name", ["person", "tree", "pair", "pet", "measure"])
def test_documents_in_property_order_are_accepted_exactly_when_valid(name: str, rng: np.random.Generator) -> None:
    """Walks give valid documents; one-value changes to them give valid and invalid ones. Written
    in the declared property order (the only order generation uses), each is accepted exactly when
    jsonschema admits it."""
    schema, invalid = SCHEMAS[name], 0
    for _ in range(25):
        text = random_text(schema, rng)
        if text is None:
            continue
        for value in [json.loads(text), *mutations(json.loads(text), rng)]:
            valid = admits(schema, value)
            invalid += not valid
            for data in writings(value):
                assert recognised(schema, data) == valid, data
    assert invalid > 20


@pytest.mark.parametrize(("data", "ok"), [
    (b'{"name":"Ann","age":3,"tags":["a"],"kind":"person"}', True),
    (b'{"name":"Ann","age":3,"score":-1.5e3,"tags":["c","b"],"address":null,"kind":"person","ok":false}', True),
    (b'{"name":"Ann","age":3,"tags":["a"],"address":{"city":"Oslo","zip":10001},"kind":"person"}', True),
    (b'{"age":3,"name":"Ann","tags":["a"],"kind":"person"}', False),  # declared order only
    (b'{"name":"Ann","age":3,"tags":["a"],"kind":"person","extra":1}', False),  # additionalProperties false
    (b'{"name":"Ann","age":3,"tags":[],"kind":"person"}', False),  # minItems
    (b'{"name":"Ann","age":3,"tags":["a","a","a","a"],"kind":"person"}', False),  # maxItems
    (b'{"name":"Ann","age":3,"tags":["d"],"kind":"person"}', False),  # enum
    (b'{"name":"Ann","age":151,"tags":["a"],"kind":"person"}', False),  # maximum
    (b'{"name":"Ann","age":-1,"tags":["a"],"kind":"person"}', False),  # minimum
    (b'{"name":"Ann","age":3.0,"tags":["a"],"kind":"person"}', False),  # integers are written without a fraction
    (b'{"name":"Ann","age":3,"tags":["a"]}', False),  # required
    (b'{"name":"Ann","age":3,"tags":["a"],"address":{"city":"","zip":10001},"kind":"person"}', False),  # minLength
    (b'{"name":"Ann","age":3,"tags":["a"],"address":{"city":"Oslo","zip":9999},"kind":"person"}', False),
])
def test_person_examples(data: bytes, ok: bool) -> None:
    assert recognised(PERSON, data) == ok
    if ok:
        jsonschema.validate(json.loads(data), PERSON)


def test_a_top_level_number_may_end_or_go_on() -> None:
    matcher = Matcher(compile_schema(SMALL_INT))
    assert matcher.feed(b"1") and matcher.can_end and not matcher.complete  # "1" or "10".."19"
    assert matcher.copy().feed(b"9") and not matcher.copy().feed(b"1234")
    assert matcher.feed(b"2") and matcher.complete  # 12: any further digit passes 20


def test_integer_bounds_agree_with_the_values(rng: np.random.Generator) -> None:
    """Over random ranges (open ends too), each integer text in [-300, 300] and "-0" is whole
    exactly when its value is in range, and every prefix of an in-range one is taken."""
    for _ in range(40):
        low, high = sorted(int(v) for v in rng.integers(-250, 250, 2))
        low_or_none = None if rng.random() < 0.2 else low
        high_or_none = None if rng.random() < 0.2 else high
        node = Number(integer=True, low=low_or_none, high=high_or_none)
        for value in [*range(-300, 301), "-0"]:
            text = str(value).encode()
            inside = (low_or_none is None or int(value) >= low_or_none) and (high_or_none is None or int(value) <= high_or_none)
            matcher = Matcher(node)
            took = matcher.feed(text)
            assert (took and matcher.can_end) == inside, (low_or_none, high_or_none, text)
            if inside:
                assert all(Matcher(node).feed(text[:i]) for i in range(1, len(text)))


def test_decimal_bounds_agree_with_the_values(rng: np.random.Generator) -> None:
    """Over random intervals (open or closed ends, or none), each decimal text with up to three
    fraction digits in [-30, 30] (and "-0", "0.000") is whole exactly when its value is inside,
    every prefix of an inside one is taken, and no exponent is."""
    grid = [Fraction(int(v), 100) for v in range(-3000, 3001, 7)]
    for _ in range(30):
        low, high = sorted(rng.choice(grid, 2, replace=False))
        interval = Interval(None if rng.random() < 0.2 else low, None if rng.random() < 0.2 else high,
                            bool(rng.random() < 0.5), bool(rng.random() < 0.5))
        node = DecimalRange(interval)
        values = [Fraction(int(v), 1000) for v in rng.integers(-30000, 30001, 150)] + [low, high, low - Fraction(1, 1000)]
        for text in [*(decimal_text(v, rng) for v in values), "-0", "0.000"]:
            inside = interval.holds(Fraction(text))
            matcher = Matcher(node)
            assert (matcher.feed(text.encode()) and matcher.can_end) == inside, (interval, text)
            if inside:
                assert all(Matcher(node).feed(text[:i].encode()) for i in range(1, len(text)))
                assert not Matcher(node).feed(f"{text}e0".encode())


@pytest.mark.parametrize("kind", ["integer", "number"])
def test_bounds_past_the_float_range(kind: str, rng: np.random.Generator) -> None:
    """Integers past the largest double are exact JSON numbers: as bounds and steps they compile,
    and a value past that range ends where it is inside (a parser reads it as infinity)."""
    exponent = int(rng.integers(309, 400))
    schema = {"type": kind, "minimum": 10**exponent, "maximum": 10**(exponent + 1), "multipleOf": 10**exponent}
    if kind == "number":
        del schema["multipleOf"]
    node = compile_schema(schema)
    text = ("2" + "0" * exponent + (".5" if kind == "number" else "")).encode()
    matcher = Matcher(node)
    assert matcher.feed(text) and matcher.can_end
    short = Matcher(node)  # one digit short of the minimum
    assert not (short.feed(b"9" * exponent) and short.can_end)
    huge = {"type": kind, "maximum": -(10**exponent)}
    assert Matcher(compile_schema(huge)).feed(b"-1" + b"0" * (exponent + 1))


def test_a_pattern_beside_a_length_past_the_folding_limit() -> None:
    """A maxLength past LENGTH_FOLD_LIMIT is not folded into the pattern's path bitsets (they
    would take minutes): the schema compiles at once, and the bound still closes the string."""
    node = compile_schema({"type": "string", "pattern": "^a+b$", "maxLength": 10**6})
    matcher = Matcher(node)
    assert matcher.feed(b'"' + b"a" * 100 + b'b"') and matcher.can_end
    short = Matcher(compile_schema({"type": "string", "pattern": "^a+b$", "maxLength": 10**6, "minLength": 5}))
    assert short.feed(b'"aa') and not short.copy().feed(b'b"') and short.feed(b'aab"') and short.can_end


def decimal_text(value: Fraction, rng: np.random.Generator) -> str:
    """`value` (a multiple of 1/1000) with 0..3 more trailing zeros than it needs."""
    text = f"{float(value):.3f}".rstrip("0").rstrip(".")
    zeros = int(rng.integers(0, 3))
    return text + ("." if "." not in text and zeros else "") + "0" * zeros


def test_reachable_matches_a_search() -> None:
    for digits in range(1, 60):
        spelled = [v for v in range(801) if str(v).startswith(str(digits))]  # completions up to 800
        for low in range(0, 700, 7):
            for high in range(low, 800, 13):
                for multiple in (1, 3, 7, 40):
                    found = any(low <= v <= high and v % multiple == 0 for v in spelled)
                    assert reachable(digits, False, low, high, multiple) == found, (digits, low, high, multiple)


def test_multiples_agree_with_the_values(rng: np.random.Generator) -> None:
    """multipleOf over random steps and ranges (open ends too): each integer text in [-300, 300]
    and "-0" is whole exactly when it is an in-range multiple, every prefix of one is taken, and
    random walks end in values jsonschema admits."""
    for _ in range(30):
        step = int(rng.integers(2, 40))
        low, high = sorted(int(v) for v in rng.integers(-250, 250, 2))
        schema: dict[str, Any] = {"type": str(rng.choice(["integer", "number"])), "multipleOf": step}
        schema |= {} if rng.random() < 0.2 else {"minimum": low}
        schema |= {} if rng.random() < 0.2 else {"maximum": high}
        if "minimum" in schema and "maximum" in schema and not any(v % step == 0 for v in range(low, high + 1)):
            continue
        for value in [*range(-300, 301), "-0"]:
            text = str(value).encode()
            admitted = admits(schema, int(value))
            assert recognised(schema, text) == admitted, (schema, text)
            if admitted:
                assert all(Matcher(compile_schema(schema)).feed(text[:i]) for i in range(1, len(text)))
        for _ in range(5):
            text = random_text(schema, rng, limit=40)
            if text is not None:
                jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(("step", "value", "ok"), [(0.5, 3, True), (1.5, 6, True), (1.5, 4, False), (2.0, 4, True)])
def test_fractional_steps_on_integers(step: float, value: int, ok: bool) -> None:
    """An integer is a multiple of p / q exactly when it is one of p."""
    schema = {"type": "integer", "multipleOf": step}
    assert recognised(schema, str(value).encode()) == ok == admits(schema, value)


@pytest.mark.parametrize("bounds", [(0, 3), (2, 2), (1, None)])
def test_string_lengths_count_characters(bounds: tuple[int, int | None], rng: np.random.Generator) -> None:
    """Characters as Python counts them: multi-byte UTF-8 and escapes are one each."""
    low, high = bounds
    node = compile_schema({"type": "string", "minLength": low, **({"maxLength": high} if high is not None else {})})
    alphabet = ["a", "é", "€", "😀", '\\"', "\\n", "\\u00e9", "\\\\"]
    for _ in range(300):
        body = "".join(alphabet[int(i)] for i in rng.integers(0, len(alphabet), int(rng.integers(0, 6))))
        text = f'"{body}"'.encode()
        chars = len(json.loads(text))
        matcher = Matcher(node)
        assert (matcher.feed(text) and matcher.can_end) == (chars >= low and (high is None or chars <= high)), text
    assert not Matcher(node).feed(b'"\\ud83d')  # a surrogate pair would be two escapes but one character


def test_undeclared_keys_never_repeat_a_declared_one() -> None:
    """With additionalProperties, an undeclared key spelling a declared name (even with escapes)
    is refused: its value would be checked against the declared schema."""
    for data, ok in [(b'{"id":1,"x":2.5}', True), (b'{"id":1,"id":2.5}', False), (b'{"id":1,"\\u0069d":2.5}', False),
                     (b'{"id":1,"idx":2}', True), (b'{"x":1}', False)]:
        assert recognised(NUMBERS_BY_ID, data) == ok, data


# An object whose optional child is another such object or {"x": 1}: {"x": 1} could be either, and
# the overlap shows only once the reference it meets while being compiled is whole.
RECURSIVE_ONE_OF_OVERLAP = {"$defs": {"n": {"type": "object", "properties": {"c": {"oneOf": [
    {"$ref": "#/$defs/n"}, {"type": "object", "properties": {"x": {"const": 1}}, "required": ["x"]}]}}}},
    "$ref": "#/$defs/n"}


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "string", "pattern": "^(?=a)"}, "lookaround is not supported"),
    ({"type": "string", "pattern": "(a)\\1"}, "backreferences are not supported"),
    ({"type": "string", "pattern": "a\\bc"}, "word boundaries are not supported"),
    ({"type": "string", "pattern": "a^b"}, "anchors are supported only at the start and end"),
    ({"type": "string", "pattern": "^a{5}$", "maxLength": 3}, "no string of the allowed lengths"),
    ({"type": "string", "pattern": "[b-a]"}, "out of order"),
    ({"type": "string", "pattern": "a(?i)b"}, "inline flags such as (?i) must open the pattern"),
    ({"type": "string", "pattern": "(?m)^a"}, "the inline flag 'm' is not supported"),
    ({"type": "string", "pattern": "(?)a"}, "(?) sets no flag"),
    ({"type": "string", "pattern": "(?i-i:a)"}, "cannot be turned both on and off"),
    ({"type": "string", "pattern": "^a+$", "minLength": 10**6}, "past 65536 characters"),
    ({"type": "number", "exclusiveMinimum": 10**400}, "no number lies within the bounds"),
    ({"type": "integer", "exclusiveMaximum": -(10**400)}, "no number lies within the bounds"),
    ({"type": "string", "pattern": "(ab"}, "unbalanced parenthesis"),
    ({"type": "string", "pattern": "^a", "format": "date"}, "no string matches pattern '^a' and pattern"),
    ({"type": "number", "minimum": 2, "exclusiveMaximum": 2}, "no number lies within the bounds"),
    ({"type": "number", "multipleOf": 0.01}, "only whole steps are supported"),
    ({"type": "integer", "multipleOf": 0}, "'multipleOf' must be a number > 0"),
    ({"type": "integer", "multipleOf": 7, "minimum": 1, "maximum": 6}, "no multiple of 7 lies within the bounds"),
    ({"type": "number", "maximum": "1"}, "'maximum' must be a finite number"),
    ({"type": "string", "minItems": 1}, "does not apply to type string"),
    ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, "allOf of more than one schema"),
    ({"$ref": "other.json#/a"}, "only references inside the schema"),
    ({"$ref": "#/$defs/missing"}, "points at nothing"),
    ({"type": "object", "properties": {}, "required": ["a"]}, "'a' is not in properties"),
    ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2}, "no array length fits"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "maxLength is below minLength"),
    ({"type": "integer", "minimum": 3, "maximum": 2.5}, "no integer lies within the bounds"),
    ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}}, "$ref": "#/$defs/a"}, "refers to itself"),
    ({"type": "stringy"}, "must be one of object"),
    ({"type": "object", "not": {}}, "'not': it is not supported"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "a value could match two of"),
    ({"oneOf": [{"enum": [1, 2]}, {"const": 2.0}]}, "a value could match two of"),
    ({"oneOf": [PET["oneOf"][0], {"type": "object"}]}, "a value could match two of"),
    (RECURSIVE_ONE_OF_OVERLAP, "a value could match two of"),
    ({"enum": []}, "non-empty list"),
    ({"type": "integer", "enum": ["a"]}, "no enum / const value has the schema's type"),
    ([1], "a schema must be an object"),
])
def test_unsupported_schemas_are_refused_with_one_line(schema: Any, message: str) -> None:
    with pytest.raises(SchemaError, match="json schema: .*") as caught:
        compile_schema(schema)
    assert message in str(caught.value) and "\n" not in str(caught.value)


PATTERNS = [r"^[a-z]+\d{2,3}$", r"ab|cd", r"^(?:x|yz)*$", r"^\w+@\w+\.com$", r"[^abc]", r"^.{2,4}$", r"^\u00e9+$",
            r"^(a|b)?c{2}$", r"^\s*\S+$", r"^[\d-]+$", r"\.", r"^(?<y>\d{4})-x$", r"^[^\d\s]{1,3}$", r"0$|^1", r"^$"]
ALPHABET = ["a", "b", "c", "x", "y", "z", "0", "1", "9", "-", "@", ".", "é", "😀", " ", "\t", "_", "com"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_patterns_agree_with_python_re(pattern: str, rng: np.random.Generator) -> None:
    """On strings of ASCII, é and an emoji, written with and without escapes, a string is taken
    exactly when re.search with ASCII classes (ECMA-262's) finds the pattern in it; random walks end
    in strings re.search finds it in with Unicode classes too (jsonschema's reading)."""
    import re

    node = compile_schema({"type": "string", "pattern": pattern})
    for _ in range(20):
        walked = random_text({"type": "string", "pattern": pattern}, rng, limit=60)
        assert walked is None or re.search(pattern.replace("(?<", "(?P<"), json.loads(walked)), walked
    for _ in range(300):
        text = "".join(ALPHABET[int(i)] for i in rng.integers(0, len(ALPHABET), int(rng.integers(0, 7))))
        ascii_only = bool(rng.integers(0, 2)) and all(ord(c) <= 0xFFFF for c in text)  # pairs: refused escapes
        matcher = Matcher(node)
        taken = matcher.feed(json.dumps(text, ensure_ascii=ascii_only).encode()) and matcher.can_end
        expected = re.search(pattern.replace("(?<", "(?P<"), text, re.ASCII) is not None  # ECMA's classes; (?P<: Python's spelling
        assert taken == expected, (pattern, text)


FLAG_PATTERNS = [r"(?i)^[a-c]+x$", r"^a(?i:bc)d$", r"(?i)^k(?-i:k)$", r"(?s)^a.b$", r"^(?s:.)+$", r"(?i)^[^k]s$",
                 r"(?is)^.[^s]$", r"(?i)\w\W", r"(?i:S)|^x"]
FLAG_ALPHABET = ["a", "b", "c", "d", "x", "k", "K", "s", "S", "\n", "\u212a", "\u017f", "é", "É", "_", " "]


@pytest.mark.parametrize("pattern", FLAG_PATTERNS)
def test_inline_flags_agree_with_python_re(pattern: str, rng: np.random.Generator) -> None:
    """(?i) and (?s), global and scoped: on ASCII strings a string is taken exactly when re.search
    finds the pattern; on any string (the Kelvin sign, the long s, é) only where re.search does (a
    character takes its other case only where every reading of the pattern agrees); random walks
    end in strings re.search finds it in."""
    import re

    schema = {"type": "string", "pattern": pattern}
    node = compile_schema(schema)
    for _ in range(20):
        walked = random_text(schema, rng, limit=60)
        assert walked is None or re.search(pattern, json.loads(walked)), walked
    for _ in range(300):
        text = "".join(FLAG_ALPHABET[int(i)] for i in rng.integers(0, len(FLAG_ALPHABET), int(rng.integers(0, 5))))
        matcher = Matcher(node)
        taken = matcher.feed(json.dumps(text, ensure_ascii=bool(rng.integers(0, 2))).encode()) and matcher.can_end
        found = re.search(pattern.replace("$", r"\Z"), text) is not None  # ECMA's $: Python's takes a final line end
        assert taken == found if text.isascii() else (not taken or found), (pattern, text)


def test_a_whole_text_regex_takes_inline_flags() -> None:
    """vLLM's regex (the whole text, not a search) reads the flags the same way."""
    from atlas.json_match import Text
    from atlas.json_regex import compile_regex

    def whole(pattern: str, text: str) -> bool:
        matcher = Matcher(Text(compile_regex(pattern, search=False)))
        return matcher.feed(text.encode()) and matcher.can_end

    assert whole("(?i)yes|no", "YeS") and whole("(?i)yes|no", "NO") and not whole("(?i)yes|no", "yes!")
    assert whole("(?s)a.+", "a\nb") and not whole("a.+", "a\nb")


@pytest.mark.parametrize(("pattern", "text", "ok"), [
    (r"(?i)^k$", "K", True), (r"(?i)^k$", "\u212a", False),  # the Kelvin sign: k to Python and ECMA's u mode only
    (r"(?i)^s$", "\u017f", False), (r"(?i)^é$", "É", True), (r"(?i)^[^k]$", "\u212a", False),
    (r"(?i)^[^s]$", "\u017f", False), (r"^(?i:a)a$", "AA", False), (r"(?s)^.$", "\u2028", True), (r"^.$", "\r", False),
    (r"(?i)^[^a-z]$", "\u0130", False),  # İ: Python's re folds it onto i (its one-character lower case)
    (r"(?i)^\u1f88$", "\u1f80", False),  # upper case of two characters: ECMA-262 without u keeps the letter
    (r"^(?i:\ud801\udc00)$", "\U00010428", False),  # past the BMP: UTF-16 units, no case without u
])
def test_ignoring_case_keeps_to_what_every_reading_admits(pattern: str, text: str, ok: bool) -> None:
    assert recognised({"type": "string", "pattern": pattern}, json.dumps(text).encode()) == ok


@pytest.mark.parametrize(("pattern", "text", "ok"), [
    (r"^\D$", "۷", False), (r"^[^\d]$", "۷", False), (r"^\D$", "a", True),  # U+06F7: a digit to Python, not ECMA
    (r"^\d$", "۷", False), (r"^\w$", "é", False), (r"^[^\W]$", "é", False), (r"^\S$", "\ufeff", False),
    (r"^\s$", "\u2003", True), (r"^\s$", "\ufeff", False),  # U+FEFF: a space to ECMA, not Python
])
def test_shorthands_keep_to_what_every_reading_admits(pattern: str, text: str, ok: bool) -> None:
    """\\d, \\w, \\s mean ASCII to ECMA-262 and Unicode to Python / Rust: generated strings match under both."""
    assert recognised({"type": "string", "pattern": pattern}, json.dumps(text, ensure_ascii=False).encode()) == ok


@pytest.mark.parametrize(("pattern", "low", "high"), [
    (r"^[a-z]+\d{2,3}$", 4, 6), (r"^(?:x|yz)*$", 3, 5), (r"b", 2, None), (r"^.{2,9}$", 0, 3), (r"^\S+$", 1, 2)])
def test_patterns_with_lengths_never_stall(pattern: str, low: int, high: int | None, rng: np.random.Generator) -> None:
    """Random walks under a pattern and length bounds always find a next byte and end in strings
    jsonschema admits: a prefix is taken only while some way to finish it remains."""
    schema = {"type": "string", "pattern": pattern, "minLength": low, **({"maxLength": high} if high is not None else {})}
    for _ in range(40):
        text = random_text(schema, rng, limit=80)
        if text is not None:
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(("form", "good", "bad"), [
    ("date", "2024-12-31", ["2024-02-30", "2024-13-01", "24-01-01", "0000-06-09"]),
    ("time", "23:59:59.5+01:00", ["24:00:00Z", "12:00:00"]),
    ("date-time", "2024-01-02T03:04:05Z", ["2024-01-02 03:04:05Z"]),
    ("uuid", "123e4567-e89b-12d3-a456-426614174000", ["123e4567e89b12d3a456426614174000"]),
    ("ipv4", "192.168.0.255", ["256.0.0.1", "1.2.3"]),
    ("email", "a.b+c@d-e.org", ["a@b", ".a@b.c"]),
    ("hostname", "a-b.example", ["-a.b", "a_b.c"]),
    ("uri", "https://x.org/a?b=c", ["no scheme", "http://a b"]),
])
def test_formats(form: str, good: str, bad: list[str], rng: np.random.Generator) -> None:
    """The formats generation follows: an example is taken, broken ones are not, and random walks
    end in strings jsonschema's format checker admits (where it checks that format)."""
    schema = {"type": "string", "format": form}
    assert recognised(schema, json.dumps(good).encode())
    for text in bad:
        assert not recognised(schema, json.dumps(text).encode()), text
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    for _ in range(10):
        text = random_text(schema, rng, limit=120)
        if text is not None:
            assert checker.is_valid(json.loads(text)), text


@pytest.mark.parametrize(("form", "pattern", "good", "bad"), [
    ("date", r"^2026-0[1-6]", "2026-03-31", ["2026-07-01", "2025-03-01", "2026-02-30"]),
    ("email", r"@example\.org$", "a.b@example.org", ["a@example.com", "@example.org"]),
    ("uuid", r"^0{8}", "00000000-aaaa-bbbb-cccc-0123456789ab", ["10000000-aaaa-bbbb-cccc-0123456789ab"]),
])
def test_pattern_beside_a_format_takes_both(form: str, pattern: str, good: str, bad: list[str],
                                            rng: np.random.Generator) -> None:
    """The strings both the pattern and the format admit (their NFAs' product): an example is
    taken, ones either refuses are not, and random walks end in strings jsonschema's format
    checker and Python's re.search both admit."""
    schema = {"type": "string", "format": form, "pattern": pattern, "maxLength": 60}
    assert recognised(schema, json.dumps(good).encode())
    for text in bad:
        assert not recognised(schema, json.dumps(text).encode()), text
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    ended = 0
    for _ in range(20):
        text = random_text(schema, rng, limit=120)
        if text is not None:
            ended += 1
            value = json.loads(text)
            assert checker.is_valid(value) and re.search(pattern, value), value
    assert ended >= 5


def test_unknown_formats_are_annotations() -> None:
    assert recognised({"type": "string", "format": "color"}, b'"anything"')


def test_annotations_are_ignored() -> None:
    schema = {"type": "boolean", "title": "t", "description": "d", "x-vendor": {"pattern": "x"}, "examples": [True]}
    assert recognised(schema, b"true") and not recognised(schema, b'"x"')


@pytest.mark.parametrize(("data", "ok"), [
    (b"</think>{}", True), (b"thinking about {braces}</think>\n\n{}", True), (b"</thi</think>{}", True),
    (b"<</think>\n{}", True), (b"</think></think>{}", False),  # the first marker ends the free text
    (b"</think>\n\n\n\n{}", True), (b"</think>\n\n\n\n\n{}", False), (b"</think> {}", False),
    (b"{}", False), (b"</think>", False), (b"</think>[]", False),
])
def test_json_after_a_marker(data: bytes, ok: bool, rng: np.random.Generator) -> None:
    """Free text up to the first marker, up to four line breaks, then the value; fed whole or in
    random pieces (the marker may be split across tokens)."""
    for _ in range(5):
        matcher = Matcher(AfterMarker(b"</think>", ANY_OBJECT))
        cuts = sorted(int(c) for c in rng.integers(0, len(data) + 1, int(rng.integers(0, 5))))
        fed = all(matcher.feed(data[a:b]) for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True))
        assert (fed and matcher.complete) == ok, (data, cuts)


# --- generation on the demo model --------------------------------------------------------------
@pytest.fixture(scope="module")
def demo() -> Any:
    from atlas import LLM

    return LLM(device="cpu", prompt_cache=0)


def test_greedy_schema_output_on_the_demo(demo: Any, rng: np.random.Generator) -> None:
    """Each greedy token is the most likely token the schema allows under the teacher-forced
    logits; a text that stops is a document the schema admits."""
    from atlas.structured import OutputConstraint, output_shape

    tokenizer, eos = demo.tokenizer, demo.eos_ids()
    for schema in (PERSON, PAIR, MEASURE):
        prompt = rng.integers(3, 512, int(rng.integers(2, 20))).tolist()
        result = demo.generate(prompt, max_tokens=60, json_schema=schema)
        if result.finish_reason == "stop":
            jsonschema.validate(json.loads(result.text), schema)
        assert_greedy_allowed(demo, prompt, result.token_ids, OutputConstraint(tokenizer.token_bytes, eos, output_shape(schema)))


def test_sampled_schema_output_on_the_demo(demo: Any, rng: np.random.Generator) -> None:
    """Sampled texts that stop are documents the schema admits; the same from generate() and
    stream()."""
    stopped = 0
    for seed in range(6):
        prompt = rng.integers(3, 512, int(rng.integers(2, 20))).tolist()
        options = {"max_tokens": 80, "temperature": 1.0, "seed": seed, "json_schema": TREE, "top_p": 0.95}
        result = demo.generate(prompt, **options)
        assert "".join(demo.stream(prompt, **options)) == result.text
        if result.finish_reason == "stop":
            jsonschema.validate(json.loads(result.text), TREE)
            stopped += 1
    assert stopped, "no sampled document was closed"


def test_generate_refuses_bad_schema_options(demo: Any) -> None:
    from atlas.errors import AtlasError

    with pytest.raises(SchemaError, match="lookaround"):
        demo.generate("Flat is", json_schema={"type": "string", "pattern": "(?!x)"})
    with pytest.raises(AtlasError, match="exclude each other"):
        demo.generate("Flat is", json_schema={}, json_object=True)


def test_output_after_on_the_demo(demo: Any) -> None:
    """output_after: the free text is the plain greedy text up to the marker; JSON follows it."""
    plain = demo.generate("Beautiful", max_tokens=12).text
    marker = plain[: plain.index(" is") + 3]  # the demo writes "Beautiful is better than ugly."
    result = demo.generate("Beautiful", max_tokens=40, json_object=True, output_after=" is")
    assert result.text.startswith(marker)
    rest = result.text[len(marker) :].lstrip("\n")
    assert rest.startswith("{") and len(result.text) - len(marker) - len(rest) <= 4
    if result.finish_reason == "stop":
        assert isinstance(json.loads(rest), dict)


# --- regex and choice (vLLM's structured outputs) ------------------------------------------------
@pytest.mark.parametrize(("pattern", "text", "ok"), [
    (r"[a-z]{2,5} \d{1,3}", "abc 12", True), (r"[a-z]{2,5} \d{1,3}", "xabc 12y", False),  # the whole text
    (r"(yes|no)!?", "no!", True), (r"é+|😀", "ééé", True), (r"é+|😀", "😀😀", False), (r".*", "", True),
    (r"\w+\n\d", "a\n1", True), (r"[^\n]+", "a\nb", False),
])
def test_regex_texts(pattern: str, text: str, ok: bool) -> None:
    """regex: raw text (no quotes, no escapes) that the pattern matches whole."""
    from atlas.structured import OutputFormat

    matcher = Matcher(OutputFormat("regex", pattern).shape())
    assert (matcher.feed(text.encode()) and matcher.can_end) == ok
    assert not Matcher(OutputFormat("regex", pattern).shape()).feed(b"\xc3\x28")  # broken UTF-8 never


def test_regex_and_choice_on_the_demo(demo: Any, rng: np.random.Generator) -> None:
    """Greedy under a regex or a choice: each token the best allowed one; a stopped text matches
    the pattern whole or is one of the choices. Sampled texts keep to them too."""
    import re

    from atlas.structured import OutputConstraint, OutputFormat

    tokenizer, eos = demo.tokenizer, demo.eos_ids()
    choices = ["better", "worse than ugly", "é 😀"]
    for kind, spec, check in (("regex", r"[a-z ]{3,12}\.", lambda t: re.fullmatch(r"[a-z ]{3,12}\.", t)),
                              ("choice", choices, lambda t: t in choices)):
        prompt = rng.integers(3, 512, int(rng.integers(2, 20))).tolist()
        result = demo.generate(prompt, max_tokens=30, **{kind: spec})
        assert result.finish_reason == "stop" and check(result.text), result.text
        shape = OutputFormat.of(**{kind: spec}).shape()  # type: ignore[union-attr]
        assert_greedy_allowed(demo, prompt, result.token_ids, OutputConstraint(tokenizer.token_bytes, eos, shape))
        for seed in range(3):
            sampled = demo.generate(prompt, max_tokens=30, temperature=1.0, seed=seed, **{kind: spec})
            assert sampled.finish_reason == "length" or check(sampled.text), sampled.text


@pytest.mark.parametrize(("options", "message"), [
    ({"regex": "(?=a)"}, "lookaround"), ({"choice": []}, "non-empty list"), ({"choice": ["a", ""]}, "non-empty strings"),
    ({"regex": 5}, "regex must be a string"), ({"regex": "a", "choice": ["a"]}, "exclude each other"),
    ({"output_after": "x"}, "needs an output format"), ({"json_object": True, "output_after": ""}, "non-empty string"),
])
def test_bad_output_formats(demo: Any, options: dict[str, Any], message: str) -> None:
    from atlas.errors import AtlasError

    with pytest.raises(AtlasError, match=message):
        demo.generate("Flat is", **options)


@pytest.mark.parametrize("schema", [
    {"oneOf": [{"type": "string"}, {"type": "number", "minimum": 0}]},
    {"oneOf": [{"type": "null"}, {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5}]},  # Optional[confloat]
    {"oneOf": [{"type": "object"}, {"type": "number", "maximum": 10.5}, {"type": "array"}]},
])
def test_one_of_types_apart_is_accepted(schema: dict[str, Any]) -> None:
    """Alternatives of different JSON types never overlap, a bounded number included."""
    compile_schema(schema)


def test_a_recursive_reference_under_one_of_matches(rng: np.random.Generator) -> None:
    """oneOf's overlap check waits until the reference it holds is compiled (checked while it was
    being compiled, the reference had no options yet)."""
    from atlas.json_match import Matcher

    node = {"type": "object", "properties": {"c": {"oneOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}, "required": ["c"]}
    shape = compile_schema({"$defs": {"n": node}, "$ref": "#/$defs/n"})
    depth = int(rng.integers(0, 6))
    text = '{"c":' * (depth + 1) + "null" + "}" * (depth + 1)
    assert Matcher(shape).feed(text.encode()) and not Matcher(shape).feed(b'{"c":3')
