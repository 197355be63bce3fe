"""The token chain on the GPU (demo model): pick_tensor -> decode_tensor feeds the device id to the
next step (graph replay and eager), uploading only the position per step, with the same tokens
as the host-fed loop decode(int)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from atlas.backends.base import SamplingParams
from atlas.sampling import draw_uniform
from test_gpu_model import gpu_llm

pytestmark = pytest.mark.gpu

STEPS = 24


@pytest.fixture(scope="module")
def demo_gpu() -> Any:
    return gpu_llm()


def _count_writes(rt: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    write = rt.write

    def counted(dst: Any, host: np.ndarray) -> None:
        sizes.append(int(np.asarray(host).size))
        write(dst, host)

    monkeypatch.setattr(rt, "write", counted)
    return sizes


@pytest.mark.parametrize("graphs", [True, False])
def test_chain_feeds_device_ids_with_host_fed_tokens(demo_gpu: Any, rng: np.random.Generator, graphs: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    engine = demo_gpu.parts.engine
    monkeypatch.setattr(engine.backend, "use_graphs", graphs)
    engine.reset()  # the decode step is wrapped again for this graph setting
    prompt = rng.integers(0, demo_gpu.parts.spec.vocab_size, size=int(rng.integers(2, 30))).tolist()
    greedy = SamplingParams()

    token = engine.pick(engine.prefill(prompt), greedy, rng)
    host_fed = [token]
    for position in range(len(prompt), len(prompt) + STEPS):
        host_fed.append(engine.pick(engine.decode(host_fed[-1], position), greedy, rng))

    token, token_t = engine.pick_tensor(engine.prefill(prompt), greedy, rng)
    chained = [token]
    writes = _count_writes(engine.backend.rt, monkeypatch)
    for position in range(len(prompt), len(prompt) + STEPS):
        token, token_t = engine.pick_tensor(engine.decode_tensor(token_t, position), greedy, rng)
        chained.append(token)
    assert chained == host_fed
    assert writes == [1] * STEPS, f"host-to-device writes per step {writes}: only the position should go up"


def test_penalized_picks_stay_on_the_device(demo_gpu: Any, rng: np.random.Generator) -> None:
    """Penalties and logit_bias are applied and counted on the GPU: each pick is the biased,
    penalized argmax of its step's GPU logits (written out on the host from the logits read back
    for the check), only the id comes back (no read wider than one id while generating), and the
    id picked on the device gives the same tokens as feeding the ids from the host with decode(int)."""
    from atlas.sampling import PROMPT_TOKEN, Penalties, host_argmax, penalize_row

    engine = demo_gpu.parts.engine
    prompt = rng.integers(0, demo_gpu.parts.spec.vocab_size, size=int(rng.integers(2, 30))).tolist()
    vocab = demo_gpu.parts.spec.vocab_size
    banned = np.argsort(engine.backend.to_numpy(engine.prefill(prompt))[0])[-4:]  # the first step's top 4
    engine.reset()
    nudged = np.setdiff1d(rng.choice(vocab, 16, replace=False), banned)
    bias = tuple(sorted([(int(t), -100.0) for t in banned] + [(int(t), float(rng.uniform(-8, 8))) for t in nudged]))
    sampling = SamplingParams(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=2.0, logit_bias=bias)
    counts, flags, dense_bias = np.zeros(vocab, np.int32), np.zeros(vocab, np.int32), np.zeros(vocab, np.float32)
    flags[prompt] = PROMPT_TOKEN
    dense_bias[[t for t, _ in bias]] = [b for _, b in bias]

    logits = engine.prefill(prompt)
    penalties = Penalties(prompt)
    chained: list[int] = []
    for position in range(len(prompt), len(prompt) + STEPS):
        expected = host_argmax(penalize_row(engine.backend.to_numpy(logits)[0], counts, flags, dense_bias, sampling, False))
        with counting_reads(engine.backend) as reads:
            token, token_t = engine.pick_tensor(logits, sampling, rng, penalties)
        assert max(reads) == 1, f"step {len(chained)}: read back {reads} elements, not just the id"
        assert token == expected, f"step {len(chained)}: device pick {token}, penalized argmax {expected}"
        counts[token] += 1
        chained.append(token)
        logits = engine.decode_tensor(token_t, position, token)

    engine.reset()
    fed = Penalties(prompt)
    host_fed = [engine.pick_tensor(engine.prefill(prompt), sampling, rng, fed)[0]]
    for position in range(len(prompt), len(prompt) + STEPS - 1):
        host_fed.append(engine.pick_tensor(engine.decode(host_fed[-1], position), sampling, rng, fed)[0])
    assert host_fed == chained


@pytest.mark.parametrize("graphs", [True, False])
def test_running_ahead_gives_the_tokens_in_turn(demo_gpu: Any, rng: np.random.Generator, graphs: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode loop queueing step N+1 before it reads token N (atlas.decode_loop) picks what the
    loop reading each token first picks: greedy, and sampled with penalties. On the host emulator
    the stream runs deferred, as a GPU's does: a token read from its page-locked slot before its
    event was waited for would be stale bytes, and each read must find the next step still queued."""
    from _simt import SimtDriver

    engine = demo_gpu.parts.engine
    monkeypatch.setattr(engine.backend, "use_graphs", graphs)
    engine.reset()
    driver = engine.backend.rt.driver
    queued_at_reads: list[int] = []
    if isinstance(driver, SimtDriver):
        driver.defer(True)
        wait = driver.event_synchronize

        def counted(event: Any) -> None:
            wait(event)
            queued_at_reads.append(len(driver.queue or ()))

        monkeypatch.setattr(driver, "event_synchronize", counted)
    prompt = rng.integers(0, demo_gpu.parts.spec.vocab_size, size=int(rng.integers(2, 30))).tolist()
    seed = int(rng.integers(0, 2**31))
    try:
        for sampling in (SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.95, presence_penalty=1.5)):
            monkeypatch.setattr(engine.backend, "runs_ahead", False)
            in_turn = engine.generate(prompt, STEPS, sampling, seed, set()).token_ids
            monkeypatch.setattr(engine.backend, "runs_ahead", True)
            queued_at_reads.clear()
            assert engine.generate(prompt, STEPS, sampling, seed, set()).token_ids == in_turn
            if isinstance(driver, SimtDriver):  # every read but the last had the next step behind it
                assert min(queued_at_reads[-STEPS:-1]) > 0, queued_at_reads
    finally:
        if isinstance(driver, SimtDriver):
            driver.defer(False)


