"""JSON schema -> the shape atlas.json_match matches (OpenAI's response_format json_schema, vLLM's
guided JSON). Generation keeps to a subset of what the schema admits, so every text it ends is
valid; anything the subset cannot honour is refused with one line naming the keyword and where.

Supported: type (a name or a list), enum, const, anyOf, oneOf (when no value can match two of its
alternatives: their JSON types differ, or their objects share a required property whose const /
enum values differ, as a pydantic discriminated union's do), allOf of one schema, $ref to a JSON pointer inside the document
("#", "#/$defs/…"; recursion through objects or arrays), and per type:
  object   properties (written in their declared order; an optional one may be left out),
           required, additionalProperties (false / true / a schema; absent: none when properties
           are declared, any otherwise),
  array    items (a schema or false), prefixItems, minItems, maxItems,
  string   minLength, maxLength (characters), pattern (atlas.json_regex's subset), format (FORMATS;
           others are annotations; beside a pattern, strings both admit),
  integer  minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf,
  number   the same bounds (then written as a plain decimal, no exponent: atlas.json_number); a
           whole multipleOf (then written as an integer),
  boolean, null.
Annotations (title, description, default, examples, any keyword that does not validate) are ignored."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from typing import Any

from .errors import AtlasError
from .json_match import ANY_VALUE, Array, Literal, Node, Number, Object, String, Union, alternatives
from .json_number import DecimalRange, Interval, is_finite_number, parsed_float
from .json_regex import RegexError, compile_patterns
from .json_text import unpaired_surrogate_path

_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_YEAR = r"(000[1-9]|00[1-9]\d|0[1-9]\d\d|[1-9]\d{3})"  # 0001..9999: Python's date (jsonschema's check) has no year 0
_DAY = r"((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)|02-(0[1-9]|1\d|2[0-8]))"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,6})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
# String formats written as patterns (each a subset of the format: dates skip 29 February and year 0000);
# other formats are annotations, as JSON schema makes them by default.
FORMATS = {
    "date": rf"^{_YEAR}-{_DAY}$",
    "time": rf"^{_TIME}$",
    "date-time": rf"^{_YEAR}-{_DAY}T{_TIME}$",
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$",
    "email": r"^[A-Za-z0-9_%+-]+(\.[A-Za-z0-9_%+-]+)*@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+$",
    "hostname": rf"^{_LABEL}(\.{_LABEL})*$",
    "uri": r"^[A-Za-z][A-Za-z0-9+.-]*:[^\s\"<>\\^`{|}]+$",
}

# JSON Schema 2020-12's validation keywords (and draft 7's); any other keyword is an annotation
# (title, description, default, $defs, ...), which no validator reads and generation ignores.
VALIDATION = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "maxContains",
    "minContains", "contains", "items", "prefixItems", "additionalItems", "unevaluatedItems", "maxProperties",
    "minProperties", "required", "dependentRequired", "dependentSchemas", "dependencies", "properties",
    "patternProperties", "additionalProperties", "unevaluatedProperties", "propertyNames", "if", "then", "else",
    "not", "allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "$recursiveRef", "contentEncoding", "contentMediaType",
})
TYPE_KEYWORDS = {
    "object": frozenset({"properties", "required", "additionalProperties"}),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems"}),
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "integer": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "boolean": frozenset(),
    "null": frozenset(),
}
COMBINERS = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")
MAX_PROPERTIES = 1024  # declared properties of one object (docs/structured-output.md)


class SchemaError(AtlasError):
    """A schema this generator cannot follow; the message names the place and the keyword."""


def compile_schema(schema: Any) -> Node:
    """The shape of the texts `schema` admits (a JSON schema as parsed JSON)."""
    where = unpaired_surrogate_path(schema)  # no UTF-8 text holds it: no output could match
    if where is not None:
        raise SchemaError(f"json schema: {where or 'a key of the schema'} holds an unpaired UTF-16 surrogate; "
                          "write the text as UTF-8 or with paired \\u escapes")
    return SchemaCompiler(schema).root


class SchemaCompiler:
    def __init__(self, document: Any) -> None:
        self.document = document
        self.refs: dict[str, Union] = {}
        self.one_ofs: list[tuple[str, list[Node]]] = []  # checked once every reference is compiled
        self.root = self.node(document, "#")
        for pointer, union in self.refs.items():
            try:
                union.flat()
            except ValueError as err:
                raise SchemaError(f"json schema: {pointer}: {err}") from None
        for where, options in self.one_ofs:
            if not all_disjoint(options):
                raise self.fail(where, "alternatives a value could match two of (which oneOf forbids) are not "
                                "supported; use anyOf, or give the objects a required const property that differs")

    def fail(self, where: str, problem: str) -> SchemaError:
        return SchemaError(f"json schema: {where}: {problem}")

    def node(self, schema: Any, where: str) -> Node:
        if schema is True:
            return ANY_VALUE
        if not isinstance(schema, dict) or not all(isinstance(k, str) for k in schema):
            raise self.fail(where, f"a schema must be an object (or true), got {json.dumps(schema)[:60]}")
        keys = set(schema) & VALIDATION
        combiner = next((k for k in COMBINERS if k in keys), None)
        if combiner is not None:
            return self.combined(schema, combiner, keys, where)
        types = self.types(schema, keys, where)
        if types is None:
            return ANY_VALUE
        nodes = [self.typed(schema, kind, f"{where}/type") for kind in types]
        return nodes[0] if len(nodes) == 1 else Union(nodes)

    def combined(self, schema: dict[str, Any], combiner: str, keys: set[str], where: str) -> Node:
        if combiner in ("enum", "const"):
            return self.literal(schema, keys, where)
        others = keys - {combiner}
        if others:
            raise self.fail(where, f"'{sorted(others)[0]}' beside '{combiner}' is not supported; "
                            f"move it into the {combiner} target")
        value = schema[combiner]
        if combiner == "$ref":
            return self.ref(value, f"{where}/$ref")
        if not isinstance(value, list) or not value:
            raise self.fail(f"{where}/{combiner}", "must be a non-empty list of schemas")
        if combiner == "allOf":
            if len(value) != 1:
                raise self.fail(f"{where}/allOf", "allOf of more than one schema is not supported")
            return self.node(value[0], f"{where}/allOf/0")
        options = [self.node(item, f"{where}/{combiner}/{i}") for i, item in enumerate(value)]
        if combiner == "oneOf":
            self.one_ofs.append((f"{where}/oneOf", options))
        return Union(options)

    def literal(self, schema: dict[str, Any], keys: set[str], where: str) -> Node:
        extra = keys - {"enum", "const", "type"}
        if extra or ("enum" in keys and "const" in keys):
            raise self.fail(where, f"'{sorted(extra or {'const'})[0]}' beside 'enum' / 'const' is not supported")
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values:
            raise self.fail(f"{where}/enum", "must be a non-empty list")
        types = self.types(schema, {"type"} & keys, where)
        kept = [v for v in values if types is None or any(json_type_matches(v, t) for t in types)]
        if not kept:
            raise self.fail(where, "no enum / const value has the schema's type")
        try:
            return Literal(json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode() for v in kept)
        except ValueError:
            raise self.fail(where, "NaN and Infinity are not JSON values") from None

    def types(self, schema: dict[str, Any], keys: set[str], where: str) -> list[str] | None:
        """The types the schema names (inferred from its keywords when it names none; None: any)."""
        declared = schema.get("type")
        if declared is None:
            inferred = [t for t, words in TYPE_KEYWORDS.items() if words & keys]
            types = inferred or None
        else:
            types = [declared] if isinstance(declared, str) else declared
            if not isinstance(types, list) or not types or not all(isinstance(t, str) and t in TYPE_KEYWORDS for t in types):
                raise self.fail(f"{where}/type", f"must be one of {', '.join(TYPE_KEYWORDS)} or a list of them, "
                                f"got {json.dumps(declared)}")
        allowed = frozenset({"type"}).union(*(TYPE_KEYWORDS[t] for t in types or ()))
        for key in sorted(keys - allowed):
            typed = key in set().union(*TYPE_KEYWORDS.values())
            reason = f"it does not apply to type {'/'.join(types)}" if typed else "it is not supported"
            raise self.fail(where, f"'{key}': {reason}")
        return types

    def typed(self, schema: dict[str, Any], kind: str, where: str) -> Node:
        base = where.rsplit("/", 1)[0]
        if kind == "object":
            return self.object(schema, base)
        if kind == "array":
            return self.array(schema, base)
        if kind == "string":
            return self.string(schema, base)
        if kind in ("integer", "number") and not number_bounds(schema).readable():
            raise self.fail(base, "no number lies within the bounds (an exclusive bound past the largest double "
                            "reads as infinity to a validator, and no number passes it)")
        if kind == "integer" or (kind == "number" and "multipleOf" in schema):
            return self.integer(schema, kind, base)
        if kind == "number":
            interval = number_bounds(schema)
            if interval.empty():
                raise self.fail(base, "no number lies within the bounds")
            return Number() if interval == Interval() else DecimalRange(interval)
        return Literal((b"true", b"false") if kind == "boolean" else (b"null",))

    def integer(self, schema: dict[str, Any], kind: str, where: str) -> Node:
        """An integer within the bounds, a multiple of multipleOf: for a step p / q (lowest terms)
        the integers that are multiples are those of p. A number with a whole step is
        written as an integer; a fractional step on numbers is refused (validators disagree on
        which decimals are multiples of 0.1 in binary floating point)."""
        low, high = integer_bounds(schema)
        multiple = 1
        if "multipleOf" in schema:
            step = schema["multipleOf"]
            if not is_finite_number(step) or step <= 0:
                raise self.fail(where, "'multipleOf' must be a number > 0")
            exact = Fraction(str(step)) if isinstance(step, float) else Fraction(step)
            if kind == "number" and exact.denominator != 1:
                raise self.fail(where, f"'multipleOf' {step} on type number: only whole steps are supported "
                                "(or type integer)")
            multiple = exact.numerator
        first = None if low is None else -(-low // multiple) * multiple  # the first multiple from low on
        if first is not None and high is not None and first > high:
            raise self.fail(where, "no integer lies within the bounds" if multiple == 1 else
                            f"no multiple of {multiple} lies within the bounds")
        return Number(integer=True, low=low, high=high, multiple=multiple)

    def string(self, schema: dict[str, Any], where: str) -> Node:
        low, high = self.count(schema, "minLength", where) or 0, self.count(schema, "maxLength", where)
        if high is not None and high < low:
            raise self.fail(where, "maxLength is below minLength")
        pattern, form = schema.get("pattern"), schema.get("format")
        if pattern is not None and not isinstance(pattern, str):
            raise self.fail(f"{where}/pattern", "must be a string")
        patterns = [p for p in (pattern, FORMATS.get(form) if isinstance(form, str) else None) if p is not None]
        if not patterns:
            return String(low, high)
        try:  # a pattern beside a format: the strings both admit (the product of their NFAs)
            return String(low, high, regex=compile_patterns(patterns, low, high))
        except RegexError as err:
            raise self.fail(f"{where}/pattern" if pattern is not None else where, str(err)) from None

    def object(self, schema: dict[str, Any], where: str) -> Node:
        properties = schema.get("properties", {})
        if not isinstance(properties, dict):
            raise self.fail(f"{where}/properties", "must be an object of name -> schema")
        if len(properties) > MAX_PROPERTIES:  # the key matcher after each optional one grows with the rest
            raise self.fail(f"{where}/properties", f"has {len(properties)} properties; at most {MAX_PROPERTIES} are "
                            "supported")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise self.fail(f"{where}/required", "must be a list of property names")
        missing = [r for r in required if r not in properties]
        if missing:
            raise self.fail(f"{where}/required", f"'{missing[0]}' is not in properties; declare it there")
        additional = schema.get("additionalProperties", None if properties else True)
        extra = None if additional in (None, False) else self.node(additional, f"{where}/additionalProperties")
        declared = [(name, self.node(sub, f"{where}/properties/{escape_pointer(name)}"), name in required)
                    for name, sub in properties.items()]
        return Object(declared, extra)

    def array(self, schema: dict[str, Any], where: str) -> Node:
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise self.fail(f"{where}/prefixItems", "must be a list of schemas")
        nodes = [self.node(sub, f"{where}/prefixItems/{i}") for i, sub in enumerate(prefix)]
        items_schema = schema.get("items", True)
        items = None if items_schema is False else self.node(items_schema, f"{where}/items")
        low, high = self.count(schema, "minItems", where) or 0, self.count(schema, "maxItems", where)
        longest = high if items is not None else min(len(nodes), len(nodes) if high is None else high)
        if longest is not None and longest < low:
            raise self.fail(where, "no array length fits minItems, maxItems and the items")
        return Array(nodes, items, low, high)

    def count(self, schema: dict[str, Any], key: str, where: str) -> int | None:
        value = schema.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise self.fail(f"{where}/{key}", f"must be an integer >= 0, got {json.dumps(value)}")
        return value

    def ref(self, pointer: Any, where: str) -> Node:
        if not isinstance(pointer, str) or not pointer.startswith("#"):
            raise self.fail(where, f"only references inside the schema (\"#/...\") are supported, got {json.dumps(pointer)}")
        if pointer not in self.refs:
            self.refs[pointer] = Union()  # filled below; a recursive reference finds it here
            self.refs[pointer].options = (self.node(self.resolve(pointer, where), pointer),)
        return self.refs[pointer]

    def resolve(self, pointer: str, where: str) -> Any:
        target = self.document
        for part in pointer[1:].split("/")[1:] if pointer != "#" else []:
            name = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and name in target:
                target = target[name]
            elif isinstance(target, list) and name.isdigit() and int(name) < len(target):
                target = target[int(name)]
            else:
                raise self.fail(where, f"{pointer} points at nothing in the schema")
        return target


def all_disjoint(options: list[Node]) -> bool:
    """No two of the shapes share a value: in one pass when all are const / enum (thousands of
    them: the pairwise check took minutes), else pair by pair."""
    if not all(const_only(option) for option in options):
        return all(disjoint(a, b) for i, a in enumerate(options) for b in options[i + 1 :])
    seen: set[str] = set()
    for option in options:
        values = literal_values(option)
        if seen & values:
            return False
        seen |= values
    return True


def disjoint(a: Node, b: Node) -> bool:
    """No JSON value matches both shapes (provably: False when unsure)."""
    if const_only(a) and const_only(b):
        return not literal_values(a) & literal_values(b)
    kinds_a, kinds_b = kinds(a), kinds(b)
    if "?" in kinds_a | kinds_b or (kinds_a & kinds_b) - {"object"}:
        return False
    return all(discriminated(x, y) for x in alternatives(a) for y in alternatives(b)
               if isinstance(x, Object) and isinstance(y, Object))


def const_only(node: Node) -> bool:
    """The shape is const / enum values alone."""
    return all(isinstance(x, Literal) for x in alternatives(node))


def kinds(node: Node) -> set[str]:
    """The JSON types a shape's values may have ("?": any, or not known)."""
    out: set[str] = set()
    for alt in alternatives(node):
        if isinstance(alt, Literal):
            out |= {json_kind(json.loads(text)) for text in alt.options}
        else:
            out.add({Object: "object", Array: "array", String: "string", Number: "number",
                     DecimalRange: "number"}.get(type(alt), "?"))
    return out


