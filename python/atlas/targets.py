"""targets.toml: the registry of hardware, models and quantizations (stdlib only).

Used by the build (build_tools) and by the runtime (the wheel ships atlas/targets.toml). Every
value is validated on load; an error names the file, the key and what was expected.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from .config import read_json_object
from .errors import AtlasError

_HERE = Path(__file__).resolve().parent
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_GENCODE = re.compile(r"^-gencode=arch=compute_(\d+a?),code=(sm|compute)_(\d+a?)$")
_CC = re.compile(r"^\d+\.\d+$")


@dataclass(frozen=True)
class Hardware:
    name: str
    sm: int
    arch: str  # sm_90a, or compute_80 for a PTX-only target
    gencode: tuple[str, ...]
    serves: tuple[str, ...]  # compute capabilities run natively, "9.0"
    serves_min: str  # lowest compute capability served by PTX JIT; "" for none
    aliases: tuple[str, ...]
    extra_flags: tuple[str, ...]

    @property
    def virtual_arch(self) -> str:
        """The PTX target, e.g. compute_90a."""
        return "compute_" + _GENCODE.match(self.gencode[0]).group(1)  # type: ignore[union-attr]

    @property
    def has_cubin(self) -> bool:
        return self.arch.startswith("sm_")

    @property
    def check_arch(self) -> str:
        """Real arch ptxas compiles for: the cubin arch, or the JIT floor for PTX-only targets."""
        return self.arch if self.has_cubin else "sm_" + self.virtual_arch.removeprefix("compute_")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "sm": self.sm, "arch": self.arch, "gencode": list(self.gencode),
            "serves": list(self.serves), "serves_min": self.serves_min,
            "aliases": list(self.aliases), "extra_flags": list(self.extra_flags),
            "virtual_arch": self.virtual_arch, "has_cubin": self.has_cubin,
        }


@dataclass(frozen=True)
class Model:
    name: str
    hf_repo: str
    model_types: tuple[str, ...]
    recognise: tuple[str, ...]
    constants: Mapping[str, int]

    def to_dict(self) -> dict[str, Any]:
        """Template context: name, hf_repo, constants, and every constant at top level too."""
        return {**self.constants, "name": self.name, "hf_repo": self.hf_repo,
                "constants": dict(self.constants), "model_types": list(self.model_types)}


@dataclass(frozen=True)
class QuantRule:
    file: str  # "" when `none`
    key: str
    values: tuple[str, ...]
    none: bool


@dataclass(frozen=True)
class Quant:
    name: str
    order: int
    rules: tuple[QuantRule, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "order": self.order}


@dataclass(frozen=True)
class Registry:
    path: Path
    hardware: Mapping[str, Hardware]
    models: Mapping[str, Model]
    quants: Mapping[str, Quant]

    def resolve_hardware(self, name: str) -> Hardware | None:
        """A hardware by name or alias."""
        if name in self.hardware:
            return self.hardware[name]
        return next((hw for hw in self.hardware.values() if name in hw.aliases), None)

    def hardware_names(self) -> list[str]:
        """Names and aliases, for error messages."""
        return sorted([*self.hardware, *(a for hw in self.hardware.values() for a in hw.aliases)])


def default_path() -> Path:
    """The wheel ships atlas/targets.toml; the source tree keeps it at the repo root."""
    shipped = _HERE / "targets.toml"
    return shipped if shipped.is_file() else _HERE.parent.parent / "targets.toml"


class _Reader:
    """Typed access to the parsed TOML with errors naming file and key."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, expected: str, got: object = None) -> AtlasError:
        tail = "" if got is None else f", got {got!r}"
        return AtlasError(f"{self.path}: key '{key}': expected {expected}{tail}")

    def table(self, data: Mapping[str, Any], prefix: str, field: str) -> Mapping[str, Any]:
        value = data.get(field)
        if not isinstance(value, dict) or not value:
            raise self.fail(f"{prefix}.{field}".lstrip("."), "a non-empty table", value)
        return value

    def get(self, data: Mapping[str, Any], prefix: str, field: str, kind: type) -> Any:
        key = f"{prefix}.{field}"
        if field not in data:
            raise self.fail(key, f"a {kind.__name__} (missing)")
        value = data[field]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise self.fail(key, "an integer", value)
        if not isinstance(value, kind):
            raise self.fail(key, f"a {kind.__name__}", value)
        return value

    def strings(self, data: Mapping[str, Any], prefix: str, field: str) -> tuple[str, ...]:
        value = self.get(data, prefix, field, list)
        if not all(isinstance(v, str) for v in value):
            raise self.fail(f"{prefix}.{field}", "a list of strings", value)
        return tuple(value)

    def name(self, key: str, name: str) -> str:
        if not _NAME.match(name):
            raise self.fail(key, "a lowercase name of [a-z0-9._-]", name)
        return name

    def unknown(self, data: Mapping[str, Any], prefix: str, allowed: Iterable[str]) -> None:
        extra = sorted(set(data) - set(allowed))
        if extra:
            raise self.fail(f"{prefix}.{extra[0]}".lstrip("."), f"one of the known keys {sorted(allowed)}")


