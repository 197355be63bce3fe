"""The embedded atlas-demo checkpoint: a tiny qwen3_5_moe_text model that recites The Zen of Python.

The files beside this module (config.json, generation_config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) are made by scripts/train_demo.py; README.md says how.
Stdlib only, so the runtime can resolve the default model without importing numpy or torch.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib
import io
from pathlib import Path

DEMO_NAME = "atlas-demo"
DEMO_DIR = Path(__file__).resolve().parent
DEMO_PROMPT = "Beautiful is better than"
ZEN_TITLE = "The Zen of Python, by Tim Peters"


def zen_of_python() -> str:
    """The aphorisms of `import this`, starting at "Beautiful", without the title line."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the text
        this = importlib.import_module("this")
    text = codecs.decode(this.s, "rot13")
    return text[text.index(DEMO_PROMPT) :]
