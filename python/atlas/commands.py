"""`atlas <command> ...`: one entry point for atlas's tools (the console script a pip install puts
on PATH, and `python -m atlas`), as vLLM's `vllm serve` and llama.cpp's `llama-server` are: each
command is `python -m atlas.<command>` with the same flags."""

from __future__ import annotations

import importlib
import sys

USAGE_EXIT = 2
COMMANDS = {  # name -> what it does (the module atlas.<name> runs it)
    "run": "generate from a prompt, or a conversation (-i)",
    "serve": "the OpenAI / Anthropic-compatible HTTP server (vLLM's `vllm serve` flags)",
    "batch": "an OpenAI batch file through the model (vLLM's `run-batch`)",
    "bench": "prompt-processing and generation speed (llama.cpp's llama-bench)",
    "verify": "the installed GPU kernels against the numpy backend",
    "compare": "layer by layer against transformers, or one backend against another",
    "perplexity": "perplexity and KL divergence of a text (llama.cpp's llama-perplexity)",
    "embed": "embeddings of texts: the final hidden state pooled (llama.cpp's llama-embedding)",
    "quantize": "a bf16 checkpoint to fp8 or nvfp4",
    "info": "what the installed wheel holds and what this machine has",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()]
    return "\n".join(["Usage: atlas COMMAND [ARGS]...  (atlas COMMAND --help: its flags)", "", "Commands:", *lines])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else USAGE_EXIT
    if args[0] in ("-V", "--version"):
        from . import __version__

        print(f"atlas {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"atlas: error: unknown command {name[:60]!r}; the commands are {', '.join(COMMANDS)} (see atlas --help)",
              file=sys.stderr)
        return USAGE_EXIT
    return int(importlib.import_module(f"atlas.{name}").main(rest, usage=f"atlas {name}"))


if __name__ == "__main__":
    sys.exit(main())