def discriminated(x: Object, y: Object) -> bool:
    """Some property both objects require takes values from disjoint const / enum sets."""
    for key, value, needed in zip(x.keys, x.values, x.required, strict=True):
        if needed and key in y.key_index and y.required[y.key_index[key]]:
            other = y.values[y.key_index[key]]
            if const_only(value) and const_only(other) and not literal_values(value) & literal_values(other):
                return True
    return False


def literal_values(node: Node) -> set[str]:
    """A const / enum shape's values, spelled so that values JSON schema counts equal (1 and 1.0)
    are spelled alike."""
    return {json.dumps(numbers_as_floats(json.loads(text)), sort_keys=True)
            for alt in alternatives(node) for text in alt.options}  # type: ignore[attr-defined]


def numbers_as_floats(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: numbers_as_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [numbers_as_floats(item) for item in value]
    return parsed_float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    return {dict: "object", list: "array", str: "string", type(None): "null"}.get(type(value), "number")


def check_bounds(schema: dict[str, Any]) -> None:
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        value = schema.get(key)
        if value is not None and not is_finite_number(value):  # null: absent, as for the other keywords
            raise SchemaError(f"json schema: '{key}' must be a finite number, got {json.dumps(value)}")


def number_bounds(schema: dict[str, Any]) -> Interval:
    """The interval of minimum / maximum / their exclusive forms (the tightest of each side),
    each bound the decimal its JSON text shows (repr of the parsed float)."""
    check_bounds(schema)
    exact = {key: Fraction(repr(schema[key])) for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
             if schema.get(key) is not None}
    lows = [(exact["minimum"], False)] if "minimum" in exact else []
    lows += [(exact["exclusiveMinimum"], True)] if "exclusiveMinimum" in exact else []
    highs = [(exact["maximum"], False)] if "maximum" in exact else []
    highs += [(exact["exclusiveMaximum"], True)] if "exclusiveMaximum" in exact else []
    low = max(lows, key=lambda bound: (bound[0], bound[1]), default=(None, False))  # equal: the open one is tighter
    high = min(highs, key=lambda bound: (bound[0], not bound[1]), default=(None, False))
    return Interval(low[0], high[0], low[1], high[1])


def integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The integer range [low, high] (None: open) of minimum / maximum / their exclusive forms."""
    check_bounds(schema)
    given = {key: value for key, value in schema.items() if value is not None}  # null: absent
    lows = [math.ceil(given["minimum"])] if "minimum" in given else []
    lows += [math.floor(given["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in given else []
    highs = [math.floor(given["maximum"])] if "maximum" in given else []
    highs += [math.ceil(given["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in given else []
    return (max(lows) if lows else None), (min(highs) if highs else None)


def json_type_matches(value: Any, kind: str) -> bool:
    checks = {
        "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    }
    return checks[kind](value)


def escape_pointer(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