def _hardware(r: _Reader, name: str, data: Mapping[str, Any]) -> Hardware:
    p = f"hardware.{r.name(f'hardware.{name}', name)}"
    r.unknown(data, p, ("sm", "arch", "gencode", "serves", "serves_min", "aliases", "extra_flags"))
    gencode = r.strings(data, p, "gencode")
    if len(gencode) != 1 or not _GENCODE.match(gencode[0]):
        raise r.fail(f"{p}.gencode", "one flag like '-gencode=arch=compute_90a,code=sm_90a'", gencode)
    arch = r.get(data, p, "arch", str)
    code = _GENCODE.match(gencode[0])
    if arch != f"{code.group(2)}_{code.group(3)}":  # type: ignore[union-attr]
        raise r.fail(f"{p}.arch", f"the code= of its gencode ({code.group(2)}_{code.group(3)})", arch)  # type: ignore[union-attr]
    serves = r.strings(data, p, "serves")
    serves_min = r.get(data, p, "serves_min", str)
    for cc in (*serves, *([serves_min] if serves_min else [])):
        if not _CC.match(cc):
            raise r.fail(f"{p}.serves", "compute capabilities like '9.0'", cc)
    if not serves and not serves_min:
        raise r.fail(f"{p}.serves", "at least one compute capability (or serves_min)")
    aliases = tuple(r.name(f"{p}.aliases", a) for a in r.strings(data, p, "aliases"))
    return Hardware(name, r.get(data, p, "sm", int), arch, gencode, serves, serves_min, aliases,
                    r.strings(data, p, "extra_flags"))


def _model(r: _Reader, name: str, data: Mapping[str, Any]) -> Model:
    p = f'models."{r.name(f"models.{name}", name)}"'
    r.unknown(data, p, ("hf_repo", "model_types", "recognise", "constants"))
    constants = r.table(data, p, "constants")
    for key, value in constants.items():
        if not re.match(r"^[a-z_][a-z0-9_]*$", key) or isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise r.fail(f"{p}.constants.{key}", "a positive integer named like a C identifier", value)
    recognise = r.strings(data, p, "recognise")
    missing = [k for k in recognise if k not in constants]
    if missing:
        raise r.fail(f"{p}.recognise", f"names of its constants (unknown: {missing})")
    model_types = r.strings(data, p, "model_types")
    if not model_types:
        raise r.fail(f"{p}.model_types", "at least one model_type")
    return Model(name, r.get(data, p, "hf_repo", str), model_types, recognise, dict(constants))


def _quant(r: _Reader, name: str, data: Mapping[str, Any]) -> Quant:
    p = f"quants.{r.name(f'quants.{name}', name)}"
    r.unknown(data, p, ("order", "rules"))
    rules = []
    for i, rule in enumerate(r.get(data, p, "rules", list)):
        rp = f"{p}.rules[{i}]"
        if not isinstance(rule, dict):
            raise r.fail(rp, "an inline table", rule)
        r.unknown(rule, rp, ("file", "key", "values", "none"))
        if rule.get("none") is True and len(rule) == 1:
            rules.append(QuantRule("", "", (), True))
            continue
        rules.append(QuantRule(r.get(rule, rp, "file", str), r.get(rule, rp, "key", str),
                               r.strings(rule, rp, "values"), False))
    if not rules:
        raise r.fail(f"{p}.rules", "at least one rule")
    return Quant(name, r.get(data, p, "order", int), tuple(rules))


