"""Shared jinja2 environment for build_tools/templates and kernels/templates."""

from __future__ import annotations

import os
from pathlib import Path

import jinja2

from . import REPO

TEMPLATES = REPO / "build_tools" / "templates"


def environment(root: Path = TEMPLATES) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def write_if_changed(path: Path, text: str | bytes) -> bool:
    """Atomic write that leaves the file (and its mtime) alone when unchanged."""
    data = text.encode() if isinstance(text, str) else text
    if path.is_file() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return True
