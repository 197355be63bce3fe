"""python -m atlas.verify: every check passes on the CUDA stand-in (the kernels' bf16 roundings),
a broken op is named under the check that meets it while the others still run, a tuple that cannot
run is skipped with its reason, a seed repeats the run, and bad input or no CUDA backend is one line
with exit 2. On a GPU (or the emulator) the real kernels pass."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from _checkpoints import TinyModel, write_checkpoint
from _cuda_stand_in import CudaRounding
from _gpu import require_demo_cuda
from atlas.errors import AtlasError
from atlas.verify import main
from test_cross_check import BrokenLaterPasses

DEMO_CHECKS = 9  # two bf16 forms, five KV levels, two quantized formats
DEMO_VOCAB = 512


def use_backend(monkeypatch: pytest.MonkeyPatch, make: object) -> None:
    import atlas.backends as backends

    monkeypatch.setattr(backends, "open_cuda_backend", make)
    monkeypatch.delenv("ATLAS_REQUIRE_GPU", raising=False)


def results(out: str) -> dict[str, str]:
    """check name -> its status, from the result lines."""
    found = {}
    for line in out.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("PASS", "FLAGGED", "FAILED", "SKIPPED") and ": " in rest:
            found[rest.strip().split(": ")[0]] = status
    return found


def test_every_check_passes_on_the_stand_in(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    use_backend(monkeypatch, lambda model_dir, spec, run: CudaRounding())
    assert main([]) == 0
    out = capsys.readouterr().out
    assert list(results(out).values()) == ["PASS"] * DEMO_CHECKS, out
    assert f"PASS: {DEMO_CHECKS} checks within relative error 0.02 (0 skipped)" in out


def test_a_broken_op_is_named_and_the_other_checks_run(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    use_backend(monkeypatch, lambda model_dir, spec, run: BrokenLaterPasses())
    assert main([]) == 1
    out = capsys.readouterr().out
    found = results(out)
    assert found.pop("demo bf16, prefill passes of 7") == "FLAGGED" and set(found.values()) == {"PASS"}, out
    assert "FLAGGED  demo bf16, prefill passes of 7: layer.3.attn.core: relative error" in out
    assert "FAILED: 1 of 9 checks (0 skipped); first: demo bf16, prefill passes of 7" in out


class FaultingTurbo3(CudaRounding):
    def attention(self, q, k, v, cache, positions, scale):  # type: ignore[no-untyped-def]
        if not isinstance(cache.k, np.ndarray) and cache.k.level.name == "turbo3":
            raise RuntimeError("illegal address in the turbo3 attention kernel")
        return super().attention(q, k, v, cache, positions, scale)


def test_missing_tuples_are_skipped_and_a_fault_fails_its_check(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    def backend(model_dir: Path, spec: object, run: object) -> CudaRounding:
        if Path(model_dir).name in ("fp8", "nvfp4"):
            raise AtlasError(f"the installed wheel holds no h200/atlas-demo/{Path(model_dir).name} tuple")
        return FaultingTurbo3()

    use_backend(monkeypatch, backend)
    assert main([]) == 1
    out = capsys.readouterr().out
    found = results(out)
    assert found["demo fp8"] == found["demo nvfp4"] == "SKIPPED" and found["demo, KV cache turbo3"] == "FAILED", out
    assert "SKIPPED  demo nvfp4: the installed wheel holds no h200/atlas-demo/nvfp4 tuple" in out
    assert "FAILED   demo, KV cache turbo3: RuntimeError: illegal address in the turbo3 attention kernel" in out
    assert "FAILED: 1 of 9 checks (2 skipped)" in out


def test_a_seed_draws_the_same_prompts(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                       rng: np.random.Generator) -> None:
    use_backend(monkeypatch, lambda model_dir, spec, run: CudaRounding())
    seed = str(int(rng.integers(1 << 31)))
    capsys.readouterr()  # the rng fixture's own line
    runs = []
    for _ in range(2):
        assert main(["--seed", seed]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and f"seed {seed}" in runs[0]


def test_an_own_checkpoint_is_checked_cut_to_its_first_layers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    use_backend(monkeypatch, lambda model_dir, spec, run: CudaRounding())
    write_checkpoint(tmp_path, TinyModel(vocab_size=96, num_hidden_layers=4), int.from_bytes(np.random.bytes(4), "little"))
    assert main(["--model", str(tmp_path), "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert results(out)[f"{tmp_path}, first 2 layers"] == "PASS", out
    assert f"PASS: {DEMO_CHECKS + 1} checks" in out


def test_a_wheel_without_the_demo_verifies_the_model_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A per-target wheel (one model's tuples): the demo's checks are skipped, --model's runs;
    without --model the one line says what to do."""
    from atlas.config import load_spec

    def qwen_wheel(model_dir: Path, spec: object, run: object) -> CudaRounding:
        if load_spec(model_dir).vocab_size == DEMO_VOCAB:
            raise AtlasError("the installed wheel holds h200/qwen3.6-35b-a3b/bf16 only")
        return CudaRounding()

    use_backend(monkeypatch, qwen_wheel)
    write_checkpoint(tmp_path, TinyModel(vocab_size=96), int.from_bytes(np.random.bytes(4), "little"))
    assert main(["--model", str(tmp_path)]) == 0
    found = results(capsys.readouterr().out)
    assert found.pop(str(tmp_path)) == "PASS" and set(found.values()) == {"SKIPPED"} and len(found) == DEMO_CHECKS
    assert main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--model M checks a checkpoint the wheel has kernels for)") and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, needle", [
    (["--layers", "2"], "--layers cuts the checkpoint --model names"),
    (["--tolerance", "1.5"], "--tolerance must be in (0, 1)"),
    (["--model", "atlas-demo", "--layers", "9"], "--layers must be 1..4 for this model"),
])
def test_bad_input_is_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_no_cuda_backend_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def none(model_dir: Path, spec: object, run: object) -> None:
        raise AtlasError("no NVIDIA GPU is visible (cuInit: CUDA_ERROR_NO_DEVICE)")

    use_backend(monkeypatch, none)
    assert main([]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("atlas.verify: error: no NVIDIA GPU is visible (cuInit: CUDA_ERROR_NO_DEVICE)"), err
    assert len(err.splitlines()) == 1 and captured.out == ""


def test_nothing_verified_is_not_a_pass(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The first open (the probe) works, every check's does not: exit 2, not a PASS of nothing."""
    opened = []

    def once(model_dir: Path, spec: object, run: object) -> CudaRounding:
        opened.append(model_dir)
        if len(opened) > 1:
            raise AtlasError("out of device memory for the weights")
        return CudaRounding()

    use_backend(monkeypatch, once)
    assert main([]) == 2
    captured = capsys.readouterr()
    assert set(results(captured.out).values()) == {"SKIPPED"}
    assert "every check was skipped: nothing was verified" in captured.err


@pytest.mark.gpu
def test_the_gpu_passes(capsys: pytest.CaptureFixture[str]) -> None:
    require_demo_cuda()
    code = main([])
    out = capsys.readouterr().out
    print(out)
    assert code == 0, out
    assert len(results(out)) == DEMO_CHECKS