@contextmanager
def counting_reads(backend: Any) -> Iterator[list[int]]:
    """The number of elements of each tensor the backend reads back to the host inside the block."""
    sizes: list[int] = []
    to_numpy = backend.to_numpy

    def counted(t: Any) -> np.ndarray:
        sizes.append(int(np.prod(t.shape)))
        return to_numpy(t)

    backend.to_numpy = counted
    try:
        yield sizes
    finally:
        del backend.to_numpy  # the class's method again


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "words"], "properties": {
    "n": {"type": "integer", "minimum": -50, "maximum": 50},
    "words": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}}}


@pytest.mark.parametrize("schema", [None, SCHEMA], ids=["json_object", "json_schema"])
def test_json_output_on_the_gpu(demo_gpu: Any, rng: np.random.Generator, schema: dict[str, Any] | None) -> None:
    """JSON output picks on the host from the GPU's logits: greedy, each token is the best one the
    matcher allows under that step's logits, and the text is a prefix of a JSON object (a whole
    one, of the schema's shape, when it stops)."""
    import json

    from atlas.json_match import Matcher
    from atlas.structured import OutputConstraint, output_shape

    prompt = rng.integers(3, demo_gpu.parts.spec.vocab_size, size=int(rng.integers(2, 20))).tolist()
    engine, eos = demo_gpu.parts.engine, demo_gpu.eos_ids()
    result = demo_gpu.generate(prompt, max_tokens=STEPS, json_object=schema is None, json_schema=schema)
    engine.reset()
    mirror = OutputConstraint(demo_gpu.tokenizer.token_bytes, eos, output_shape(schema))
    logits = engine.prefill(prompt)
    for position, token in enumerate(result.token_ids, start=len(prompt)):
        row = engine.backend.to_numpy(logits)[0]  # [V]
        assert token == mirror.greedy(row), f"step {position - len(prompt)}"
        mirror.advance(token)
        logits = engine.decode(token, position)
    assert result.text.startswith("{")
    if result.finish_reason == "stop":
        assert isinstance(json.loads(result.text), dict)
        whole = Matcher(output_shape(schema))  # the device has no jsonschema: test_json_schema checks the matcher
        assert whole.feed(result.text.encode()) and whole.can_end


