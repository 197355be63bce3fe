"""Tokenizer: `tokenizers` with tokenizer.json, incremental detokenisation for streaming, and the
chat template (tokenizer_config.json or chat_template.jinja) rendered with sandboxed jinja2."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, overload

from .config import read_json_object
from .errors import AtlasError
from .sampling import is_int

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
REPLACEMENT_CHAR = "\ufffd"


@dataclass
class Tokenizer:
    backend: Any  # tokenizers.Tokenizer
    source: Path  # the model directory
    chat_template: str | None = None
    chat_template_source: Path | None = None  # the file it was read from, named in its errors
    special_tokens: dict[str, str] = field(default_factory=dict)  # "eos_token" -> "<|im_end|>"
    template_defaults: dict[str, Any] = field(default_factory=dict)  # --chat-template-kwargs: under each call's own

    @classmethod
    def open(cls, model_dir: Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise AtlasError(f"{path} not found; the model directory needs its tokenizer.json")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises plain Exception subclasses on bad files
            raise AtlasError(f"{path} cannot be loaded ({first_line(err)}); re-download it") from None
        config = read_tokenizer_config(model_dir / "tokenizer_config.json")
        template, template_source = read_chat_template(model_dir, config)
        return cls(
            backend=backend,
            source=model_dir,
            chat_template=template,
            chat_template_source=template_source,
            special_tokens=read_special_tokens(model_dir / "tokenizer_config.json", config),
        )

    def with_chat_template(self, path: Path) -> Tokenizer:
        """This tokenizer with the chat template of a file instead of the model's (vLLM's --chat-template)."""
        from dataclasses import replace

        return replace(self, chat_template=read_template_file(path), chat_template_source=Path(path))

    # --- ids and text -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, key: str) -> int | None:
        """The id of a special token named in tokenizer_config.json ("eos_token"...), if any."""
        token = self.special_tokens.get(key)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id("bos_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise AtlasError(f"text to encode must be a str, got {type(text).__name__}")
        try:
            return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        except TypeError:  # tokenizers' answer to a str that is not valid Unicode
            raise AtlasError(f"the text is not valid Unicode ({unicode_problem(text)}); send UTF-8 text") from None
        except Exception as err:  # the file's model cannot encode it (a Unigram model without an unk id)
            raise AtlasError(f"{self.source / 'tokenizer.json'} cannot encode the text ({first_line(err)}); "
                             "fix or re-download the tokenizer") from None

    @functools.cached_property
    def token_bytes(self) -> list[bytes | None]:
        """Each id's bytes in decoded text (None: a special token, which decoded text leaves out).
        Byte-level BPE (Qwen's) maps each token's characters back to bytes, so a token holding part
        of a UTF-8 character has its exact bytes; other tokenizers decode each id alone."""
        byte_level = type(self.backend.decoder).__name__ == "ByteLevel"
        table = _byte_level_table()
        added = self.backend.get_added_tokens_decoder()
        out: list[bytes | None] = []
        for token in range(self.vocab_size):
            if token in added:
                out.append(None if added[token].special else added[token].content.encode())
            elif byte_level:
                piece = self.backend.id_to_token(token) or ""
                out.append(bytes(table[c] for c in piece) if all(c in table for c in piece) else None)
            else:
                text = self.backend.decode([token], skip_special_tokens=False)
                out.append(None if REPLACEMENT_CHAR in text else text.encode())
        return out

    @functools.cached_property
    def special_text(self) -> dict[int, bytes]:
        """Special tokens' text (token_bytes has None for them): a grammar's token terminal may name one."""
        return {i: t.content.encode() for i, t in self.backend.get_added_tokens_decoder().items() if t.special}

    @functools.cached_property
    def text_ids(self) -> dict[bytes, int]:
        """Each token's text (special tokens' too) -> its id (the lowest, where texts repeat)."""
        found: dict[bytes, int] = {}
        for token, text in [*enumerate(self.token_bytes), *self.special_text.items()]:
            if text is not None:
                found.setdefault(text, token)
        return found

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)

    # --- chat ---------------------------------------------------------------------------------
    @overload
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                            tokenize: Literal[False] = False, **extra: Any) -> str: ...

    @overload
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                            tokenize: Literal[True], **extra: Any) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *, tokenize: bool = False,
        **extra: Any,
    ) -> str | list[int]:
        """The rendered conversation (extra: template variables, e.g. tools, enable_thinking);
        tokenize=True: its token ids, as Hugging Face's tokenizers give them (whose default it is)."""
        if tokenize:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra), add_special_tokens=False)
        if self.chat_template is None:
            raise AtlasError(
                f"{self.source} has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); run without --chat"
            )
        context = {**self.special_tokens, **extra, "add_generation_prompt": add_generation_prompt}
        origin = str(self.chat_template_source or self.source)
        return render_chat_template(self.chat_template, messages, context, origin)

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None,
        continue_final: bool = False,
    ) -> list[int]:
        """render_chat()'s text as token ids: it already holds its special tokens, so none are added."""
        return self.encode(self.render_chat(messages, add_generation_prompt, template_kwargs, continue_final),
                           add_special_tokens=False)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None,
        continue_final: bool = False,
    ) -> str:
        """The prompt text of a conversation. template_kwargs: extra template variables (e.g. Qwen's
        enable_thinking), over template_defaults. continue_final (vLLM's continue_final_message):
        the text ends right after the final message's content, left open for the model to go on
        with (e.g. a started assistant answer)."""
        if continue_final and add_generation_prompt:
            raise AtlasError("continue_final_message and add_generation_prompt exclude each other: "
                             "set add_generation_prompt to false to continue the final message")
        check_template_kwargs(template_kwargs)
        variables = {**self.template_defaults, **(template_kwargs or {})}
        if not continue_final:
            return self.apply_chat_template(messages, add_generation_prompt, **variables)
        marked = self.apply_chat_template(marked_final_message(messages), False, **variables)
        if marked.count(FINAL_MARK) != 1:
            raise AtlasError("continue_final_message: the chat template does not write the final message's text, "
                             "so there is no place to continue it from")
        return marked[: marked.index(FINAL_MARK)]


RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "self"})  # arguments of their own
# the server and --chat-template-kwargs also pass the request's tools to the template themselves
SERVER_TEMPLATE_NAMES = RESERVED_TEMPLATE_KWARGS | {"tools"}


def check_template_kwargs(values: object) -> None:
    """template_kwargs: a dict of template variables named by strings, none of them an argument."""
    if values is None:
        return
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise AtlasError(f"template_kwargs must be a dict of template variables by name "
                         f"(e.g. {{'enable_thinking': False}}), got {values!r:.80}")
    if taken := sorted(RESERVED_TEMPLATE_KWARGS & set(values)):
        raise AtlasError(f"template_kwargs may not set {taken[0]!r}: give messages and add_generation_prompt "
                         "as chat()'s own arguments")


FINAL_MARK = "\ue000atlas:continue-here\ue000"  # private-use characters: no message holds them


def marked_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with FINAL_MARK after the final message's text (its last text part), so the
    rendered chat can be cut exactly there: a search for the text itself could land in what the
    template writes after it, or in an earlier message."""
    final = messages[-1] if messages else None
    content = final.get("content") if isinstance(final, dict) else None
    if isinstance(content, str) and content:
        return [*messages[:-1], {**final, "content": content + FINAL_MARK}]  # type: ignore[dict-item]
    texts = [i for i, part in enumerate(content) if isinstance(part, dict) and isinstance(part.get("text"), str)] \
        if isinstance(content, list) else []
    if not texts or not content[texts[-1]]["text"]:  # type: ignore[index]
        raise AtlasError("continue_final_message needs a final message with text to continue")
    parts = list(content)  # type: ignore[arg-type]
    parts[texts[-1]] = {**parts[texts[-1]], "text": parts[texts[-1]]["text"] + FINAL_MARK}
    return [*messages[:-1], {**final, "content": parts}]  # type: ignore[dict-item]


class StreamDecoder:
    """Turns generated ids into text pieces, holding back bytes of an unfinished UTF-8
    character. Decodes a short window (prefix .. end) each step, so the cost stays flat."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window that gives context to the next piece
        self.read_offset = 0  # ids before this have been emitted

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:stop], self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is unfinished)."""
        self.ids.append(token_id)
        emitted = self._decode(self.prefix_offset, self.read_offset)
        current = self._decode(self.prefix_offset)
        if len(current) <= len(emitted) or current.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return current[len(emitted) :]

    def flush(self) -> str:
        """Whatever is still held back (possibly with replacement characters)."""
        emitted = self._decode(self.prefix_offset, self.read_offset)
        current = self._decode(self.prefix_offset)
        self.prefix_offset = self.read_offset = len(self.ids)
        return current[len(emitted) :]


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's alphabet -> byte: printable Latin-1 bytes stand for themselves, the other
    bytes, in order, for the characters from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    table = {chr(b): b for b in kept}
    shifted = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def unicode_problem(text: str) -> str:
    """Where a str fails UTF-8 (a lone surrogate, e.g. from JSON's "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"{err.reason} U+{ord(text[err.start]):04X} at character {err.start}"
    return "rejected by the tokenizer"


def read_tokenizer_config(path: Path) -> dict[str, Any]:
    return read_json_object(path) if path.is_file() else {}


def read_special_tokens(path: Path, config: dict[str, Any]) -> dict[str, str]:
    """bos/eos/pad/unk token strings; tokenizer_config stores each as a string or {"content"}."""
    tokens: dict[str, str] = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise AtlasError(f"{path}: field '{key}' must be a string, got {value!r}; fix the file")
        tokens[key] = value
    return tokens


def read_chat_template(model_dir: Path, config: dict[str, Any]) -> tuple[str | None, Path | None]:
    """(template, the file holding it); chat_template.jinja wins over tokenizer_config.json, as in
    transformers 5."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), jinja_file
        except (OSError, UnicodeDecodeError) as err:
            raise AtlasError(f"{jinja_file} cannot be read ({first_line(err)}); re-download or fix it") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict) and isinstance(t.get("name"), str)}
        template = named.get("default")
    config_file = model_dir / "tokenizer_config.json"
    if template is not None and not isinstance(template, str):
        raise AtlasError(f"{config_file}: field 'chat_template' must be a string; fix it")
    return template, None if template is None else config_file


class TemplateRaised(Exception):
    """raise_exception() called by the template: its own message is the explanation."""


def render_chat_template(template: str, messages: list[dict[str, Any]], context: dict[str, Any], origin: str) -> str:
    """Render as transformers does: sandboxed, trim_blocks/lstrip_blocks, tojson without HTML
    escaping, raise_exception and strftime_now available. Any failure is one AtlasError naming
    `origin` (the template's file): the template is data, whatever it raises is its problem or the
    messages', never a traceback."""
    compiled = compile_chat_template(template, origin)
    try:
        return compiled.render({"range": RangeBudget(), **context, "messages": messages})
    except TemplateRaised as err:
        raise AtlasError(f"{origin}: the chat template refused the messages: {first_line(err)}") from None
    except Exception as err:  # noqa: BLE001 - TypeError, UndefinedError, ...: one line, see above
        raise AtlasError(
            f"{origin}: the chat template failed on these messages ({type(err).__name__}: {first_line(err)}); "
            "fix the template or the messages"
        ) from None


RANGE_STEPS = 1_000_000  # range() items over one render: the sandbox caps each call, not loops in loops
MAX_REPEAT = 1 << 24  # items of a string or list made by `*`, and the bits of an integer made by `**`


class TemplateTooCostly(Exception):
    """The template asked for more work or memory than any chat needs."""


class RangeBudget:
    """The sandbox's range with a budget over one render."""

    def __init__(self, steps: int = RANGE_STEPS) -> None:
        self.left = steps

    def __call__(self, *args: int) -> range:
        from jinja2.sandbox import safe_range

        steps = safe_range(*args)
        self.left -= len(steps)
        if self.left < 0:
            raise TemplateTooCostly(f"its range() loops run past {RANGE_STEPS} steps")
        return steps


def repeat_cost(operator: str, left: Any, right: Any) -> int:
    """The size `left operator right` would make: items of a repeated string / list, bits of a power."""
    if operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if isinstance(sequence, (str, list, tuple)) and is_int(count):
                return len(sequence) * max(count, 0)
    if operator == "**" and is_int(left) and is_int(right) and right > 0:
        return right * max(abs(left), 1).bit_length()
    return 0


@functools.cache
def sandbox_class() -> type:
    """transformers' sandboxed environment, with `*` and `**` bounded: "x" * 10**10 would take the
    process's memory before any limit of the sandbox's own."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class ChatTemplateSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if repeat_cost(operator, left, right) > MAX_REPEAT:
                raise TemplateTooCostly(f"'{operator}' would make more than {MAX_REPEAT} items")
            return super().call_binop(context, operator, left, right)

    return ChatTemplateSandbox


def compile_chat_template(template: str, origin: str) -> Any:
    """The template compiled in transformers' sandboxed environment; a syntax error is one line."""
    import jinja2

    def raise_exception(message: str) -> None:
        raise TemplateRaised(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)

    env = sandbox_class()(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise AtlasError(f"{origin}: the chat template is not valid jinja (line {err.lineno}: {first_line(err)}); fix it") from None


def read_template_file(path: Path) -> str:
    """A --chat-template file (checked to compile), or one line saying why it cannot be used."""
    try:
        template = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise AtlasError(f"chat template {path} cannot be read ({first_line(err)}); give a UTF-8 jinja file") from None
    compile_chat_template(template, str(path))
    return template
