"""resolve_model: directories, the local Hugging Face cache layout, registry names, the demo."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

import atlas.resolve as resolve
from atlas.errors import AtlasError
from atlas.resolve import resolve_model


def random_name(rng: np.random.Generator) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return "".join(rng.choice(list(letters), size=8))


def make_snapshot(cache: Path, repo_id: str, revision: str, with_config: bool = True) -> Path:
    snapshot = cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / revision
    snapshot.mkdir(parents=True)
    if with_config:
        (snapshot / "config.json").write_text("{}", encoding="utf-8")
    return snapshot


def set_ref(cache: Path, repo_id: str, revision: str) -> None:
    refs = cache / ("models--" + repo_id.replace("/", "--")) / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / "main").write_text(revision, encoding="utf-8")


def error_of(arg: str | None) -> str:
    with pytest.raises(AtlasError) as caught:
        resolve_model(arg)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no config.json" in error_of(str(empty))
    assert "is a file" in error_of(str(tmp_path / "config.json"))


def test_repo_id_follows_refs_main(hub: Path, rng: np.random.Generator) -> None:
    repo = f"{random_name(rng)}/{random_name(rng)}-7B"
    pinned = make_snapshot(hub, repo, "a" * 40)
    newer = make_snapshot(hub, repo, "b" * 40)
    os.utime(newer, (time.time() + 100, time.time() + 100))
    set_ref(hub, repo, "a" * 40)
    assert resolve_model(repo) == pinned


def test_repo_id_without_ref_takes_newest(hub: Path, rng: np.random.Generator) -> None:
    repo = f"Org/{random_name(rng)}"
    make_snapshot(hub, repo, "1" * 40)
    newest = make_snapshot(hub, repo, "2" * 40)
    os.utime(newest, (time.time() + 100, time.time() + 100))
    assert resolve_model(repo) == newest


def test_hf_home_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    repo = f"Org/{random_name(rng)}"
    snapshot = make_snapshot(tmp_path / "hf" / "hub", repo, "c" * 40)
    assert resolve_model(repo) == snapshot


def test_missing_repo_says_how_to_download(hub: Path, rng: np.random.Generator) -> None:
    repo = f"Org/{random_name(rng)}"
    message = error_of(repo)
    assert f"hf download {repo}" in message and str(hub) in message
    assert message.startswith(f"--model {repo}: no such directory, and ")  # a relative path mistyped reads the same


def test_incomplete_snapshot(hub: Path, rng: np.random.Generator) -> None:
    repo = f"Org/{random_name(rng)}"
    make_snapshot(hub, repo, "d" * 40, with_config=False)
    assert f"hf download {repo}" in error_of(repo)


def test_registry_name(hub: Path) -> None:
    assert "hf download Qwen/Qwen3.6-35B-A3B" in error_of("qwen3.6-35b-a3b")
    snapshot = make_snapshot(hub, "Qwen/Qwen3.6-35B-A3B", "e" * 40)
    set_ref(hub, "Qwen/Qwen3.6-35B-A3B", "e" * 40)
    assert resolve_model("qwen3.6-35b-a3b") == snapshot
    assert resolve_model("Qwen3.6-35B-A3B") == snapshot


def test_unknown_name_lists_registry(hub: Path, rng: np.random.Generator) -> None:
    message = error_of(random_name(rng))
    assert "qwen3.6-35b-a3b" in message and "no such directory" in message


def test_default_is_the_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve, "DEMO_DIR", tmp_path)
    assert "reinstall atlas" in error_of(None)
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    assert resolve_model(None) == tmp_path
    assert resolve_model("atlas-demo") == tmp_path
    for empty in ("", "  "):  # `--model "$MODEL"` with MODEL unset asked for some model, not the demo
        assert error_of(empty).startswith("--model is empty; give a checkpoint directory")


def test_tilde_of_an_unknown_user(hub: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    user = "nouser" + random_name(rng)
    assert user in error_of(f"~{user}/model") and "give the full path" in error_of(f"~{user}/model")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", f"~{user}/hf")
    assert "HF_HOME" in error_of("Org/Name")


def test_a_broken_ref_falls_back_to_the_newest_snapshot(hub: Path, rng: np.random.Generator) -> None:
    """refs/main that is not UTF-8 or names a revision longer than a file name: the newest snapshot."""
    repo = f"Org/{random_name(rng)}"
    make_snapshot(hub, repo, "1" * 40)
    newest = make_snapshot(hub, repo, "2" * 40)
    os.utime(newest, (time.time() + 100, time.time() + 100))
    ref = hub / ("models--" + repo.replace("/", "--")) / "refs" / "main"
    ref.parent.mkdir(parents=True)
    for content in (b"\xff\xfe", b"a" * 300):
        ref.write_bytes(content)
        assert resolve_model(repo) == newest


def test_impossible_paths_are_one_line(tmp_path: Path) -> None:
    assert "File name too long" in error_of(str(tmp_path / ("x" * 300)))
    assert "is not in the Hugging Face cache" in error_of("Org/" + "n" * 300)  # its cache folder: a name too long
    with pytest.raises(AtlasError, match="^--reference /no/such: no such directory"):
        resolve_model("/no/such", "--reference")


def commit_hash(rng: np.random.Generator) -> str:
    return "".join(rng.choice(list("0123456789abcdef"), size=40))


def test_revision_pins_a_snapshot(hub: Path, rng: np.random.Generator) -> None:
    """vLLM's --revision: a commit hash the cache holds, or a branch / tag it has a ref for, picks
    that snapshot over refs/main; one the cache lacks is one line saying how to fetch it."""
    repo = f"{random_name(rng)}/{random_name(rng)}"
    main, old, tagged = (commit_hash(rng) for _ in range(3))
    snapshots = {revision: make_snapshot(hub, repo, revision) for revision in (main, old, tagged)}
    set_ref(hub, repo, main)
    (hub / ("models--" + repo.replace("/", "--")) / "refs" / "v1.0").write_text(tagged, encoding="utf-8")
    assert resolve_model(repo) == snapshots[main]
    assert resolve_model(repo, revision=old) == snapshots[old]
    assert resolve_model(repo, revision="v1.0") == snapshots[tagged]
    assert resolve_model(repo, revision="main") == snapshots[main]
    for missing in (commit_hash(rng), "v2.0", "../../etc", old[:12]):
        with pytest.raises(AtlasError, match=f"revision '{re.escape(missing)}' of {repo} is not in the Hugging Face "
                                             f"cache .*hf download {repo} --revision"):
            resolve_model(repo, revision=missing)


def test_download_dir_is_the_cache_to_look_in(hub: Path, tmp_path: Path, rng: np.random.Generator) -> None:
    repo = f"{random_name(rng)}/{random_name(rng)}"
    elsewhere = tmp_path / "models"
    snapshot = make_snapshot(elsewhere, repo, commit_hash(rng))
    assert resolve_model(repo, download_dir=str(elsewhere)) == snapshot
    assert "is not in the Hugging Face cache" in error_of(repo)  # not in HF_HUB_CACHE


def test_revision_of_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    for model in (str(tmp_path), None):
        with pytest.raises(AtlasError, match="--revision picks a snapshot of a Hugging Face repo id"):
            resolve_model(model, revision="main")
    with pytest.raises(AtlasError, match="--revision must be a non-empty string"):
        resolve_model("org/name", revision=5)  # type: ignore[arg-type]


def test_the_commands_take_revision_and_download_dir(hub: Path, tmp_path: Path, rng: np.random.Generator,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """atlas.run --revision / --download-dir reach the lookup: a revision the cache lacks is the
    one-line refusal, before anything loads."""
    from atlas.run import main

    repo = f"{random_name(rng)}/{random_name(rng)}"
    make_snapshot(tmp_path / "models", repo, commit_hash(rng))
    assert main(["--model", repo, "--download-dir", str(tmp_path / "models"), "--revision", "v9", "-p", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"revision 'v9' of {repo} is not in the Hugging Face cache ({tmp_path / 'models'})" in err
