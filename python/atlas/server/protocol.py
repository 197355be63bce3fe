"""Request bodies of /v1/completions and /v1/chat/completions -> typed, checked parameters.
Every mistake is a RequestError naming the parameter; unknown fields are ignored, as OpenAI's
optional extras are, but fields whose non-default value we cannot honour are refused."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..llm import SamplingExtras
from ..errors import AtlasError
from ..json_text import unpaired_surrogate_path
from ..tokenizer import SERVER_TEMPLATE_NAMES, first_line
from ..sampling_filters import DRY_COUNTS, NAMES as FILTER_NAMES, filter_problem
from ..sampling import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_TOP_K,
                        MIN_REPETITION_PENALTY, is_int, logit_bias_pairs)
from .errors import RequestError
from ..structured import OutputFormat
from .formats import GUIDED, parse_output_format
from .tools import ToolChoice, parse_tool_choice, parse_tools, template_tool_calls

Prompt = str | list[int]
Message = dict[str, Any]  # role, content (text), and tool_calls / tool_call_id / name where given
MAX_STOPS = 16
MAX_CHOICES = 16  # n: choices run one after another, so a request's time grows with it
MAX_PROMPTS = 16  # a completions batch, answered one prompt after another

# field -> its values that change nothing; any other value is refused (we cannot honour it)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "modalities": (None, ["text"]),
    "audio": (None,),
    # vLLM's fields that this server does not honour: refused rather than silently ignored
    "guided_whitespace_pattern": (None,),
    "detokenize": (None, True),
}


def parse_json_body(raw: bytes) -> object:
    """A request body as JSON (RFC 8259) in UTF-8. Refused: NaN and Infinity, which Python's parser
    takes, numbers past the float range (1e400, which it reads as inf), and strings or keys with an
    unpaired UTF-16 surrogate ("\\ud800"), which no UTF-8 text holds: each would fail the answer
    that echoes or tokenizes it, after the work was done."""
    def refuse(what: str) -> float:
        raise RequestError(f"the request body is not valid JSON ({what} is not a finite number; send one)",
                           code="invalid_json")

    def finite(literal: str) -> float:
        value = float(literal)
        return value if math.isfinite(value) else refuse(literal[:40])

    try:
        text = raw.decode("utf-8-sig")  # strict UTF-8; a leading byte-order mark is dropped
        body = json.loads(text, parse_constant=refuse, parse_float=finite)
    except RecursionError:
        raise RequestError("the request body nests too deeply to parse", code="invalid_json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON ({first_line(err)})", code="invalid_json") from None
    except ValueError:  # the one other: an integer past Python's 4300-digit limit
        raise RequestError("the request body holds an integer too long to read (over 4300 digits)",
                           code="invalid_json") from None
    if SURROGATE_ESCAPE.search(text):  # only a \u escape can put a surrogate into the parsed strings
        where = unpaired_surrogate_path(body)
        if where is not None:
            raise RequestError(f"{where or 'a key of the body'} holds an unpaired UTF-16 surrogate: send text as "
                               "UTF-8 or with paired \\u escapes", where or None)
    return body


SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
@dataclass(frozen=True)
class SamplingFields:
    max_tokens: int | None  # None: as many as fit, up to the server default
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]  # strings that end the text
    stop_token_ids: tuple[int, ...]  # vLLM's: ids that end the text (their text kept)
    ignore_eos: bool  # vLLM's: the model's eos ends nothing (benchmarks)
    extras: SamplingExtras  # min_p, presence / frequency / repetition penalties
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: only these may be picked
    bad_words: tuple[str, ...] = ()  # vLLM's: no text ends with one of these words
    thinking_token_budget: int | None = None  # vLLM's: the reasoning block's most tokens


@dataclass(frozen=True)
class TextOptions:
    """vLLM's prompt, output-text and token-id fields."""

    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: as many as the context holds)
    add_generation_prompt: bool = True  # chat: the prompt ends with the assistant's opening
    continue_final_message: bool = False  # chat: the model goes on with the final message instead
    skip_special_tokens: bool = True  # False: special tokens' text is written (not the eos that ends it)
    include_stop_str_in_output: bool = False  # the stop string that ends the text stays at its end
    return_token_ids: bool = False  # the prompt's ids and the generated ids come back beside the text
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"


