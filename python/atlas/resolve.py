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


def find_in_hf_cache(repo_id: str, revision: str | None = None, cache: Path | None = None) -> Path:
    """The snapshot directory of repo_id in `cache` (default: hf_hub_cache()): the one `revision`
    names (a branch or tag the cache has a ref for, or a commit hash), else the one refs/main
    names, else the newest."""
    cache = hf_hub_cache() if cache is None else cache
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
    if revision is not None:
        snapshot = pinned_snapshot(repo_dir, revision)
        if snapshot is None:
            raise AtlasError(f"revision {revision!r} of {repo_id} is not in the Hugging Face cache ({cache}); "
                             f"{download_hint(repo_id)} --revision {revision}")
    else:
        snapshot = snapshot_of_ref(repo_dir, "main") or max(candidates, key=lambda p: p.stat().st_mtime)
    if not (snapshot / "config.json").is_file():
        raise AtlasError(
            f"the cached snapshot {snapshot} of {repo_id} has no config.json (an incomplete "
            f"download); {download_hint(repo_id)}"
        )
    return snapshot


def local(model_dir: Path, revision: str | None, flag: str) -> Path:
    """A directory (or the demo) as the model: a --revision has no snapshot to pick there."""
    if revision is not None:
        raise AtlasError(f"--revision picks a snapshot of a Hugging Face repo id; {flag} names the directory "
                         f"{model_dir} (check the revision out there instead)")
    return model_dir


def pinned_snapshot(repo_dir: Path, revision: str) -> Path | None:
    """The snapshot of a branch or tag the cache has a ref for, or of a full commit hash."""
    if not revision or revision.startswith("/") or ".." in revision.split("/"):
        return None
    if (by_ref := snapshot_of_ref(repo_dir, revision)) is not None:
        return by_ref
    by_hash = repo_dir / "snapshots" / revision
    return by_hash if re.fullmatch(r"[0-9a-f]{40}", revision) and by_hash.is_dir() else None


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


def resolve_model(arg: str | None, flag: str = "--model", *, revision: str | None = None,
                  download_dir: str | None = None) -> Path:
    """Map a --model value (or another flag's, named in errors) to a checkpoint directory holding
    config.json. revision (vLLM's --revision): a repo id's snapshot by branch, tag or commit hash;
    download_dir (vLLM's --download-dir): the Hugging Face cache to look in."""
    for name, value in (("--revision", revision), ("--download-dir", download_dir)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise AtlasError(f"{name} must be a non-empty string, got {value!r:.60}")
    cache = None if download_dir is None else expand_user(download_dir, "--download-dir")
    if arg is None or arg.lower() == DEMO_NAME:
        return local(demo_dir(), revision, flag)
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
        return local(path.resolve(), revision, flag)
    if exists:
        raise AtlasError(f"{flag} {arg}: is a file; pass the checkpoint directory that holds it")
    if REPO_ID.match(arg):  # Org/Name, or a mistyped relative path: the line says both
        try:
            return find_in_hf_cache(arg, revision, cache)
        except AtlasError as err:
            raise AtlasError(f"{flag} {arg}: no such directory, and {err}") from None
    repo, names = registry_repo(arg)
    if repo is not None:
        return find_in_hf_cache(repo, revision, cache) if repo else local(demo_dir(), revision, flag)
    raise AtlasError(
        f"{flag} {arg}: no such directory, and not a Hugging Face repo id (Org/Name) or a "
        f"registry name ({', '.join(names)})"
    )
