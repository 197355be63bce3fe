"""llama.cpp's POST /infill: fill-in-the-middle code completion, as llama-server answers editors
(llama.vim, llama.vscode). The request's `input_prefix` (the text before the cursor),
`input_suffix` (after it), `input_extra` (other files: [{"filename", "text"}]) and `prompt` (text
already typed at the cursor) become one prompt of the model's FIM tokens, Qwen's repo-level
pattern where the vocabulary has its repo and file-separator tokens:

    <|repo_name|>myproject\\n<|file_sep|>{filename}\\n{text}...<|file_sep|>filename\\n
    <|fim_prefix|>{input_prefix}<|fim_suffix|>{input_suffix}<|fim_middle|>{prompt}

(without them the extra files' text goes first as it is). Everything else is a /completion request
(n_predict, sampling, stream) and the answer is /completion's. A prompt longer than the context
allows is cut as llama-server cuts it, nearest the cursor kept: the prefix's end (up to 3/4 of the
room), the suffix's start, then the extra files' end; the answer says `truncated`.

OpenAI's /v1/completions `suffix` (the text after the insertion point, which vLLM refuses) takes
the same prompt: each text prompt is the prefix, `suffix` the suffix, and the completion the middle."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..tokenizer import Tokenizer
from .errors import RequestError

# Token spellings by role: Qwen's (and StarCoder's, whose names Qwen's follow), then CodeLlama's.
SPELLINGS = {
    "prefix": ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "▁<PRE>"),
    "suffix": ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>", "▁<SUF>"),
    "middle": ("<|fim_middle|>", "<fim_middle>", "<fim-middle>", "▁<MID>"),
    "repo": ("<|repo_name|>", "<repo_name>", "<reponame>"),
    "file_sep": ("<|file_sep|>", "<file_sep>", "<filename>"),
}
REPO_NAME = "myproject"  # llama-server's: the request names no project
CURRENT_FILE = "filename"  # llama-server's name for the file being edited
PREFIX_SHARE = 3 / 4  # of the room: the rest is the suffix's, then the extra files'


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repo: int | None  # the repo-level pattern needs both of these
    file_sep: int | None


@dataclass(frozen=True)
class InfillParts:
    prefix: str
    suffix: str
    prompt: str
    extra: tuple[tuple[str, str], ...]  # (filename, text) per extra file


@dataclass(frozen=True)
class InfillPrompt:
    ids: list[int]
    truncated: bool


def fim_tokens(tokenizer: Tokenizer) -> FimTokens | None:
    """The vocabulary's FIM tokens, or None when it lacks prefix, suffix or middle."""
    found: dict[str, int | None] = {}
    for role, spellings in SPELLINGS.items():
        ids = (tokenizer.backend.token_to_id(text) for text in spellings)
        found[role] = next((i for i in ids if i is not None), None)
    if found["prefix"] is None or found["suffix"] is None or found["middle"] is None:
        return None
    return FimTokens(found["prefix"], found["suffix"], found["middle"], found["repo"], found["file_sep"])


def infill_parts(raw: dict[str, Any]) -> InfillParts:
    """The request's FIM fields, checked (400 naming the field)."""
    texts = {}
    for field in ("input_prefix", "input_suffix", "prompt"):
        value = raw.get(field, "")
        if not isinstance(value, str):
            raise RequestError(f"'{field}' must be a string (text), got {type(value).__name__}", field)
        texts[field] = value
    extra = raw.get("input_extra", [])
    if not isinstance(extra, list):
        raise RequestError("'input_extra' must be a list of {\"filename\": ..., \"text\": ...} objects", "input_extra")
    chunks = []
    for i, chunk in enumerate(extra):
        if not (isinstance(chunk, dict) and isinstance(chunk.get("text"), str)
                and isinstance(chunk.get("filename", ""), str)):
            raise RequestError(f"'input_extra[{i}]' must be an object with a string \"text\" (and a string "
                               "\"filename\")", "input_extra")
        chunks.append((chunk.get("filename") or "tmp", chunk["text"]))
    return InfillParts(texts["input_prefix"], texts["input_suffix"], texts["prompt"], tuple(chunks))


def infill_prompt(tokenizer: Tokenizer, fim: FimTokens, parts: InfillParts, room: int) -> InfillPrompt:
    """The FIM prompt's ids, at most `room` tokens (room >= the prompt's own text and 4 tokens)."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    opening = tokenizer.encode("", add_special_tokens=True)  # a BOS where the tokenizer adds one
    prefix, suffix, typed = encode(parts.prefix), encode(parts.suffix), encode(parts.prompt)
    if fim.repo is not None and fim.file_sep is not None:
        extra = repo_files(encode, fim.repo, fim.file_sep, parts.extra)
        current = [fim.file_sep, *encode(f"{CURRENT_FILE}\n")]
    else:
        extra, current = encode("".join(text for _, text in parts.extra)), []
    room -= len(opening) + len(current) + len(typed) + 3  # the three FIM tokens
    prefix_take = min(len(prefix), max(0, int(room * PREFIX_SHARE)))
    suffix_take = min(len(suffix), max(0, room - prefix_take))
    extra_take = min(len(extra), max(0, room - prefix_take - suffix_take))
    ids = [*opening, *extra[len(extra) - extra_take :], *current, fim.prefix, *prefix[len(prefix) - prefix_take :],
           fim.suffix, *suffix[:suffix_take], fim.middle, *typed]
    truncated = (prefix_take, suffix_take, extra_take) != (len(prefix), len(suffix), len(extra))
    return InfillPrompt(ids, truncated)


def suffix_prompts(raw: dict[str, Any], tokenizer: Tokenizer, fim: FimTokens | None, capacity: int) -> dict[str, Any]:
    """A /v1/completions body with a `suffix`: its text prompts as FIM prompts (ids), `suffix` gone.
    The room left for each is the context less max_tokens (a quarter of it when not given)."""
    suffix, prompt = raw["suffix"], raw.get("prompt")
    if not isinstance(suffix, str):
        raise RequestError(f"'suffix' must be a string (the text after the completion), got {type(suffix).__name__}",
                           "suffix")
    if raw.get("echo"):
        raise RequestError("'echo' with 'suffix' would echo the fill-in-the-middle prompt; leave one out", "echo")
    if fim is None:
        raise RequestError("this model's vocabulary has no fill-in-the-middle tokens, which 'suffix' needs; "
                           "leave 'suffix' out", "suffix", "not_supported_error", 501)
    texts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
        raise RequestError("'suffix' needs text prompts (a string or a list of strings), not token ids", "prompt")
    wanted = raw.get("max_tokens")
    answer = wanted if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > 0 else capacity // 4
    room = max(capacity - answer, 0)
    ids = [infill_prompt(tokenizer, fim, InfillParts(text, suffix, "", ()), room).ids for text in texts]
    return {**raw, "prompt": ids[0] if isinstance(prompt, str) else ids, "suffix": None}


def repo_files(encode: Callable[[str], list[int]], repo: int, file_sep: int, files: tuple[tuple[str, str], ...]) -> list[int]:
    """Qwen's repo-level context: the project's name, then each file's name and text."""
    ids = [repo, *encode(f"{REPO_NAME}\n")]
    for filename, text in files:
        ids += [file_sep, *encode(f"{filename}\n"), *encode(text)]
    return ids