@dataclass(frozen=True)
class GenerationBody:
    model: str
    prompts: list[Prompt] | None  # /v1/completions: one, or a batch answered in turn
    messages: list[Message] | None  # /v1/chat/completions
    sampling: SamplingFields
    stream: bool
    include_usage: bool
    usage_each_chunk: bool  # vLLM's stream_options.continuous_usage_stats (with include_usage)
    logprobs: int | None = None  # None: off; N: each token's log-probability and the N most likely
    template_kwargs: dict[str, Any] | None = None  # chat: extra chat-template variables
    tools: list[dict[str, Any]] | None = None  # chat: function tools, in the prompt (as vLLM's default) even under
    # tool_choice "none", whose answer is not searched for calls
    tool_choice: ToolChoice = ToolChoice("none")  # "required" / a named function: `output` forces the call
    parallel_tool_calls: bool = True  # False: at most one call
    echo: bool = False  # completions: the prompt comes back in front of the completion
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the N most likely (not streamed)
    n: int = 1  # choices, generated one after another
    output: OutputFormat | None = None  # response_format, vLLM's structured outputs, a forced call (formats.py)
    text: TextOptions = TextOptions()
    request_id: str | None = None  # vLLM's: names the answer (an X-Request-Id header wins)
    until_context: bool = False  # completions without max_tokens: the rest of the context (llama.cpp's n_predict -1)
    beam_search: bool = False  # vLLM's use_beam_search: the n best beams are the n choices (atlas.beam_search)
    length_penalty: float = 1.0  # vLLM's, for the beams' score


