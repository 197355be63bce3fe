"""--check-weights: NaN and infinity counted on the stored bits, each float dtype against numpy's
own isfinite, and a damaged checkpoint refused in one line only when the flag asks for it."""

from __future__ import annotations

import warnings
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


def poison(model_dir: Path, rng: np.random.Generator, name: str | None = None) -> str:
    """One value of a bf16 tensor of the checkpoint (`name`, else a random matrix) overwritten with
    NaN or infinity, in place in the file; the tensor's name."""
    checkpoint = Checkpoint.open(model_dir)
    names = [n for n in checkpoint.names() if checkpoint.dtype(n) == "BF16" and len(checkpoint.shape(n)) == 2]
    name = name or names[int(rng.integers(len(names)))]
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
    code = main(flags)  # unchecked, the damaged model runs (the flag is opt-in) unless the damage reaches the output
    out, err = capsys.readouterr()
    if code == 0:
        assert out.count("\n") == clean.count("\n")
    else:  # the damage reached the prompt's last hidden state, or a generated token's state
        said = err.strip().splitlines()[-1]
        assert code == 2 and said.startswith(("atlas.run: error: the model's hidden state",
                                              "atlas.run: error: the model's logits went NaN")), err


@pytest.mark.parametrize("speculative", [False, True])
def test_a_nonfinite_hidden_state_is_one_line(tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str],
                                              speculative: bool) -> None:
    """NaN or infinity in the final norm's weight reaches every prompt's last hidden row: generate,
    stream and atlas.run stop with one line (no numpy warnings) instead of picking from NaN logits,
    with and without MTP speculation."""
    from test_speculative import add_mtp_head, new_seed

    from atlas import LLM
    from atlas.errors import AtlasError

    model = demo_copy(tmp_path / "demo")
    if speculative:
        add_mtp_head(model, new_seed(), fused=True)
    poison(model, rng, "model.norm.weight")
    llm = LLM(str(model), device="cpu", spec_k=2 if speculative else 0)
    assert llm.speculation.startswith("off") != speculative
    for call in (lambda: llm.generate("Flat is", max_tokens=4), lambda: "".join(llm.stream("Flat is", max_tokens=4))):
        for _ in range(2):  # the second time finds no checkpoint of the first
            with pytest.raises(AtlasError, match="hidden state after the prompt") as err:
                call()
            assert "\n" not in str(err.value) and "--check-weights" in str(err.value)
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:  # numpy's would print lines beside the one
        warnings.simplefilter("always")
        assert main(["--model", str(model), "--device", "cpu", "--max-tokens", "4", "--prompt", "Flat is"]) == 2
    assert not caught, [str(w.message) for w in caught]
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("atlas.run: error: the model's hidden state")


def poison_row(model_dir: Path, name: str, row: int) -> None:
    """Row `row` of a bf16 matrix of the checkpoint overwritten with NaN, in place in the file."""
    checkpoint = Checkpoint.open(model_dir)
    info, width = checkpoint.info(name), checkpoint.shape(name)[1]
    checkpoint.close()
    with open(info.path, "r+b") as file:
        file.seek(info.start + 2 * row * width)
        file.write(np.full(width, 0x7FC0, "<u2").tobytes())


REGEX = "[a-z ]{60}"  # longer than the answer: no end of text is allowed


@pytest.mark.parametrize("mode", ["plain", "speculative", "regex"])
def test_logits_gone_nan_mid_answer_are_one_line(tmp_path: Path, rng: np.random.Generator, mode: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A generated token whose embedding row is NaN (the prompt's are sound, so the prompt's check
    passes) turns the next logits to NaN alone: the pick is no token, and generate, stream and
    atlas.run stop there with one line instead of answering with token 0 (the NaN row's argmax
    was 0), greedy or sampled, with and without MTP speculation or structured output."""
    from test_speculative import add_mtp_head, new_seed

    from atlas import LLM
    from atlas.errors import AtlasError

    model = demo_copy(tmp_path / "demo")
    if mode == "speculative":
        add_mtp_head(model, new_seed(), fused=True)
    opts = {"max_tokens": 12, "temperature": float(rng.choice([0.0, 0.8])), "seed": int(rng.integers(1 << 30)),
            **({"regex": REGEX} if mode == "regex" else {"ignore_eos": True})}
    prompt = LLM(str(model), device="cpu", spec_k=0).tokenizer.encode("Flat is")
    tokens = LLM(str(model), device="cpu", spec_k=0).generate(prompt, **opts).token_ids
    fresh = [t for i, t in enumerate(tokens[:-1]) if t not in prompt and t not in tokens[:i]]
    if not fresh:
        pytest.skip(f"the answer {tokens} repeats the prompt's tokens alone")
    poison_row(model, "model.embed_tokens.weight", fresh[0])
    llm = LLM(str(model), device="cpu", spec_k=2 if mode == "speculative" else 0)
    for call in (lambda: llm.generate(prompt, **opts), lambda: "".join(llm.stream(prompt, **opts))):
        with pytest.raises(AtlasError, match="logits went NaN during the generation") as err:
            call()
        assert "\n" not in str(err.value) and "--check-weights" in str(err.value)
    capsys.readouterr()
    flags = ["--temperature", str(opts["temperature"]), "--seed", str(opts["seed"])]
    flags += ["--regex", REGEX] if mode == "regex" else ["--ignore-eos"]
    assert main(["--model", str(model), "--device", "cpu", "--max-tokens", "12", "--prompt", "Flat is", *flags]) == 2
    assert "logits went NaN during the generation" in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_reference_ops_pass_nonfinite_values_on_without_warnings(rng: np.random.Generator) -> None:
    """Infinity in an activation (inf / inf, inf - inf: numpy's invalid-value warnings) flows on as
    NaN, as on a GPU, for the hidden-state check to report in one line."""
    from atlas.backends.numpy_backend import NumpyBackend

    backend = NumpyBackend()
    x = rng.standard_normal((2, 8)).astype(np.float32)  # [T, H]
    x[0, int(rng.integers(8))] = rng.choice([np.inf, -np.inf])
    gate_up = np.concatenate([x, x], axis=-1)  # [T, 2H]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        normed = backend.rms_norm(x, np.ones(8, np.float32), 1e-6)  # [T, H]
        mixed = backend.silu_mul(gate_up)  # [T, H]
    assert not caught, [str(w.message) for w in caught]
    assert not np.isfinite(normed[0]).all() and np.isfinite(normed[1]).all() and not np.isfinite(mixed[0]).all()
