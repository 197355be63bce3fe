"""Generations on one LLM take turns (atlas.turns): concurrent threads each get their own answer,
and a generation another one overtook fails in one line instead of going on from the other's
state (a stream had continued with plausible, wrong text)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from atlas import LLM
from atlas.errors import AtlasError
from atlas.turns import OVERTAKEN
from runtime_checkpoint import make_tiny_checkpoint

PROMPT_WORDS = ["Beautiful", "is", "better", "than", "ugly", "Flat", "dense.", "Sparse", "nested"]
OVERTAKEN_START = OVERTAKEN[:40]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    seed = int(np.random.default_rng().integers(0, 2**31))
    print(f"tiny checkpoint seed: {seed}")
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed)


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> LLM:
    return LLM(str(tiny_dir), device="cpu")


@pytest.fixture(scope="module")
def eager(tiny: LLM) -> dict[str, list[int]]:
    """Options that make every generated token a text piece of its own (printable ASCII tokens
    only): a random model's tokens may be parts of a UTF-8 character or special tokens, whose text
    comes later or never, and a stream whose first piece came with its last token is not overtaken."""
    ids = [i for i, text in enumerate(tiny.tokenizer.token_bytes) if text and text.isascii() and text.decode().isprintable()]
    return {"allowed_token_ids": ids}


def prompts(rng: np.random.Generator, count: int) -> list[str]:
    return [" ".join(rng.choice(PROMPT_WORDS, size=int(rng.integers(2, 7)))) for _ in range(count)]


def test_a_stream_overtaken_by_generate_fails(tiny: LLM, eager: dict[str, list[int]], rng: np.random.Generator) -> None:
    first, second = prompts(rng, 2)
    alone = tiny.generate(second, max_tokens=8).text
    stream = tiny.stream(first, max_tokens=12, min_tokens=12, **eager)  # no eos before the first piece
    next(stream)
    assert tiny.generate(second, max_tokens=8).text == alone  # the later generation is unharmed
    with pytest.raises(AtlasError, match=OVERTAKEN_START):
        next(stream)


def test_two_streams_read_in_turn_fail_at_the_older(tiny: LLM, eager: dict[str, list[int]], rng: np.random.Generator) -> None:
    first, second = prompts(rng, 2)
    older, newer = tiny.stream(first, max_tokens=6, min_tokens=6, **eager), tiny.stream(second, max_tokens=6)
    next(older)
    expected = "".join(tiny.stream(second, max_tokens=6))
    assert "".join(newer) == expected  # started after `older`'s token: runs whole, on its own state
    with pytest.raises(AtlasError, match=OVERTAKEN_START):
        next(older)


def test_a_closed_stream_leaves_the_next_generation_alone(tiny: LLM, eager: dict[str, list[int]],
                                                          rng: np.random.Generator) -> None:
    first, second = prompts(rng, 2)
    alone = tiny.generate(second, max_tokens=8).text
    stream = tiny.stream(first, max_tokens=12, min_tokens=12, **eager)
    next(stream)
    stream.close()
    assert tiny.generate(second, max_tokens=8).text == alone
    assert "".join(tiny.stream(second, max_tokens=8)) == alone


def test_generate_from_on_text_fails_the_outer_generation(tiny: LLM, eager: dict[str, list[int]],
                                                          rng: np.random.Generator) -> None:
    outer, inner = prompts(rng, 2)
    nested: list[str] = []

    def on_text(piece: str) -> None:
        if not nested:
            nested.append(tiny.generate(inner, max_tokens=4).text)

    with pytest.raises(AtlasError, match=OVERTAKEN_START):
        tiny.generate(outer, max_tokens=10, min_tokens=10, on_text=on_text, **eager)
    assert nested == [tiny.generate(inner, max_tokens=4).text]


def test_a_closed_llm_refuses_to_go_on(tiny_dir: Path, eager: dict[str, list[int]], rng: np.random.Generator) -> None:
    first, second = prompts(rng, 2)
    with LLM(str(tiny_dir), device="cpu") as llm:
        stream = llm.stream(first, max_tokens=8, min_tokens=8, **eager)
        next(stream)
    for attempt in (lambda: next(stream), lambda: llm.generate(second, max_tokens=2),
                    lambda: "".join(llm.stream(second, max_tokens=2))):
        with pytest.raises(AtlasError, match="this LLM was closed"):
            attempt()


def test_threads_sharing_an_llm_each_get_their_own_answer(tiny: LLM, rng: np.random.Generator) -> None:
    """generate() is one turn: concurrent calls queue instead of stepping on each other's state."""
    texts = prompts(rng, 6)
    options = {"max_tokens": 24, "min_tokens": 24}
    alone = [tiny.generate(p, **options).text for p in texts]
    found: dict[int, str | BaseException] = {}

    def run(i: int) -> None:
        try:
            found[i] = tiny.generate(texts[i], **options).text
        except BaseException as err:  # noqa: BLE001 - compared below
            found[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [found[i] for i in range(len(texts))] == alone


def test_the_engine_step_api_takes_turns_for_every_caller(tiny: LLM, rng: np.random.Generator) -> None:
    """The guard is the engine's, so callers below LLM (the server's worker runs iter_tokens) get it:
    a token generator overtaken by another generation fails instead of going on."""
    from atlas.llm import generate_options, iter_tokens

    engine, eos = tiny.parts.engine, tiny.eos_ids()
    first, second = (tiny.tokenizer.encode(p) for p in prompts(rng, 2))
    opts = generate_options(max_tokens=8, min_tokens=8)
    alone = list(iter_tokens(engine, second, opts, eos))
    older = iter_tokens(engine, first, opts, eos)
    next(older)
    assert list(iter_tokens(engine, second, opts, eos)) == alone
    with pytest.raises(AtlasError, match=OVERTAKEN_START):
        next(older)


def test_engine_run_refuses_a_generation_started_from_on_token(tiny: LLM, rng: np.random.Generator) -> None:
    from atlas.engine import GenerationRequest
    from atlas.llm import generate_options, sampling_params

    engine, eos = tiny.parts.engine, tiny.eos_ids()
    outer, inner = (tiny.tokenizer.encode(p) for p in prompts(rng, 2))
    sampling = sampling_params(generate_options(min_tokens=6))
    nested = GenerationRequest(inner, 3, sampling, None, eos)
    inner_alone = engine.run(nested).token_ids
    found: list[list[int]] = []

    def on_token(token: int) -> None:
        if not found:
            found.append(engine.run(nested).token_ids)

    with pytest.raises(AtlasError, match=OVERTAKEN_START):
        engine.run(GenerationRequest(outer, 6, sampling, None, eos, on_token))
    assert found == [inner_alone]
