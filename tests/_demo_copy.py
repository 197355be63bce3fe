"""A copy of the embedded demo checkpoint that a test may change (its chat template, an MTP head)."""

from __future__ import annotations

import shutil
from pathlib import Path

from atlas.demo import DEMO_DIR


def demo_copy(path: Path, chat_template: str | None = None) -> Path:
    """The demo's checkpoint files (not its Python modules) copied to `path`, with
    `chat_template` as its chat_template.jinja when given."""
    shutil.copytree(DEMO_DIR, path, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    if chat_template is not None:
        (path / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    return path
