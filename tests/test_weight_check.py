"""--check-weights: NaN and infinity counted on the stored bits, each float dtype against numpy's
own isfinite, and a damaged checkpoint refused in one line only when the flag asks for it."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from _demo_copy import demo_copy
from atlas import weight_check
from atlas.run import main
from atlas.safetensors import DTYPES, Checkpoint
from atlas.weight_check import EXPONENT_BITS, nonfinite_count


@pytest.mark.parametrize("dtype", sorted(EXPONENT_BITS))
def test_nonfinite_count_matches_isfinite(dtype: str, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weight_check, "SLICE_BYTES", 64)  # many slices, one cut mid-run of bad values
    values = rng.standard_normal(int(rng.integers(300, 900))) * 10.0 ** rng.integers(-3, 3)  # [N]
    bad = rng.choice(values.size, int(rng.integers(0, 40)), replace=False)
    values[bad] = rng.choice([np.nan, np.inf, -np.inf], bad.size)
    stored = values.astype(DTYPES[dtype])  # e4m3fn stores infinity and overflow as NaN
    expected = int(np.count_nonzero(~np.isfinite(stored.astype(np.float64))))
    assert expected >= bad.size
    assert nonfinite_count(stored.reshape(-1, 1), dtype) == expected
    largest = np.array([ml_dtypes.finfo(DTYPES[dtype]).max, -ml_dtypes.finfo(DTYPES[dtype]).max], DTYPES[dtype])
    assert nonfinite_count(largest, dtype) == 0


def poison(model_dir: Path, rng: np.random.Generator) -> str:
    """One value of a random bf16 matrix of the checkpoint overwritten with NaN or infinity, in
    place in the file; the tensor's name."""
    checkpoint = Checkpoint.open(model_dir)
    names = [n for n in checkpoint.names() if checkpoint.dtype(n) == "BF16" and len(checkpoint.shape(n)) == 2]
    name = names[int(rng.integers(len(names)))]
    info = checkpoint.info(name)
    checkpoint.close()
    code = rng.choice([0x7FC0, 0x7F80, 0xFF80]).astype("<u2").tobytes()  # NaN, +inf, -inf
    with open(info.path, "r+b") as file:
        file.seek(info.start + 2 * int(rng.integers(info.nbytes // 2)))
        file.write(code)
    return name


def test_a_damaged_checkpoint_is_refused_only_when_asked(tmp_path: Path, rng: np.random.Generator,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    model = demo_copy(tmp_path / "demo")
    flags = ["--model", str(model), "--device", "cpu", "--max-tokens", "4", "--prompt", "Flat is"]
    assert main([*flags, "--check-weights"]) == 0
    clean = capsys.readouterr().out
    name = poison(model, rng)
    assert main([*flags, "--check-tensors"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"atlas.run: error: tensor {name!r} in {model / 'model.safetensors'} holds 1 NaN")
    assert "fetch it again" in lines[-1] and not any("Traceback" in line for line in lines)
    assert main(flags) == 0  # unchecked, the damaged model runs (the flag is opt-in)
    assert capsys.readouterr().out.count("\n") == clean.count("\n")
