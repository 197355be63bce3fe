"""Requests' sampling defaults as vLLM's --generation-config and --override-generation-config set
them: `auto` (the model's generation_config.json), `vllm` (none: OpenAI's defaults) or a folder
holding a generation_config.json, then the override's fields on top. Both are read before the
model loads, so a bad value is one line at start."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from . import json_text
from .config import SAMPLING_DEFAULT_RANGES, read_json_object, read_sampling_defaults
from .errors import AtlasError
from .sampling import is_int, is_real

MODES = ("auto", "vllm")
EXAMPLE = """'{"temperature": 0.6, "top_p": 0.95}'"""


@dataclass(frozen=True)
class GenerationDefaults:
    source: str = "auto"  # "auto", "vllm" or a folder holding generation_config.json
    override: str | None = None  # --override-generation-config: a JSON object of sampling fields

    def check(self) -> None:
        self.folder_defaults()
        self.overrides()

    def resolve(self, model_defaults: tuple[tuple[str, float], ...]) -> dict[str, float]:
        """The defaults requests get: the source's, the override's fields replacing theirs."""
        base = dict(model_defaults) if self.source == "auto" else self.folder_defaults()
        return {**base, **self.overrides()}

    def describe(self) -> str:
        source = {"auto": "the model's generation_config.json", "vllm": "none (vLLM's defaults)"}.get(
            self.source, f"{Path(self.source) / 'generation_config.json'}")
        return source + (" and --override-generation-config" if self.override is not None else "")

    def folder_defaults(self) -> dict[str, float]:
        """A folder's generation_config.json sampling fields ({} for auto and vllm)."""
        if self.source in MODES:
            return {}
        if not Path(self.source).is_dir():
            raise AtlasError(f"--generation-config {self.source!r} is neither auto, vllm nor a folder holding "
                             "generation_config.json")
        path = Path(self.source) / "generation_config.json"
        return dict(read_sampling_defaults(read_json_object(path), path))

    def overrides(self) -> dict[str, float]:
        if self.override is None:
            return {}
        value = json_text.flag_value(self.override, "--override-generation-config", f"give e.g. {EXAMPLE}")
        if not isinstance(value, dict):
            raise AtlasError(f"--override-generation-config must be a JSON object, e.g. {EXAMPLE}")
        return {key: checked_default(key, field) for key, field in value.items()}


def checked_default(key: str, value: object) -> float:
    """One override field within the range generation_config.json's would have to be in."""
    if key not in SAMPLING_DEFAULT_RANGES:
        raise AtlasError(f"--override-generation-config: {key!r} is not a sampling default here; give "
                         + ", ".join(SAMPLING_DEFAULT_RANGES))
    low, high, low_open = SAMPLING_DEFAULT_RANGES[key]
    number_ok = is_int(value) if key == "top_k" else is_real(value) and math.isfinite(float(value))  # type: ignore[arg-type]
    if not number_ok or not (low < value <= high if low_open else low <= value <= high):  # type: ignore[operator]
        kind = "an integer" if key == "top_k" else "a number"
        raise AtlasError(f"--override-generation-config: {key} must be {kind} in {'(' if low_open else '['}{low:g}, "
                         f"{high:g}], got {value!r}")
    return float(max(value, 0)) if key == "top_k" else float(value)  # type: ignore[call-overload,arg-type]