def parse_body(body: Any, chat: bool, defaults: Mapping[str, float] | None = None) -> GenerationBody:
    """defaults: sampling fields a request leaves out take these (the model's generation_config)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    beam_search, length_penalty = parse_beam_search(body, chat)  # before the defaults: what the request itself sets
    body = with_defaults(body, defaults or {})
    check_unsupported(body)
    n = optional_int(body, "n", minimum=1, maximum=MAX_CHOICES) or 1
    stream = optional_bool(body, "stream") or False
    include_usage, each_chunk = parse_stream_options(body.get("stream_options"))  # checked even without stream
    echo = optional_bool(body, "echo") or False
    if chat and echo:
        raise RequestError("'echo' is a /v1/completions field; leave it out of chat requests", "echo")
    tools = parse_tools(body.get("tools")) if chat else None
    choice = parse_tool_choice(body.get("tool_choice"), tools) if chat else ToolChoice("none")
    return GenerationBody(
        model=optional_model(body),
        prompts=None if chat else parse_prompts(body.get("prompt")),
        messages=parse_messages(body.get("messages")) if chat else None,
        sampling=parse_sampling(body, echo),
        stream=stream,
        include_usage=stream and include_usage,
        usage_each_chunk=stream and include_usage and each_chunk,
        logprobs=parse_logprobs(body, chat),
        template_kwargs=parse_template_kwargs(body.get("chat_template_kwargs")) if chat else None,
        tools=tools or None,
        tool_choice=choice,
        parallel_tool_calls=optional_bool(body, "parallel_tool_calls") is not False,
        echo=echo,
        prompt_logprobs=parse_prompt_logprobs(body, stream),
        n=n,
        output=parse_output_format(body, tools, choice),
        text=parse_text_options(body, chat),
        request_id=parse_request_id(body.get("request_id")),
        beam_search=beam_search,
        length_penalty=length_penalty,
    )


def parse_beam_search(body: dict[str, Any], chat: bool) -> tuple[bool, float]:
    """vLLM's use_beam_search (n: the beam width) and length_penalty; a field beam search would
    ignore (the beams' picks are scored by logprob alone) is refused beside it, and so is a length
    whose search would hold the engine for long (a chat's default is the rest of the context)."""
    from ..beam_search import MAX_BEAM_WIDTH

    beam = optional_bool(body, "use_beam_search") or False
    penalty = optional_number(body, "length_penalty", 1.0)
    if not beam:
        if penalty != 1.0:
            raise RequestError("'length_penalty' scores beams: give it with use_beam_search true", "length_penalty")
        return False, penalty
    for name in BEAM_IGNORES:
        if body.get(name) not in (None, False, [], {}):
            raise RequestError(f"'{name}' does not apply to beam search (use_beam_search true); leave it out", name)
    n = body.get("n", 1)
    if is_int(n) and not 1 <= n <= MAX_BEAM_WIDTH:
        raise RequestError(f"'n' is the beam width under use_beam_search: 1..{MAX_BEAM_WIDTH}, got {n}", "n")
    length = max_tokens_field(body)
    if (length is None and chat) or (length is not None and length > MAX_BEAM_TOKENS):
        raise RequestError(f"give max_tokens of at most {MAX_BEAM_TOKENS} with use_beam_search: a search runs about "
                           "n x max_tokens^2 / 2 prompt tokens", "max_tokens")
    return True, penalty


MAX_BEAM_TOKENS = 512

BEAM_IGNORES = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "stop", "stop_token_ids", "min_tokens",
                "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_p", "top_k", "min_p",
                "seed", "allowed_token_ids", "bad_words", "response_format", "structured_outputs", *GUIDED, "tools",
                "thinking_token_budget", *FILTER_NAMES, *DRY_COUNTS, "dry_sequence_breakers", "mirostat")


def parse_request_id(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise RequestError("'request_id' must be a non-empty string (it names the answer: chatcmpl-<request_id>)",
                           "request_id")
    return value


def parse_prompt_logprobs(body: dict[str, Any], stream: bool) -> int | None:
    """vLLM's prompt_logprobs 0..20; as vLLM, not above 0 with stream (echo + logprobs streams the
    prompt's), where 0 asks for nothing."""
    top = optional_int(body, "prompt_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    if top == 0 and stream:
        return None
    if top is not None and stream:
        raise RequestError("'prompt_logprobs' is not available with stream: true; ask without streaming "
                           "(or, on /v1/completions, stream echo with logprobs)", "prompt_logprobs")
    return top


def parse_truncation(body: dict[str, Any]) -> int | None:
    """vLLM's truncate_prompt_tokens: keep the prompt's last k tokens (-1: as many as the context holds)."""
    keep = body.get("truncate_prompt_tokens")
    if keep is not None and (not is_int(keep) or (keep < 1 and keep != -1)):
        raise RequestError(f"'truncate_prompt_tokens' must be an integer >= 1 (or -1: as many as the context "
                           f"holds), got {keep!r}", "truncate_prompt_tokens")
    return keep


def parse_text_options(body: dict[str, Any], chat: bool) -> TextOptions:
    keep = parse_truncation(body)
    add = optional_bool(body, "add_generation_prompt") is not False if chat else True
    final = bool(optional_bool(body, "continue_final_message")) if chat else False
    if add and final:  # as vLLM: the generation prompt opens a new turn, which is not the final one
        raise RequestError("'continue_final_message' needs 'add_generation_prompt': false (both would open a new "
                           "turn and continue the last one)", "continue_final_message")
    skip = optional_bool(body, "skip_special_tokens")
    include = optional_bool(body, "include_stop_str_in_output")
    ids, named = optional_bool(body, "return_token_ids"), optional_bool(body, "return_tokens_as_token_ids")
    return TextOptions(keep, add, final, skip is not False, bool(include), bool(ids), bool(named))


def with_defaults(body: dict[str, Any], defaults: Mapping[str, float]) -> dict[str, Any]:
    """The request's fields over the defaults (a field sent as null takes its default)."""
    merged: dict[str, Any] = {key: int(value) if key == "top_k" else value for key, value in defaults.items()}
    merged.update((key, value) for key, value in body.items() if value is not None or key not in defaults)
    return merged


def parse_sampling(body: dict[str, Any], echo: bool = False) -> SamplingFields:
    top_k = optional_int(body, "top_k", minimum=-1, maximum=MAX_TOP_K)  # -1: off, as in vLLM
    temperature = optional_number(body, "temperature", 1.0)
    if temperature < 0:
        raise RequestError(f"'temperature' must be >= 0 (0 = greedy), got {temperature}", "temperature")
    top_p = optional_number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(f"'top_p' must be in (0, 1] (1 = off), got {top_p}", "top_p")
    max_tokens, extras = max_tokens_field(body, echo), parse_extras(body)
    if max_tokens is not None and extras.min_tokens > max_tokens:  # as vLLM: it could never be honoured
        raise RequestError(f"'min_tokens' ({extras.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    return SamplingFields(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=0 if top_k in (None, -1) else top_k,
        seed=optional_int(body, "seed", minimum=0),  # numpy seeds are non-negative
        stop=parse_stop(body.get("stop")),
        stop_token_ids=parse_stop_token_ids(body.get("stop_token_ids")),
        ignore_eos=optional_bool(body, "ignore_eos") or False,
        extras=extras,
        allowed_token_ids=parse_allowed_token_ids(body.get("allowed_token_ids")),
        bad_words=parse_bad_words(body.get("bad_words")),
        thinking_token_budget=optional_int(body, "thinking_token_budget", minimum=0),
    )


def parse_allowed_token_ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(is_int(t) and t >= 0 for t in value):
        raise RequestError("'allowed_token_ids' must be a non-empty list of token ids", "allowed_token_ids")
    return tuple(int(t) for t in value)


def parse_bad_words(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(w, str) and w.strip() for w in value):
        raise RequestError("'bad_words' must be a list of non-empty strings", "bad_words")
    return tuple(value)


def parse_extras(body: dict[str, Any]) -> SamplingExtras:
    """min_p in [0, 1], presence_penalty and frequency_penalty in [-2, 2] (OpenAI's range),
    repetition_penalty in (0, 10] and min_tokens >= 0 (vLLM's extensions), llama.cpp's typical_p,
    top_n_sigma, XTC's, DRY's, mirostat's and dynatemp's settings (atlas.sampling_filters)."""
    values = {
        "min_p": optional_number(body, "min_p", 0.0),
        "presence_penalty": optional_number(body, "presence_penalty", 0.0),
        "frequency_penalty": optional_number(body, "frequency_penalty", 0.0),
        "repetition_penalty": optional_number(body, "repetition_penalty", 1.0),
    }
    ranges = {"min_p": (0.0, 1.0), "presence_penalty": (-MAX_PENALTY, MAX_PENALTY),
              "frequency_penalty": (-MAX_PENALTY, MAX_PENALTY)}
    for name, (low, high) in ranges.items():
        if not low <= values[name] <= high:
            raise RequestError(f"'{name}' must be in [{low:g}, {high:g}], got {values[name]}", name)
    if not MIN_REPETITION_PENALTY <= values["repetition_penalty"] <= MAX_REPETITION_PENALTY:
        raise RequestError(f"'repetition_penalty' must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off), "
                           f"got {values['repetition_penalty']}", "repetition_penalty")
    off = SamplingExtras()
    counts = {name: optional_int(body, name, minimum=least) for name, least in DRY_COUNTS.items()}
    extras = SamplingExtras(**values, min_tokens=optional_int(body, "min_tokens", minimum=0) or 0,
                            logit_bias=parse_logit_bias(body.get("logit_bias")),
                            **{name: optional_number(body, name, getattr(off, name)) for name in FILTER_NAMES},
                            **{name: getattr(off, name) if value is None else value for name, value in counts.items()},
                            dry_sequence_breakers=parse_breakers(body.get("dry_sequence_breakers"), off),
                            mirostat=optional_int(body, "mirostat", minimum=0, maximum=2) or 0)
    if problem := filter_problem(extras):
        raise RequestError(f"'{problem[0]}'{problem[1].removeprefix(problem[0])}", problem[0])
    return extras


def parse_breakers(value: Any, off: SamplingExtras) -> tuple[str, ...]:
    """llama.cpp's dry_sequence_breakers: a list of non-empty strings (its default when left out)."""
    if value is None:
        return off.dry_sequence_breakers
    if not isinstance(value, list) or not all(isinstance(b, str) and b for b in value):
        raise RequestError("'dry_sequence_breakers' must be a list of non-empty strings", "dry_sequence_breakers")
    return tuple(value)


def parse_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"<token id>": bias in [-100, 100]} -> sorted (id, bias) pairs (the
    ids are checked against the vocabulary when the request is prepared)."""
    if not isinstance(value, dict) and value is not None:
        raise RequestError('\'logit_bias\' must be an object of {"token id": bias}', "logit_bias")
    try:
        pairs = logit_bias_pairs(value)
    except AtlasError as err:
        raise RequestError(str(err), "logit_bias") from None
    for token, bias in pairs:
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise RequestError(f"'logit_bias' of token {token} must be a number in "
                               f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}", "logit_bias")
    return tuple((token, float(bias)) for token, bias in pairs)


def parse_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Chat: `logprobs` true and `top_logprobs` 0..20; completions: `logprobs` 0..20 -> the
    alternatives listed per token (None: no logprobs)."""
    if not chat:
        return optional_int(body, "logprobs", minimum=0, maximum=MAX_LOGPROBS)
    wanted = optional_bool(body, "logprobs")
    top = optional_int(body, "top_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    if top and not wanted:
        raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def parse_template_kwargs(value: Any) -> dict[str, Any] | None:
    """vLLM's chat_template_kwargs: extra variables for the chat template (Qwen's enable_thinking)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("'chat_template_kwargs' must be an object of template variables", "chat_template_kwargs")
    taken = sorted(set(value) & SERVER_TEMPLATE_NAMES)
    if taken:
        raise RequestError(f"'chat_template_kwargs' may not set {taken[0]!r}: the server sets it", "chat_template_kwargs")
    return value


def check_unsupported(body: dict[str, Any], table: Mapping[str, tuple[Any, ...]] = UNSUPPORTED) -> None:
    """A field of `table` (name -> the values that change nothing) holding another value is refused."""
    for name, neutral in table.items():
        value = body.get(name)
        if name in body and not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):
            raise RequestError(f"'{name}' is not supported by this server; leave it out", name)


def max_tokens_field(body: dict[str, Any], echo: bool = False) -> int | None:
    """max_completion_tokens (the newer name) wins over max_tokens; 0 only with echo (scoring a prompt)."""
    least = 0 if echo else 1
    newer = optional_int(body, "max_completion_tokens", minimum=least)
    return newer if newer is not None else optional_int(body, "max_tokens", minimum=least)


def parse_prompts(value: Any, field: str = "prompt", most: int = MAX_PROMPTS) -> list[Prompt]:
    """OpenAI's prompt (an embedding's `input`): a string, token ids, or a batch (a list of strings
    or of token-id lists, at most `most`), each answered in turn."""
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) > most:
            raise RequestError(f"'{field}' holds {len(value)} prompts; at most {most} are allowed", field)
        return [parse_prompt(p, field) for p in value]
    return [parse_prompt(value, field)]


def parse_prompt(value: Any, field: str = "prompt") -> Prompt:
    """One prompt: a non-empty string or non-empty list of token ids."""
    if isinstance(value, str):
        if not value:
            raise RequestError(f"'{field}' is empty; give some text", field)
        return value
    if isinstance(value, list) and value and all(is_int(t) for t in value):
        return [int(t) for t in value]
    if value is None:
        raise RequestError(f"'{field}' is required", field)
    raise RequestError(f"'{field}' must be a non-empty string, a list of token ids, or a list of those", field)


def parse_messages(value: Any) -> list[Message]:
    if value is None:
        raise RequestError("'messages' is required", "messages")
    if not isinstance(value, list) or not value:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", "messages")
    return [parse_message(m, i) for i, m in enumerate(value)]


def parse_message(value: Any, index: int) -> Message:
    param = f"messages[{index}]"
    if not isinstance(value, dict):
        raise RequestError(f"{param} must be an object with 'role' and 'content'", param)
    role = value.get("role")
    if not isinstance(role, str) or not role:
        raise RequestError(f"{param}.role must be a non-empty string", f"{param}.role")
    message: Message = {"role": role, "content": message_text(value.get("content"), f"{param}.content")}
    if value.get("tool_calls") is not None:  # an assistant turn that called tools
        message["tool_calls"] = template_tool_calls(value["tool_calls"], f"{param}.tool_calls")
    for key in ("tool_call_id", "name"):  # a tool turn's answer to a call
        if isinstance(value.get(key), str):
            message[key] = value[key]
    if role == "assistant" and isinstance(value.get("reasoning_content"), str):  # an earlier answer's thinking
        message["reasoning_content"] = value["reasoning_content"]
    return message


def message_text(content: Any, param: str) -> str:
    """A string, null, or a list of {"type": "text", "text": ...} parts (joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(content) and all(isinstance(p, str) for p in parts):
            return "".join(parts)
    raise RequestError(f"{param} must be a string or a list of text parts (only text is supported)", param)


def parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOPS:
        raise RequestError(f"'stop' holds {len(stops)} strings; at most {MAX_STOPS} are allowed", "stop")
    return tuple(stops)


def parse_stop_token_ids(value: Any) -> tuple[int, ...]:
    """vLLM's stop_token_ids: token ids that end the generation (checked against the vocabulary
    when the request is prepared)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(is_int(t) and t >= 0 for t in value):
        raise RequestError("'stop_token_ids' must be a list of non-negative token ids", "stop_token_ids")
    if len(value) > MAX_STOPS:
        raise RequestError(f"'stop_token_ids' holds {len(value)} ids; at most {MAX_STOPS} are allowed", "stop_token_ids")
    return tuple(int(t) for t in value)


def parse_stream_options(value: Any) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats: vLLM's usage in every chunk, with include_usage)."""
    if value is None:
        return False, False
    if not isinstance(value, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    return (optional_bool(value, "include_usage", "stream_options.include_usage") or False,
            optional_bool(value, "continuous_usage_stats", "stream_options.continuous_usage_stats") or False)


# --- typed field access --------------------------------------------------------------------------
def optional_model(body: dict[str, Any]) -> str:
    """The model a request names; "" when it names none (vLLM's reading: the served one)."""
    value = body.get("model")
    if value is not None and not isinstance(value, str):
        raise RequestError("'model' must be a string: the served model's name (see /v1/models)", "model")
    return value or ""


def optional_int(body: dict[str, Any], name: str, minimum: int | None = None, maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise RequestError(f"'{name}' must be an integer, got {value!r}", name)
    if minimum is not None and value < minimum:
        raise RequestError(f"'{name}' must be >= {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise RequestError(f"'{name}' must be <= {maximum}, got {value}", name)
    return value


def optional_number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise RequestError(f"'{name}' must be a finite number, got {value!r}", name)
    return float(value)


def optional_bool(body: dict[str, Any], name: str, param: str | None = None) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"'{param or name}' must be true or false, got {value!r}", param or name)
    return value


@dataclass(frozen=True)
class TokenizeBody:
    """vLLM's /tokenize: a completions prompt or chat messages (or llama.cpp's: `content`)."""

    model: str
    prompt: str | None
    messages: list[Message] | None
    add_special_tokens: bool  # completions prompts: the tokenizer's own (BOS ...)
    add_generation_prompt: bool  # messages: end with the assistant's opening
    template_kwargs: dict[str, Any] | None
    continue_final_message: bool = False  # messages: end right after the final message's text
    tools: list[dict[str, Any]] | None = None  # messages: the tools the chat template describes
    with_pieces: bool = False  # llama.cpp's: each token as {"id", "piece"}


def parse_tokenize(body: Any) -> TokenizeBody:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if "content" in body and "prompt" not in body and "messages" not in body:
        return parse_llama_tokenize(body)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise RequestError("give exactly one of 'prompt' (text) and 'messages'", "prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise RequestError("'prompt' must be text", "prompt")
    if prompt is not None and body.get("tools") is not None:
        raise RequestError("'tools' go with 'messages' (the chat template writes them); a prompt is tokenized as it is",
                           "tools")
    text = parse_text_options(body, chat=messages is not None)
    return TokenizeBody(
        model=optional_model(body),
        prompt=prompt,
        messages=parse_messages(messages) if messages is not None else None,
        add_special_tokens=optional_bool(body, "add_special_tokens") is not False,
        add_generation_prompt=text.add_generation_prompt,
        template_kwargs=parse_template_kwargs(body.get("chat_template_kwargs")),
        continue_final_message=text.continue_final_message,
        tools=parse_tools(body.get("tools")) if messages is not None else None,
    )


def parse_llama_tokenize(body: dict[str, Any]) -> TokenizeBody:
    """llama.cpp's /tokenize: `content` text, `add_special` (default false: no BOS added),
    `with_pieces`."""
    if not isinstance(body["content"], str):
        raise RequestError("'content' must be text", "content")
    if optional_bool(body, "parse_special") is False:
        raise RequestError("'parse_special' false is not supported: special tokens' text is read as the tokens",
                           "parse_special")
    return TokenizeBody(model=optional_model(body), prompt=body["content"], messages=None,
                        add_special_tokens=optional_bool(body, "add_special") or False, add_generation_prompt=False,
                        template_kwargs=None, with_pieces=optional_bool(body, "with_pieces") or False)


def parse_detokenize(body: Any, vocab: int) -> tuple[str, list[int]]:
    """vLLM's /detokenize: (model, token ids within the vocabulary)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t < vocab for t in tokens):
        raise RequestError(f"'tokens' must be a list of token ids in 0..{vocab - 1}", "tokens")
    return optional_model(body), [int(t) for t in tokens]
