"""--model -> checkpoint directory: the embedded demo, a directory, a registry name or a Hugging
Face repo id already in the local HF cache. Nothing is downloaded."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .demo import DEMO_DIR, DEMO_NAME
from .errors import AtlasError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def demo_dir() -> Path:
    """The embedded atlas-demo checkpoint shipped inside the package."""
    if not (DEMO_DIR / "config.json").is_file():
        raise AtlasError(f"the embedded demo model is missing from {DEMO_DIR}; reinstall atlas")
    return DEMO_DIR


def expand_user(value: str, what: str) -> Path:
    """Path(value) with a leading ~ or ~user expanded; an unknown user is one AtlasError line."""
    try:
        return Path(value).expanduser()
    except RuntimeError:
        raise AtlasError(f"{what} {value}: its ~ names no home directory; give the full path") from None


def hf_hub_cache() -> Path:
    """HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub (huggingface_hub's order)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return expand_user(os.environ[var], var)
    if os.environ.get("HF_HOME"):
        return expand_user(os.environ["HF_HOME"], "HF_HOME") / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = expand_user(xdg, "XDG_CACHE_HOME") if xdg else expand_user("~/.cache", "the cache directory")
    return base / "huggingface" / "hub"


def download_hint(repo_id: str) -> str:
    return f"fetch it with: hf download {repo_id}"


def find_in_hf_cache(repo_id: str) -> Path:
    """The snapshot directory of repo_id: the one refs/main names, else the newest."""
    cache = hf_hub_cache()
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    try:
        candidates = [p for p in snapshots.iterdir() if p.is_dir()] if snapshots.is_dir() else []
    except OSError:  # a repo id longer than a file name, an unreadable cache: not there
        candidates = []
    if not candidates:
        raise AtlasError(
            f"model {repo_id} is not in the Hugging Face cache ({cache}); {download_hint(repo_id)}"
        )
    snapshot = snapshot_of_ref(repo_dir, "main") or max(candidates, key=lambda p: p.stat().st_mtime)
    if not (snapshot / "config.json").is_file():
        raise AtlasError(
            f"the cached snapshot {snapshot} of {repo_id} has no config.json (an incomplete "
            f"download); {download_hint(repo_id)}"
        )
    return snapshot


def snapshot_of_ref(repo_dir: Path, ref: str) -> Path | None:
    """The snapshot a ref names; None when the ref is missing or unreadable (then the newest wins)."""
    try:
        revision = (repo_dir / "refs" / ref).read_text(encoding="utf-8").strip()
        snapshot = repo_dir / "snapshots" / revision
        return snapshot if revision and snapshot.is_dir() else None
    except (OSError, UnicodeDecodeError):
        return None


def registry_repo(name: str) -> tuple[str | None, list[str]]:
    """(hf_repo of the registry model called `name` or None, all registry model names).
    An hf_repo of "" means the embedded demo."""
    from .targets import load_registry

    models = load_registry().models
    match = next((m for key, m in models.items() if key.lower() == name.lower()), None)
    return (None if match is None else match.hf_repo), sorted(models)


def resolve_model(arg: str | None, flag: str = "--model") -> Path:
    """Map a --model value (or another flag's, named in errors) to a checkpoint directory holding config.json."""
    if arg is None or arg.lower() == DEMO_NAME:
        return demo_dir()
    if not arg.strip():  # `--model "$MODEL"` with MODEL unset: not a request for the demo
        raise AtlasError(f"{flag} is empty; give a checkpoint directory, a Hugging Face repo id (Org/Name) or a "
                         f"registry name ({', '.join(registry_repo(DEMO_NAME)[1])}), or leave it out for the demo model")
    path = expand_user(arg, flag)
    try:
        is_dir, exists = path.is_dir(), path.exists()
    except OSError as err:  # a name too long, a permission denied on the way
        raise AtlasError(f"{flag} {arg[:80]}: {err.strerror}; give a checkpoint directory") from None
    if is_dir:
        if not (path / "config.json").is_file():
            raise AtlasError(f"{path} has no config.json; point {flag} at a checkpoint directory")
        return path.resolve()
    if exists:
        raise AtlasError(f"{flag} {arg}: is a file; pass the checkpoint directory that holds it")
    if REPO_ID.match(arg):  # Org/Name, or a mistyped relative path: the line says both
        try:
            return find_in_hf_cache(arg)
        except AtlasError as err:
            raise AtlasError(f"{flag} {arg}: no such directory, and {err}") from None
    repo, names = registry_repo(arg)
    if repo is not None:
        return find_in_hf_cache(repo) if repo else demo_dir()
    raise AtlasError(
        f"{flag} {arg}: no such directory, and not a Hugging Face repo id (Org/Name) or a "
        f"registry name ({', '.join(names)})"
    )
