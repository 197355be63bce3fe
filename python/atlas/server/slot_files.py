"""llama.cpp's POST /slots/{id}?action=save|restore|erase: the one slot's sequence (its prompt
cache's longest resume point, atlas.sequence_state) saved to a file under --slot-save-path, put
back from one, or forgotten. Answers carry llama.cpp's fields (n_saved / n_written, n_restored /
n_read, n_erased, timings)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import AtlasError
from ..llm import LLM
from .errors import RequestError

ACTIONS = ("save", "restore", "erase")
MAX_FILENAME_BYTES = 255
# a file name alone: no separators, no "." or "..", no control characters (llama.cpp's fs_validate_filename)
UNSAFE = re.compile(r'[\x00-\x1f\x7f/\\:*?"<>|]')


def check_slot_dir(path: str | None) -> Path | None:
    """--slot-save-path as a directory, made when missing (AtlasError: one line naming the fix)."""
    if path is None:
        return None
    directory = Path(path).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise AtlasError(f"--slot-save-path {path}: cannot make the directory ({err.strerror}); give a writable "
                         "directory") from None
    return directory


@dataclass(frozen=True)
class SlotRequest:
    action: str  # one of ACTIONS
    filename: str | None  # a plain file name in the slot directory (save, restore)


def slot_action(llm: LLM, directory: Path, request: SlotRequest) -> dict[str, Any]:
    """Run one checked request on the engine thread (the caller's); its answer body."""
    from ..sequence_state import erase_sequence, restore_sequence, save_sequence

    started = time.perf_counter()
    action, filename = request.action, request.filename
    if action == "erase":
        return {"id_slot": 0, "n_erased": erase_sequence(llm.parts.engine)}
    assert filename is not None
    if action == "save":
        saved = save_sequence(llm.parts.engine, directory / filename)
        return {"id_slot": 0, "filename": filename, "n_saved": saved.tokens, "n_written": saved.nbytes,
                "timings": {"save_ms": elapsed_ms(started)}}
    restored = restore_sequence(llm.parts.engine, directory / filename)
    return {"id_slot": 0, "filename": filename, "n_restored": restored.tokens, "n_read": restored.nbytes,
            "timings": {"restore_ms": elapsed_ms(started)}}


def slot_request(slot: str, action: str | None, directory: Path | None, body: object) -> SlotRequest:
    """The request checked, or RequestError as llama-server answers it."""
    if directory is None:
        raise RequestError("this server does not support slot actions; start it with --slot-save-path DIR",
                           None, "not_supported_error", 501)
    if not slot.isdigit() or int(slot) != 0:
        raise RequestError(f"slot {slot[:40]!r} does not exist; this server has one slot, id 0", "id_slot")
    if action not in ACTIONS:
        raise RequestError(f"action {str(action)[:40]!r} is not one of {', '.join(ACTIONS)}; give ?action=save, restore "
                           "or erase", "action")
    return SlotRequest(action, None if action == "erase" else slot_filename(body))


def slot_filename(body: object) -> str:
    if not isinstance(body, dict) or "filename" not in body:
        raise RequestError('the body must be a JSON object with "filename", e.g. {"filename": "chat.bin"}', "filename")
    name = body["filename"]
    if (not isinstance(name, str) or not name.strip() or name in (".", "..") or UNSAFE.search(name)
            or len(name.encode("utf-8", "replace")) > MAX_FILENAME_BYTES):
        raise RequestError(f"filename {str(name)[:60]!r} is not a plain file name; give a name without path "
                           "separators or control characters", "filename")
    return name


def elapsed_ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000.0
