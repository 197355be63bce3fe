"""`python -m atlas.run`: generate from the command line, streaming text as it comes.

Bad flags and bad models print one line on stderr and exit with code 2, never a traceback.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .cli import run_command
from .engine_flags import EngineFlags, engine_options
from .errors import AtlasError
from .kvcache.names import DEFAULT_LEVEL
from .chat import TextOut
from .llm import SamplingExtras
from .sampling import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from .sampling_filters import DRY_BREAKERS
from . import json_text

if TYPE_CHECKING:
    from .llm import LLM, GenerateOptions, GenerationResult
    from .tokenizer import Tokenizer


class TokenCount(click.ParamType):
    """--max-tokens: a count >= 1, or llama.cpp's -1 (-2) for as many as the context holds (None)."""

    name = "INTEGER"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int | None:
        if value is None or isinstance(value, int):
            count = value
        else:
            try:
                count = int(str(value))
            except ValueError:
                self.fail(f"{value!r} is not an integer", param, ctx)
        if count is None or count in (-1, -2):
            return None
        if count < 1:
            self.fail(f"{count} is not a count >= 1 (or -1: until an end token or the full context)", param, ctx)
        return count


class LogitBiasEntry(click.ParamType):
    """--logit-bias TOKEN_ID=BIAS -> (id, bias); the range and the vocabulary are checked with
    the other sampling settings."""

    name = "TOKEN_ID=BIAS"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, float]:
        if isinstance(value, tuple):
            return value  # type: ignore[return-value]
        token, _, bias = str(value).partition("=")
        try:
            return int(token), float(bias)
        except ValueError:
            self.fail(f"{value!r} is not TOKEN_ID=BIAS (e.g. 151645=-100)", param, ctx)


@dataclass(frozen=True)
class RunArgs:
    model: str | None
    prompt: str | None
    prompt_file: str | None  # --prompt-file: the prompt's text from a file, "-" for stdin
    max_tokens: int | None  # None: -n -1, as many as the context holds
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    chat: bool
    interactive: bool
    system: str | None  # --system: a system message before the conversation (--chat, --interactive)
    stop: tuple[str, ...]  # --stop (repeated): strings that end the text
    json_object: bool  # --json-object: JSON mode
    json_schema: str | None  # --json-schema: a schema file, or the schema's JSON text
    regex: str | None  # --regex: the whole output matches it
    choice: tuple[str, ...]  # --choice (repeated): the output is one of these
    grammar: str | None  # --grammar: GBNF rules whose root derives the output
    grammar_file: str | None  # --grammar-file: the same from a file
    reasoning_budget: int  # --reasoning-budget: a reasoning block's most tokens (-1: no cap)
    ignore_eos: bool  # --ignore-eos: the model's eos ends nothing (llama.cpp's flag)
    prompt_cache_file: str | None  # --prompt-cache FILE: the prompt's state restored from / saved to it (llama.cpp's)
    prompt_cache_all: bool  # --prompt-cache-all: save the generation's state too
    prompt_cache_ro: bool  # --prompt-cache-ro: restore only, never write the file
    engine: EngineFlags
    extras: SamplingExtras


def default_prompt(model_dir: Path, model_arg: str | None) -> str:
    """The demo's opening words; any other model needs --prompt."""
    from .demo import DEMO_DIR, DEMO_PROMPT

    if model_dir.resolve() == DEMO_DIR.resolve():
        return DEMO_PROMPT
    raise AtlasError(f"--prompt is required with --model {model_arg} (only the demo has a default prompt)")