def parse_registry(path: Path, data: Mapping[str, Any]) -> Registry:
    r = _Reader(path)
    if data.get("schema") != 1:
        raise r.fail("schema", "1", data.get("schema"))
    r.unknown(data, "", ("schema", "hardware", "models", "quants"))
    hardware = {n: _hardware(r, n, d if isinstance(d, dict) else {}) for n, d in r.table(data, "", "hardware").items()}
    models = {n: _model(r, n, d if isinstance(d, dict) else {}) for n, d in r.table(data, "", "models").items()}
    quants = {n: _quant(r, n, d if isinstance(d, dict) else {}) for n, d in r.table(data, "", "quants").items()}
    names = [*hardware, *(a for hw in hardware.values() for a in hw.aliases)]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise r.fail("hardware", "unique names and aliases", dupes)
    return Registry(path, hardware, models, dict(sorted(quants.items(), key=lambda kv: kv[1].order)))


def load_registry(path: Path | str | None = None) -> Registry:
    """Load and validate targets.toml (default: the shipped or source-tree copy)."""
    return _load_cached(Path(path).resolve() if path is not None else default_path())


@cache
def _load_cached(path: Path) -> Registry:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AtlasError(f"{path}: file not found; reinstall atlas or pass the path of targets.toml") from None
    except tomllib.TOMLDecodeError as err:
        raise AtlasError(f"{path}: not valid TOML ({err}); fix the syntax") from None
    return parse_registry(path, data)


def _cc_tuple(cc: str) -> tuple[int, int]:
    major, minor = cc.split(".")
    return int(major), int(minor)


def hardware_candidates(cc: str | tuple[int, int], registry: Registry | None = None) -> list[Hardware]:
    """Hardware able to run on a GPU of compute capability cc, best first (native cubin, then PTX JIT)."""
    reg = registry or load_registry()
    want = cc if isinstance(cc, tuple) else _cc_tuple(cc)
    native = [hw for hw in reg.hardware.values() if any(_cc_tuple(s) == want for s in hw.serves)]
    jit = [hw for hw in reg.hardware.values() if hw.serves_min and _cc_tuple(hw.serves_min) <= want]
    jit.sort(key=lambda hw: _cc_tuple(hw.serves_min), reverse=True)
    return native + [hw for hw in jit if hw not in native]


def hardware_for_compute_capability(
    cc: str | tuple[int, int], available: Iterable[str] | None = None, registry: Registry | None = None
) -> Hardware | None:
    """The best hardware target for cc, optionally among `available` names (e.g. the wheel's tuples)."""
    allowed = None if available is None else set(available)
    for hw in hardware_candidates(cc, registry):
        if allowed is None or hw.name in allowed:
            return hw
    return None


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's config: nested under text_config for multimodal checkpoints."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def _config_value(text: Mapping[str, Any], key: str) -> Any:
    if key == "rotary_dim" and "rotary_dim" not in text:
        head_dim = text.get("head_dim")
        rope = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
        factor = text.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
        return None if head_dim is None else int(head_dim * factor)
    return text.get(key)


def recognise_model(config: Mapping[str, Any], registry: Registry | None = None) -> str | None:
    """The registry model a checkpoint's config.json is, or None (num_hidden_layers is not compared)."""
    reg = registry or load_registry()
    text = text_config(config)
    model_type = text.get("model_type", config.get("model_type"))
    for model in reg.models.values():
        if model_type not in model.model_types and config.get("model_type") not in model.model_types:
            continue
        if all(_config_value(text, k) == model.constants[k] for k in model.recognise):
            return model.name
    return None


def _lookup(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(part)
    return data


def _read_json(path: Path) -> dict[str, Any] | None:
    return read_json_object(path) if path.is_file() else None


def _quant_sources(model_dir: Path) -> dict[str, dict[str, Any] | None]:
    config = _read_json(model_dir / "config.json") or {}
    qc = config.get("quantization_config") or text_config(config).get("quantization_config")
    return {"config.json": qc if isinstance(qc, dict) else None,
            "hf_quant_config.json": _read_json(model_dir / "hf_quant_config.json")}


def recognise_quant(model_dir: Path | str, registry: Registry | None = None) -> str:
    """The quant of a checkpoint directory; AtlasError when it matches no registry quant."""
    reg = registry or load_registry()
    sources = _quant_sources(Path(model_dir))
    for quant in reg.quants.values():
        for rule in quant.rules:
            if rule.none and all(v is None for v in sources.values()):
                return quant.name
            data = sources.get(rule.file) if not rule.none else None
            value = _lookup(data, rule.key) if data is not None else None
            if isinstance(value, str) and value.lower() in {v.lower() for v in rule.values}:
                return quant.name
    found = sources["config.json"] or sources["hf_quant_config.json"]
    raise AtlasError(
        f"{model_dir}: unsupported quantization {json.dumps(found)[:120]}; "
        f"atlas supports {', '.join(reg.quants)} (see targets.toml [quants])"
    )
