"""scikit-build-core dynamic-metadata provider: the version with the target as its local label.

0.1.0+h200.atlas.demo.bf16 for one tuple, 0.1.0+multi<N>.<hws> for several, 0.1.0+cpu for none.
Also writes python/atlas/_version.py so the source tree and the wheel agree. An unknown
ATLAS_TARGET_* name stops the build here, before anything is compiled.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from atlas.errors import AtlasError
from atlas.targets import load_registry

from . import REPO
from .render import write_if_changed
from .selection import select, version_for

VERSION_FILE = REPO / "python" / "atlas" / "_version.py"


def current_version() -> str:
    return version_for(select(load_registry(), os.environ).targets)


def write_version_file(version: str) -> None:
    write_if_changed(VERSION_FILE, f'"""Written by the build (build_tools/version_provider.py)."""\n\nversion = "{version}"\n')


def dynamic_metadata(field: str, settings: Mapping[str, Any] | None = None, project: Mapping[str, Any] | None = None) -> str:
    if field != "version":
        raise ValueError(f"build_tools.version_provider only provides 'version', not {field!r}")
    try:
        version = current_version()
    except AtlasError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    write_version_file(version)
    return version
