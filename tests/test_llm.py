"""The Python API (LLM) on the real engine: greedy output equals transformers' on a random tiny
checkpoint, streaming, seeds, argument errors, and the backend factory."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import atlas.backends as backends
from atlas import LLM
from atlas.backends import create_backend
from atlas.config import load_spec
from atlas.errors import AtlasError
from atlas.llm import GenerateOptions, context_capacity
from _conditioning import draw_conditioned
from runtime_checkpoint import fresh_tiny_checkpoint

PROMPT_WORDS = ["Beautiful", "is", "better", "than", "ugly", "café", "你好", "🙂", "Flat", "dense."]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fresh_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> LLM:
    return LLM(str(tiny_dir), device="cpu")


def random_prompt(rng: np.random.Generator) -> str:
    return " ".join(rng.choice(PROMPT_WORDS, size=int(rng.integers(2, 8))))


@pytest.mark.oracle
def test_greedy_matches_transformers(tiny: LLM, tiny_dir: Path, rng: np.random.Generator) -> None:
    def draw() -> tuple[str, list[int]]:
        prompt = random_prompt(rng)
        return prompt, tiny.tokenizer.encode(prompt)

    prompt, expected = draw_conditioned(tiny_dir, draw, 16)
    result = tiny.generate(prompt, max_tokens=16)
    assert result.prompt_tokens == len(tiny.tokenizer.encode(prompt))
    assert result.token_ids == expected
    assert result.text == tiny.tokenizer.decode(result.token_ids)
    assert result.prefill_tok_s > 0 and result.decode_tok_s >= 0


@pytest.mark.oracle
def test_chat_prompt_matches_transformers(tiny: LLM, tiny_dir: Path, rng: np.random.Generator) -> None:
    def draw() -> tuple[str, list[int]]:
        prompt = random_prompt(rng)
        return prompt, tiny.tokenizer.encode_chat([{"role": "user", "content": prompt}])

    prompt, expected = draw_conditioned(tiny_dir, draw, 8)
    result = tiny.generate(prompt, max_tokens=8, chat=True)
    assert result.prompt_tokens == len(tiny.tokenizer.encode_chat([{"role": "user", "content": prompt}]))
    assert result.token_ids == expected


def test_token_id_prompt_equals_text_prompt(tiny: LLM, rng: np.random.Generator) -> None:
    prompt = random_prompt(rng)
    by_text = tiny.generate(prompt, max_tokens=6)
    by_ids = tiny.generate(tiny.tokenizer.encode(prompt), max_tokens=6)
    assert by_ids.token_ids == by_text.token_ids


def test_a_batch_is_each_prompt_alone(tiny: LLM, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """A list of prompts (texts, token ids) or of conversations gives each one's result as if it
    ran alone, in order; a bad prompt anywhere in it fails before any runs."""
    prompts: list[str | list[int]] = [random_prompt(rng) for _ in range(3)]
    prompts.append(tiny.tokenizer.encode(random_prompt(rng)))
    options = {"max_tokens": 8, "temperature": 0.9, "seed": int(rng.integers(0, 2**31))}
    batch = tiny.generate(prompts, **options)
    assert [r.token_ids for r in batch] == [tiny.generate(p, **options).token_ids for p in prompts]
    conversations = [[{"role": "user", "content": p}] for p in prompts[:2] if isinstance(p, str)]
    assert [r.text for r in tiny.chat(conversations, max_tokens=5)] == [tiny.chat(c, max_tokens=5).text for c in conversations]
    runs: list[object] = []
    monkeypatch.setattr(tiny.parts.engine, "run", lambda request: runs.append(request))
    with pytest.raises(AtlasError, match="outside the vocabulary"):
        tiny.generate([prompts[0], [1, tiny.parts.spec.vocab_size]], max_tokens=2)
    assert runs == []
    with pytest.raises(AtlasError, match="on_text"):
        tiny.generate(prompts, max_tokens=2, on_text=print)
    with pytest.raises(AtlasError, match="one prompt"):
        list(tiny.stream(prompts, max_tokens=2))


def test_seed_makes_sampling_reproducible(tiny: LLM, rng: np.random.Generator) -> None:
    prompt = random_prompt(rng)
    seed = int(rng.integers(0, 2**31))
    options = {"max_tokens": 12, "temperature": 1.3, "top_k": 50, "top_p": 0.95, "seed": seed}
    first = tiny.generate(prompt, **options)
    assert tiny.generate(prompt, **options).token_ids == first.token_ids
    draws = {tuple(tiny.generate(prompt, **{**options, "seed": seed + i}).token_ids) for i in range(1, 5)}
    assert len(draws | {tuple(first.token_ids)}) > 1  # different seeds do sample differently


def test_stream_yields_the_generated_text() -> None:
    from atlas.demo import DEMO_PROMPT

    demo = LLM(device="cpu")
    pieces = list(demo.stream(DEMO_PROMPT, max_tokens=40))
    assert len(pieces) > 1
    assert "".join(pieces) == demo.generate(DEMO_PROMPT, max_tokens=40).text


def test_stream_equals_generate_when_sampling(tiny: LLM, rng: np.random.Generator) -> None:
    prompt = random_prompt(rng)
    options = {"max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": int(rng.integers(0, 2**31))}
    assert "".join(tiny.stream(prompt, **options)) == tiny.generate(prompt, **options).text


def test_stream_is_lazy(monkeypatch: pytest.MonkeyPatch) -> None:
    from atlas.demo import DEMO_PROMPT

    demo = LLM(device="cpu")
    decoded: list[int] = []
    real_decode = demo.parts.engine.decode

    def counting_decode(token: int, position: int) -> object:
        decoded.append(position)
        return real_decode(token, position)

    monkeypatch.setattr(demo.parts.engine, "decode", counting_decode)
    stream = demo.stream(DEMO_PROMPT, max_tokens=100)
    assert next(stream) and len(decoded) <= 2  # the first piece comes before the rest is computed
    stream.close()
    assert len(decoded) <= 2


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 10**6}, "positions"),
        ({"seed": -1, "temperature": 0.7}, "seed"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"temperature": None}, "temperature must be a number"),
        ({"temperature": True}, "temperature must be a number"),
        ({"top_p": None}, "top_p must be a number"),
        ({"top_k": 1.5, "temperature": 1.0}, "top_k must be an integer"),
        ({"top_k": "x"}, "top_k must be an integer"),
        ({"top_k": 2**40, "temperature": 1.0}, "top_k must be in 0..2147483647"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens must be True or False"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be True or False"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an integer >= 1"),
        ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens must be an integer >= 1"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids must be a non-empty list of token ids in 0.."),
        ({"bad_words": "ugly"}, "bad_words must be a list of non-empty strings"),
        ({"bad_words": [""]}, "bad_words must be a list of non-empty strings"),
        ({"allowed_token_ids": [5, 6], "json_object": True}, "allowed_token_ids must hold one"),
    ],
)
def test_bad_options(tiny: LLM, options: dict[str, float], needle: str) -> None:
    with pytest.raises(AtlasError, match=needle):
        tiny.generate("Beautiful", **options)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rules_that_leave_nothing_fail_greedy_as_sampled(temperature: float, rng: np.random.Generator) -> None:
    """Only the eos allowed, and min_tokens banning it: greedy had picked the banned eos (min_tokens
    ignored, finish 'stop') where sampling refused."""
    from atlas.structured import NoAllowedToken

    demo = LLM(device="cpu")
    eos = sorted(demo.eos_ids())[0]
    with pytest.raises(NoAllowedToken):
        demo.generate("Flat is", max_tokens=8, allowed_token_ids=[eos], min_tokens=int(rng.integers(1, 5)),
                      temperature=temperature, seed=int(rng.integers(0, 100)))


def test_numpy_scalars_are_the_values_they_hold(tiny: LLM, rng: np.random.Generator) -> None:
    """Options given as numpy scalars (an index or a count from an array): np.uint8 had wrapped when
    negated (truncate_prompt_tokens kept 130 of 376 tokens for 10) and np.int8 logprobs overflowed."""
    prompt = " ".join(rng.choice(PROMPT_WORDS, size=12))
    plain = {"max_tokens": 6, "logprobs": 3, "truncate_prompt_tokens": 3, "top_k": 5, "temperature": 0.75,
             "top_p": 0.5, "seed": int(rng.integers(0, 200)), "min_tokens": 2}
    typed = {k: np.float32(v) if isinstance(v, float) else np.uint8(v) for k, v in plain.items()}
    want, got = tiny.generate(prompt, **plain), tiny.generate(prompt, **typed)  # type: ignore[arg-type]
    assert got.prompt_tokens == 3 and got.token_ids == want.token_ids and got.logprobs == want.logprobs


def test_length_limit_is_exact(tiny: LLM) -> None:
    capacity = min(tiny.parts.spec.context_length, tiny.parts.engine.max_seq_len)
    prompt = [1, 2, 3]
    tiny.prepare(prompt, GenerateOptions(max_tokens=capacity - len(prompt) + 1))
    with pytest.raises(AtlasError, match=f"holds {capacity}"):
        tiny.prepare(prompt, GenerateOptions(max_tokens=capacity - len(prompt) + 2))


def test_max_seq_len_sizes_the_cache_and_the_limit(tiny_dir: Path, rng: np.random.Generator) -> None:
    context = load_spec(tiny_dir).context_length
    assert LLM(tiny_dir, device="cpu").parts.engine.max_seq_len == min(4096, context)
    capacity = int(rng.integers(8, context))
    short = LLM(tiny_dir, device="cpu", max_seq_len=capacity)
    assert short.parts.engine.max_seq_len == capacity
    state = short.parts.engine.states
    assert any(getattr(s, "k", None) is not None and s.k.shape[0] == capacity for s in state)
    prompt = [1, 2, 3]
    short.prepare(prompt, GenerateOptions(max_tokens=capacity - 2))
    with pytest.raises(AtlasError, match=rf"holds {capacity}; .*\(--max-seq-len, up to {context}\)"):
        short.prepare(prompt, GenerateOptions(max_tokens=capacity - 1))
    for bad in (0, -5, 2.5, True, context + 1):
        with pytest.raises(AtlasError, match="max_seq_len"):
            LLM(tiny_dir, device="cpu", max_seq_len=bad)  # type: ignore[arg-type]


def test_max_num_batched_tokens_sets_the_prefill_passes(tiny: LLM, tiny_dir: Path, rng: np.random.Generator,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's max_num_batched_tokens: a prompt runs in passes of that many tokens (at most the
    engine's 4096, which the memory checks assume), with the output of one pass."""
    from atlas import engine

    passes = int(rng.integers(1, 9))
    chunked = LLM(tiny_dir, device="cpu", max_num_batched_tokens=passes)
    assert chunked.parts.engine.prefill_chunk == passes
    ranges: list[tuple[int, int]] = []
    original = engine.prefill_chunks

    def spied(tokens: int, chunk: int) -> list[tuple[int, int]]:
        ranges.extend(original(tokens, chunk))
        return original(tokens, chunk)

    monkeypatch.setattr(engine, "prefill_chunks", spied)
    prompt = [int(t) for t in rng.integers(0, tiny.parts.spec.vocab_size, size=int(rng.integers(10, 40)))]
    assert chunked.generate(prompt, max_tokens=6).token_ids == tiny.generate(prompt, max_tokens=6).token_ids
    assert max(stop - start for start, stop in ranges[: -(-len(prompt) // passes)]) == passes, ranges
    assert LLM(tiny_dir, device="cpu", max_num_batched_tokens=10**6).parts.engine.prefill_chunk == engine.PREFILL_CHUNK
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(AtlasError, match="max_num_batched_tokens must be a positive integer"):
            LLM(tiny_dir, device="cpu", max_num_batched_tokens=bad)  # type: ignore[arg-type]
    for name in ("enforce_eager", "check_weights"):
        with pytest.raises(AtlasError, match=f"{name} must be True or False, got 'yes'"):
            LLM(tiny_dir, device="cpu", **{name: "yes"})


def test_bad_prompts(tiny: LLM) -> None:
    vocab = tiny.parts.spec.vocab_size
    with pytest.raises(AtlasError, match="outside the vocabulary"):
        tiny.generate([1, vocab], max_tokens=2)
    with pytest.raises(AtlasError, match="empty"):
        tiny.generate("", max_tokens=2)
    with pytest.raises(AtlasError, match="text prompt"):
        tiny.generate([1, 2], chat=True)
    with pytest.raises(AtlasError, match="unknown option 'max_new_tokens'; did you mean 'max_tokens'"):
        tiny.generate("x", max_new_tokens=3)
    with pytest.raises(AtlasError, match="unknown option 'on_text'; the options are max_tokens, "):
        list(tiny.stream("x", on_text=print))


@pytest.mark.parametrize(("call", "needle"), [
    (lambda llm: llm.generate("x", max_tokens=2, on_text="print"), "on_text must be a function"),
    (lambda llm: llm.generate("x", max_tokens=2, temperature=10**400), "temperature must be a number, got 1000"),
    (lambda llm: llm.generate("x", max_tokens=2, chat="yes"), "chat must be True or False, got 'yes'"),
    (lambda llm: llm.chat([{"role": "user", "content": "x"}], template_kwargs={"messages": []}),
     "template_kwargs may not set 'messages'"),
    (lambda llm: llm.chat([{"role": "user", "content": "x"}], template_kwargs={"self": 1}),
     "template_kwargs may not set 'self'"),
    (lambda llm: llm.chat([{"role": "user", "content": "x"}], template_kwargs={1: 2}),
     "template_kwargs must be a dict of template variables by name"),
    (lambda llm: llm.chat([{"role": "user", "content": "x"}], template_kwargs=["enable_thinking"]),
     "template_kwargs must be a dict"),
])  # fmt: skip
def test_argument_mistakes_are_one_line(call: Any, needle: str) -> None:
    """Each had been a Python traceback (a TypeError or OverflowError from inside atlas), the
    first only after the prompt had run."""
    demo = LLM(device="cpu")  # the demo has a chat template
    with pytest.raises(AtlasError, match=re.escape(needle)) as err:
        call(demo)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("prompt", "needle"), [
    (5, "text or a list of token ids, got int"),
    (None, "text or a list of token ids, got NoneType"),
    ({"text": "x"}, "text or a list of token ids, got dict"),
    (b"Flat", "text or a list of token ids, got bytes"),
    (["Flat", 3], "token ids must be integers, got 'Flat'"),
    ([1, 2.5], "token ids must be integers, got 2.5"),
    ([True, 2], "token ids must be integers, got True"),
    ("Flat \ud800 is", "not valid Unicode (surrogates not allowed U+D800 at character 5)"),
])
def test_prompts_of_the_wrong_type_are_one_line(tiny: LLM, prompt: object, needle: str) -> None:
    for call in (tiny.generate, lambda p, **kw: list(tiny.stream(p, **kw))):
        with pytest.raises(AtlasError) as err:
            call(prompt, max_tokens=2)  # type: ignore[arg-type]
        assert needle in str(err.value)


def test_model_argument_types(tiny_dir: Path) -> None:
    with pytest.raises(AtlasError, match="model must be a registry name, an HF repo id or a directory path, got 5"):
        LLM(5, device="cpu")  # type: ignore[arg-type]
    ids = np.array([3, 4, 5], dtype=np.int64)
    from_path = LLM(tiny_dir, device="cpu").generate(ids, max_tokens=3)
    assert from_path.token_ids == LLM(str(tiny_dir), device="cpu").generate(ids.tolist(), max_tokens=3).token_ids


def test_backend_factory(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from atlas.backends.numpy_backend import NumpyBackend

    spec = load_spec(tiny_dir)
    backend, reason = create_backend("cpu", tiny_dir, spec)
    assert isinstance(backend, NumpyBackend) and reason.startswith("cpu")
    with pytest.raises(AtlasError, match="tpu"):
        create_backend("tpu", tiny_dir, spec)

    def no_gpu(*args: object) -> None:
        raise AtlasError("no NVIDIA driver found")

    monkeypatch.setattr(backends, "open_cuda_backend", no_gpu)
    backend, reason = create_backend("auto", tiny_dir, spec)
    assert isinstance(backend, NumpyBackend)
    assert reason.startswith("cpu") and "no NVIDIA driver found" in reason
    with pytest.raises(AtlasError, match="no NVIDIA driver found"):
        create_backend("cuda", tiny_dir, spec)


def test_cuda_memory_check_sees_the_run_shape(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    """The device memory check counts the KV cache at the level asked for and the MTP head only
    when it will be loaded."""
    import atlas.backends.cuda.select as select

    seen: list[object] = []

    def refuse(model_dir: Path, spec: object, run: object = None) -> None:
        seen.append(run)
        raise AtlasError("too small")

    monkeypatch.setattr(select, "open_backend", refuse)
    level = str(rng.choice(["fp8", "nvfp4", "turbo4"]))
    spec_k = int(rng.integers(0, 4))
    with pytest.raises(AtlasError, match="too small"):
        LLM(tiny_dir, device="cuda", kv_cache_dtype=level, spec_k=spec_k)
    (run,) = seen
    assert run.kv_cache.dtype == level and run.load_mtp == (spec_k != 0)  # type: ignore[attr-defined]


@pytest.mark.gpu
def test_auto_picks_cuda_and_agrees_with_cpu() -> None:
    """Skips with the reason where no CUDA backend can run (no GPU, or no kernels in this
    install), except under ATLAS_REQUIRE_GPU=1, which the device check sets."""
    from atlas.demo import DEMO_PROMPT

    gpu = LLM(device="auto")
    if not gpu.device.startswith("cuda"):
        if os.environ.get("ATLAS_REQUIRE_GPU") == "1":
            pytest.fail(f"ATLAS_REQUIRE_GPU=1 but auto chose {gpu.device}")
        pytest.skip(f"no CUDA backend here: {gpu.device}")
    want = LLM(device="cpu").generate(DEMO_PROMPT, max_tokens=64).token_ids
    assert gpu.generate(DEMO_PROMPT, max_tokens=64).token_ids == want
    assert "".join(gpu.stream(DEMO_PROMPT, max_tokens=64)) == gpu.tokenizer.decode(want)


def test_chat_renders_the_conversation(rng: np.random.Generator) -> None:
    """LLM.chat: the template over the messages, then generate(); the same tokens as generating
    from the rendered ids; bad messages are one line."""
    llm = LLM(device="cpu")
    messages = [{"role": "user", "content": "Flat is"}, {"role": "assistant", "content": "better than nested."},
                {"role": "user", "content": "Sparse is"}]
    seed = int(rng.integers(0, 1000))
    got = llm.chat(messages, max_tokens=12, temperature=0.8, seed=seed)
    want = llm.generate(llm.tokenizer.encode_chat(messages), max_tokens=12, temperature=0.8, seed=seed)
    assert got.token_ids == want.token_ids and got.prompt_tokens == len(llm.tokenizer.encode_chat(messages))
    with pytest.raises(AtlasError, match="messages must be a list"):
        llm.chat("Flat is")  # type: ignore[arg-type]
    started = [*messages, {"role": "assistant", "content": "better than"}]
    with pytest.raises(AtlasError, match="exclude each other"):
        llm.chat(started, continue_final_message=True)
    went_on = llm.chat(started, add_generation_prompt=False, continue_final_message=True, max_tokens=6)
    rendered = llm.tokenizer.apply_chat_template(started, add_generation_prompt=False)
    cut = llm.tokenizer.encode(rendered[: rendered.rindex("better than") + len("better than")], add_special_tokens=False)
    assert went_on.prompt_tokens == len(cut) and went_on.token_ids == llm.generate(cut, max_tokens=6).token_ids


def test_stop_strings_end_the_text(rng: np.random.Generator) -> None:
    """stop: the text ends before the first stop string (never part of it), generation stops on
    the token that completed it, finish_reason says why; stream() gives the same text."""
    llm = LLM(device="cpu")
    full = llm.generate("Beautiful is better than", max_tokens=60)
    start = int(rng.integers(5, len(full.text) - 10))
    stop = full.text[start : start + int(rng.integers(3, 9))]
    result = llm.generate("Beautiful is better than", max_tokens=60, stop=[stop, "never in this text"])
    assert result.text == full.text[: full.text.index(stop)] and result.finish_reason == "stop"
    assert len(result.token_ids) < len(full.token_ids)
    assert stop in llm.tokenizer.decode(result.token_ids) and stop not in llm.tokenizer.decode(result.token_ids[:-1])
    assert "".join(llm.stream("Beautiful is better than", max_tokens=60, stop=stop)) == result.text
    assert llm.generate("Beautiful is better than", max_tokens=3).finish_reason == "length"
    with pytest.raises(AtlasError, match="stop must be"):
        llm.generate("Flat is", max_tokens=2, stop=[""])


def test_no_max_tokens_fills_the_context(tiny: LLM, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]) -> None:
    """max_tokens None (vLLM's) and atlas.run -n -1 (llama.cpp's): new tokens until an end token or
    the context's last position; stream() the same."""
    from atlas.run import main

    prompt = " ".join(rng.choice(PROMPT_WORDS, size=int(rng.integers(2, 9))))
    capacity = context_capacity(tiny.parts.spec, tiny.parts.engine)
    room = capacity - len(tiny.tokenizer.encode(prompt)) + 1
    seed = int(rng.integers(1000))
    filled = tiny.generate(prompt, max_tokens=None, ignore_eos=True, temperature=0.8, seed=seed)
    assert len(filled.token_ids) == room and filled.finish_reason == "length"
    assert "".join(tiny.stream(prompt, max_tokens=None, ignore_eos=True, temperature=0.8, seed=seed)) == filled.text
    with pytest.raises(AtlasError, match="min_tokens"):
        tiny.generate(prompt, max_tokens=None, min_tokens=room + 1)
    capsys.readouterr()
    held = len(LLM(device="cpu").tokenizer.encode(prompt))  # the demo's byte-level tokens: up to 4 a character
    demo = ["--device", "cpu", "-p", prompt, "--ignore-eos", "-c", str(int(rng.integers(held + 1, held + 24)))]
    assert main([*demo, "-n", str(rng.choice(["-1", "-2"]))]) == 0
    assert f"({int(demo[-1]) - held + 1} tokens)" in capsys.readouterr().err
    for bad in ("0", "-3", "many"):
        assert main([*demo, "-n", bad]) == 2
        assert "--max-tokens" in capsys.readouterr().err


def test_ignore_eos_and_stop_token_ids(rng: np.random.Generator, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's ignore_eos (llama.cpp's --ignore-eos): the demo's eos ends nothing, so max_tokens are
    made after the text it ends; stop_token_ids: the first of them ends the text, its text kept;
    stream() gives generate()'s text under both."""
    from atlas.run import main

    demo = LLM(device="cpu", prompt_cache=0)
    prompt = "Namespaces are one honking great"
    ended = demo.generate(prompt, max_tokens=60)
    assert ended.finish_reason == "stop" and ended.token_ids[-1] in demo.eos_ids()
    longer = len(ended.token_ids) + int(rng.integers(1, 20))
    kept = demo.generate(prompt, max_tokens=longer, ignore_eos=True)
    assert len(kept.token_ids) == longer and kept.finish_reason == "length"
    assert kept.token_ids[: len(ended.token_ids)] == ended.token_ids
    assert "".join(demo.stream(prompt, max_tokens=longer, ignore_eos=True)) == kept.text
    cut = int(rng.integers(0, len(ended.token_ids) - 1))
    stop = ended.token_ids[cut]
    first = ended.token_ids.index(stop)
    stopped = demo.generate(prompt, max_tokens=60, stop_token_ids=[stop])
    assert stopped.token_ids == ended.token_ids[: first + 1] and stopped.finish_reason == "stop"
    assert stopped.text == demo.tokenizer.decode(ended.token_ids[: first + 1])
    assert "".join(demo.stream(prompt, max_tokens=60, stop_token_ids=[stop])) == stopped.text
    for options, words in (({"stop_token_ids": [demo.parts.spec.vocab_size]}, "stop_token_ids must be a list of token ids"),
                           ({"ignore_eos": "yes"}, "ignore_eos must be True or False"),
                           ({"ignore_eos": True, "json_object": True}, "leave ignore_eos out")):
        with pytest.raises(AtlasError, match=re.escape(words)):
            demo.generate(prompt, max_tokens=4, **options)
    assert main(["--device", "cpu", "--prompt", prompt, "--max-tokens", str(longer), "--ignore-eos"]) == 0
    assert f"({longer} tokens)" in capsys.readouterr().err
    assert main(["--device", "cpu", "--ignore-eos", "--json-object"]) == 2
    assert "--ignore-eos leaves a structured output no end" in capsys.readouterr().err


def test_chat_takes_vllms_chat_template_kwargs_and_tools(rng: np.random.Generator, tmp_path: Path) -> None:
    """LLM.chat(..., chat_template_kwargs=..., tools=[...]) as vLLM's: the template gets the
    variables and describes the tools (the prompt is encode_chat's with them); template_kwargs and
    chat_template_kwargs together are one line."""
    from _demo_copy import demo_copy
    from test_tools import TOOLS_TEMPLATE

    llm = LLM(str(demo_copy(tmp_path / "demo", TOOLS_TEMPLATE)), device="cpu", prompt_cache=0)
    messages = [{"role": "user", "content": "What is the weather?"}]
    tools = [{"type": "function", "function": {"name": f"tool_{int(rng.integers(1000))}", "description": "d",
                                               "parameters": {"type": "object", "properties": {}}}}]
    with_tools = llm.chat(messages, tools=tools, chat_template_kwargs={"enable_thinking": False}, max_tokens=3)
    ids = llm.tokenizer.encode_chat(messages, True, {"enable_thinking": False, "tools": tools})
    assert with_tools.prompt_tokens == len(ids) > len(llm.tokenizer.encode_chat(messages))
    assert with_tools.token_ids == llm.generate(ids, max_tokens=3).token_ids
    with pytest.raises(AtlasError, match="one option under two names"):
        llm.chat(messages, template_kwargs={}, chat_template_kwargs={})
    with pytest.raises(AtlasError, match="tools must be a list of OpenAI tool dicts"):
        llm.chat(messages, tools={"name": "f"})