def prompt_text(args: RunArgs) -> str | None:
    """--prompt, or --prompt-file's text (UTF-8; "-": stdin, not with --interactive)."""
    if args.prompt_file is None:
        return args.prompt
    if args.prompt is not None:
        raise AtlasError("--prompt and --prompt-file exclude each other; give one of them")
    if args.prompt_file == "-":
        if args.interactive:
            raise AtlasError("--prompt-file - reads stdin, which --interactive reads turns from; give a file")
        return sys.stdin.read()
    try:
        return Path(args.prompt_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise AtlasError(f"--prompt-file {args.prompt_file} cannot be read ({err}); give a UTF-8 text file") from None


def read_schema(arg: str | None) -> Any:
    """--json-schema's schema: the JSON text itself when it starts with '{', else a file's."""
    if arg is None:
        return None
    if not arg.strip():
        raise AtlasError("--json-schema is empty; give a JSON schema file or its text")
    text = arg
    if not arg.lstrip().startswith("{"):
        try:
            text = Path(arg).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            if not_object_json(arg):
                raise AtlasError(f"--json-schema {arg[:40]} is JSON but not an object; a schema is an object "
                                 "such as '{\"type\": \"object\"}'") from None
            raise AtlasError(f"--json-schema {arg} cannot be read ({err}); give a JSON schema file or its text") from None
    try:
        return json_text.loads(text)
    except ValueError as err:
        raise AtlasError(f"--json-schema {arg[:40]} is not JSON ({err}); give a JSON schema file or its text") from None


def not_object_json(text: str) -> bool:
    """True when text is JSON other than an object (a list, a number, true): a schema mistyped."""
    try:
        value = json_text.loads(text)
    except ValueError:
        return False
    return not isinstance(value, dict)


def read_grammar(args: RunArgs) -> str | None:
    """--grammar's text, or --grammar-file's (UTF-8)."""
    if args.grammar_file is None:
        return args.grammar
    if args.grammar is not None:
        raise AtlasError("--grammar and --grammar-file exclude each other; give one of them")
    try:
        return Path(args.grammar_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise AtlasError(f"--grammar-file {args.grammar_file} cannot be read ({err}); give a GBNF text file") from None


def run(args: RunArgs) -> None:
    from .chat import converse
    from .config import load_spec
    from .backends.run_plan import context_length
    from .llm import DEFAULT_PROMPT_CACHE, check_length

    args.engine.check()
    model_dir = args.engine.resolve(args.model)
    prompt = prompt_text(args)
    if prompt is None and not args.interactive:
        prompt = default_prompt(model_dir, args.model)
    spec = load_spec(model_dir, args.engine.config_overrides())
    opts = run_options(args, spec.vocab_size)  # problems surface before the weights load
    tokenizer = args.engine.tokenizer(model_dir)
    if args.interactive and tokenizer.chat_template is None:
        raise AtlasError(f"{model_dir} has no chat template, which --interactive needs; run without it")
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    prompt_ids = None if args.interactive else first_prompt(tokenizer, prompt, args.chat, system)
    if prompt_ids is not None:  # before the weights load
        check_length(spec, context_length(args.engine.max_seq_len, spec.context_length), len(prompt_ids), opts.max_tokens)
    session = check_session(args)
    keeps = args.interactive or session is not None  # a prompt cache to resume the conversation / the file's state
    engine = replace(args.engine, prompt_cache=DEFAULT_PROMPT_CACHE) if keeps else args.engine
    llm = engine.load(str(model_dir))
    announce(llm, args.engine)
    if prompt_ids is None:
        converse(llm, opts, prompt, lambda result: stats_line(llm, result), system)
        return
    if session is not None and session.is_file():
        click.echo(f"atlas: prompt cache {session}: {llm.load_state(session).tokens} tokens restored", err=True)
    out = TextOut()
    try:
        result = llm.generate_with(llm.prepare(prompt_ids, replace(opts, chat=False)), opts, on_text=out.write)
    except Exception:
        out.end_line()  # the error line that follows starts its own line
        raise
    out.write("\n")
    click.echo(stats_line(llm, result), err=True)
    if session is not None and not args.prompt_cache_ro:
        saved = llm.save_state(session, None if args.prompt_cache_all else prompt_ids)
        click.echo(f"atlas: prompt cache {session}: {saved.tokens} tokens saved", err=True)


def check_session(args: RunArgs) -> Path | None:
    """--prompt-cache FILE (with -all / -ro), checked before the weights load."""
    if args.prompt_cache_file is None:
        if args.prompt_cache_all or args.prompt_cache_ro:
            raise AtlasError("--prompt-cache-all and --prompt-cache-ro go with --prompt-cache FILE; give the file")
        return None
    if args.interactive:
        raise AtlasError("--prompt-cache FILE keeps one prompt's state; --interactive keeps its turns in memory: "
                         "give one of them")
    if args.prompt_cache_all and args.prompt_cache_ro:
        raise AtlasError("--prompt-cache-all saves the file and --prompt-cache-ro never does; give one of them")
    session = Path(args.prompt_cache_file).expanduser()
    if session.is_dir() or not session.parent.is_dir():
        raise AtlasError(f"--prompt-cache {args.prompt_cache_file}: not a file in an existing directory; give a file path")
    if session.is_file():  # a file that is no saved sequence at all fails before the weights load
        from .sequence_state import open_sequence_file

        open_sequence_file(session).close()
    return session


def run_options(args: RunArgs, vocab: int) -> GenerateOptions:
    """The flags' GenerateOptions, checked."""
    from .llm import GenerateOptions, check_options, sampling_params, stop_strings
    from .sampling import check_logit_bias_ids
    from .structured import OutputFormat

    if args.system is not None and not (args.chat or args.interactive):
        raise AtlasError("--system is a chat's system message: give --chat or --interactive with it")
    if "" in args.stop:
        raise AtlasError("--stop needs a non-empty string: the text that ends the output")
    output = OutputFormat.of(args.json_object, read_schema(args.json_schema), args.regex, args.choice or None,
                             grammar=read_grammar(args))
    if output is not None and args.ignore_eos:
        raise AtlasError("--ignore-eos leaves a structured output no end (it ends with the eos token); give one of them")
    opts = GenerateOptions(args.max_tokens, args.temperature, max(args.top_k, 0), args.top_p, args.seed, args.chat,
                           extras=args.extras, stop=stop_strings(list(args.stop)), output=output,
                           thinking_token_budget=None if args.reasoning_budget < 0 else args.reasoning_budget,
                           ignore_eos=args.ignore_eos)
    check_options(opts)
    check_logit_bias_ids(sampling_params(opts), vocab)
    return opts


def first_prompt(tokenizer: Tokenizer, prompt: str | None, chat: bool, system: list[dict[str, str]]) -> list[int]:
    """The prompt's ids: its text, or with --chat the user message (after --system's)."""
    from .llm import encode_prompt

    assert prompt is not None  # only --interactive starts without one
    if system:
        return tokenizer.encode_chat([*system, {"role": "user", "content": prompt}])
    return encode_prompt(tokenizer, prompt, chat)


def announce(llm: LLM, flags: EngineFlags) -> None:
    """Where the model runs, on stderr: the device, and the KV level and speculation when chosen."""
    from .kvcache.options import describe

    click.echo(f"atlas: model {llm.model_dir}, device {llm.device}", err=True)
    if flags.kv_cache_dtype != DEFAULT_LEVEL:
        click.echo(f"atlas: kv cache {describe(llm.parts.engine.kv_plan)}", err=True)  # type: ignore[attr-defined]
    if flags.spec_k is not None or llm.speculation.startswith("MTP"):
        click.echo(f"atlas: speculation {llm.speculation}", err=True)


def stats_line(llm: LLM, result: GenerationResult) -> str:
    from .speculative import acceptance_summary

    spec = acceptance_summary(result.spec_rounds, result.spec_drafted, result.spec_accepted, len(result.token_ids))
    cached = f" ({result.cached_tokens} cached)" if result.cached_tokens else ""
    return (
        f"atlas: prompt {result.prompt_tokens} tokens{cached}, prefill {result.prefill_tok_s:.1f} tok/s, "
        f"decode {result.decode_tok_s:.1f} tok/s ({len(result.token_ids)} tokens), "
        f"device {llm.device.split(' ')[0]}" + (f", {spec}" if result.spec_rounds else "")
    )


MODEL_HELP = "Directory, HF repo id in the local cache, or registry name (default: atlas-demo)."


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "-m", default=None, help=MODEL_HELP)
@click.option("--prompt", "-p", default=None, help="Prompt text (default for the demo: its first words).")
@click.option("--prompt-file", "-f", default=None, help="Read the prompt from this UTF-8 file ('-': stdin).")
@click.option("--max-tokens", "-n", "--n-predict", "max_tokens", type=TokenCount(), default=256, show_default=True,
              help="-1: until an end token or the full context (llama.cpp's).")
@click.option("--temperature", "--temp", "temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=-1), default=0, show_default=True, help="0 or -1 (vLLM's): off.")
@click.option(
    "--top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True
)
@click.option("--seed", "-s", type=click.IntRange(min=0), default=None, help="Seed for sampling (reproducible output).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--interactive", "-i", is_flag=True,
              help="A conversation: each line on stdin is a user turn (chat template; --prompt is the first).")
@click.option("--system", "--system-prompt", "-sys", "system", default=None, help="A system message before the conversation (with --chat or --interactive).")
@click.option("--stop", multiple=True, help="A string that ends the text (not written); repeat for several.")
@click.option("--min-p", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
              help="Keep tokens whose probability is >= min_p x the largest; 0: off.")
@click.option("--typical", "typical_p", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True,
              help="Locally typical sampling: keep the tokens whose surprise is nearest the entropy, this much of the "
                   "mass; 1: off (llama.cpp's flag).")
@click.option("--top-nsigma", "top_n_sigma", type=float, default=-1.0, show_default=True,
              help="Keep the logits within N standard deviations of the largest; <= 0: off (llama.cpp's flag).")
@click.option("--xtc-probability", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
              help="XTC: how often a pick drops every token of p >= --xtc-threshold but the least likely; 0: off.")
@click.option("--xtc-threshold", type=click.FloatRange(0.0, 1.0), default=0.1, show_default=True,
              help="XTC's probability threshold (above 0.5 it cuts nothing).")
@click.option("--dry-multiplier", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="DRY: a token that would extend a repeat of the text's last tokens costs this x "
                   "--dry-base^(repeat - --dry-allowed-length) in its logit; 0: off (llama.cpp's flags).")
@click.option("--dry-base", type=click.FloatRange(min=1.0), default=1.75, show_default=True)
@click.option("--dry-allowed-length", type=click.IntRange(min=0), default=2, show_default=True)
@click.option("--dry-penalty-last-n", type=click.IntRange(min=-1), default=-1, show_default=True,
              help="DRY looks for repeats in the last N tokens; -1: all of them, 0: off.")
@click.option("--dry-sequence-breaker", "dry_sequence_breakers", multiple=True, default=DRY_BREAKERS,
              help="A text no repeat reaches back past (default: newline, ':', '\"', '*'); repeatable; "
                   "'none': no breakers (llama.cpp's).")
@click.option("--mirostat", type=click.IntRange(0, 2), default=0, show_default=True,
              help="Mirostat 1 or 2: a cut that steers each pick's surprise to --mirostat-ent, in place of "
                   "--top-k / --top-p / --min-p; 0: off (llama.cpp's flags).")
@click.option("--mirostat-ent", "mirostat_tau", type=click.FloatRange(min=0.0), default=5.0, show_default=True)
@click.option("--mirostat-lr", "mirostat_eta", type=click.FloatRange(min=0.0), default=0.1, show_default=True)
@click.option("--dynatemp-range", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="Each sampled pick's temperature moves within --temperature +- this, hotter where the kept tokens' "
                   "entropy is higher; 0: off (llama.cpp's flags).")
@click.option("--dynatemp-exp", "dynatemp_exponent", type=click.FloatRange(min=0.0), default=1.0, show_default=True)
@click.option("--presence-penalty", type=click.FloatRange(-2.0, 2.0), default=0.0, show_default=True,
              help="Subtracted from the logit of every token generated so far (Qwen suggests up to 1.5 against repetition).")
@click.option("--frequency-penalty", type=click.FloatRange(-2.0, 2.0), default=0.0, show_default=True,
              help="Subtracted, times its count, from the logit of every generated token.")
@click.option("--min-tokens", type=click.IntRange(min=0), default=0, show_default=True,
              help="No end-of-sequence token before this many tokens.")
@click.option("--repetition-penalty", "--repeat-penalty", "repetition_penalty", type=click.FloatRange(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY), default=1.0,
              show_default=True,
              help="Prompt and generated tokens' logits divided by it when positive, multiplied when not; 1: off.")
@click.option("--json-object", is_flag=True, help="JSON mode: the output is one JSON object (cut at --max-tokens).")
@click.option("--json-schema", metavar="FILE|JSON", default=None,
              help="The output is one value this JSON schema admits (a file, or the schema's text; "
                   "supported keywords: docs/structured-output.md).")
@click.option("--regex", default=None, help="The whole output matches this regular expression (an ECMA-262 subset).")
@click.option("--choice", multiple=True, help="The output is one of these texts; repeat the option for each.")
@click.option("--grammar", default=None,
              help="The output is what this GBNF grammar's root rule derives (llama.cpp's syntax; docs/structured-output.md).")
@click.option("--grammar-file", metavar="FILE", default=None, help="--grammar's rules from a file (e.g. a .gbnf).")
@click.option("--reasoning-budget", type=click.IntRange(min=-1), default=-1, show_default=True,
              help="A thinking model's reasoning block gets at most this many tokens, then is closed for it "
                   "(-1: no cap; llama.cpp's flag, vLLM's thinking_token_budget).")
@click.option("--logit-bias", type=LogitBiasEntry(), multiple=True,
              help="Add BIAS (-100..100; -100 bans the token) to TOKEN_ID's logit; repeatable.")
@click.option("--ignore-eos", is_flag=True,
              help="Generate --max-tokens tokens whatever the model's end-of-sequence token (llama.cpp's flag; benchmarks).")
@click.option("--prompt-cache", "prompt_cache_file", metavar="FILE", default=None,
              help="Restore the state of an earlier run's prompt from FILE (when it exists), so a prompt that starts "
              "the same runs only its new tokens, and save this prompt's state there after the run (llama.cpp's flag).")
@click.option("--prompt-cache-all", is_flag=True, help="With --prompt-cache: save the generated text's state too.")
@click.option("--prompt-cache-ro", is_flag=True, help="With --prompt-cache: restore only, leave the file as it is.")
@engine_options
def command(**kwargs: object) -> None:
    """Run a model: stream generated text to stdout, then a stats line to stderr."""
    engine = EngineFlags.pop_from(kwargs)
    kwargs["logit_bias"] = tuple(sorted(dict(kwargs["logit_bias"]).items()))  # type: ignore[call-overload]  # last wins
    if kwargs["dry_sequence_breakers"] == ("none",):
        kwargs["dry_sequence_breakers"] = ()
    extras = SamplingExtras(**{f.name: kwargs.pop(f.name) for f in fields(SamplingExtras)})  # type: ignore[arg-type]
    run(RunArgs(**kwargs, engine=engine, extras=extras))  # type: ignore[arg-type]


def main(argv: list[str] | None = None, usage: str | None = None) -> int:
    """Entry point; returns the exit code."""
    return run_command(command, argv, "atlas.run", usage=usage)


if __name__ == "__main__":
    sys.exit(main())