def test_sampled_json_picks_from_the_device_summary(demo_gpu: Any, rng: np.random.Generator) -> None:
    """Sampled JSON (top_k 20) on the GPU: each pick is made from the device's summary of the row
    (logprob_rows at the temperature: 256 ids and logits) when the walk ends inside it, and is
    then host_pick's token from the GPU's whole row up to float32 rounding of the draw; over a
    generation most picks read no row, and the text is a JSON-object prefix."""
    from atlas.sampling import Penalties, host_pick
    from atlas.structured import OutputConstraint
    from test_json_mode import within_draw_rounding

    engine, eos, vocab = demo_gpu.parts.engine, demo_gpu.eos_ids(), demo_gpu.parts.spec.vocab_size
    sampling = SamplingParams(temperature=0.7, top_k=20, structured=True)
    prompt = rng.integers(3, vocab, size=int(rng.integers(2, 20))).tolist()
    penalties = Penalties(prompt, eos, OutputConstraint(demo_gpu.tokenizer.token_bytes, eos))
    mirror = OutputConstraint(demo_gpu.tokenizer.token_bytes, eos)
    logits, row_reads, text = engine.prefill(prompt), 0, b""
    for position in range(len(prompt), len(prompt) + STEPS):
        row = engine.backend.to_numpy(logits)[0]  # [V] for the check, read before the pick
        draw = np.random.default_rng(position)
        uniform = draw_uniform(np.random.default_rng(position))
        with counting_reads(engine.backend) as reads:
            token, token_t = engine.pick_tensor(logits, sampling, draw, penalties)
        row_reads += reads.count(vocab)
        want = host_pick(row, sampling, uniform, mirror)
        assert token == want or within_draw_rounding(mirror, row, sampling, uniform, token), f"step {position}"
        mirror.advance(token)
        if token in eos:
            break
        text += demo_gpu.tokenizer.token_bytes[token]
        logits = engine.decode_tensor(token_t, position, token)
    assert text.startswith(b"{") and row_reads <= 0.5 * STEPS


def test_logprobs_and_prompt_logprobs_on_the_gpu(demo_gpu: Any, rng: np.random.Generator) -> None:
    """Token and prompt logprobs from the device's summaries (logprob_rows over views of the
    prefill's hidden rows and the decode steps' logits) are the numpy backend's on a stretch of
    the demo's text, to within the GPU's bf16 rounding: each picked token's log-probability within
    0.05 + 5 %, the same most likely alternative wherever numpy's top two are 0.05 apart."""
    from atlas import LLM
    from test_gpu_model import demo_text_excerpt

    cpu = LLM(device="cpu")
    prompt = demo_text_excerpt(cpu, rng, 20, 80)
    options = {"max_tokens": 8, "temperature": 0.0, "logprobs": 3, "prompt_logprobs": 2}
    got, want = demo_gpu.generate(prompt, **options), cpu.generate(prompt, **options)
    assert got.token_ids == want.token_ids
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(prompt)
    pairs = [*zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True),
             *zip(got.logprobs, want.logprobs, strict=True)]
    for position, (g, w) in enumerate(pairs):
        assert g.token == w.token and abs(g.logprob - w.logprob) <= 0.05 + 0.05 * abs(w.logprob), f"row {position}"
        if w.top[0][1] - w.top[1][1] > 0.05:
            assert g.top[0][0] == w.top[0][0], f"row {position}"
