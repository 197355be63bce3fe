"""The prompt cache (atlas.prompt_cache) on the numpy backend: a prompt resumed from the live state
or a checkpoint leaves the same state, logits and greedy tokens as a fresh prefill, for every way a
second prompt can relate to the first; what it cannot hold is never reused; speculative decoding
resumes with the MTP head's rows intact; memory checks count the checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _conditioning import MAX_DRAWS, well_conditioned
from atlas.backends.base import KVCache, SamplingParams
from atlas.backends.numpy_backend import NumpyBackend
from atlas.config import load_spec
from atlas.demo import DEMO_DIR
from atlas.engine import Engine
from atlas.errors import AtlasError
from atlas.layers.linear_attention import DeltaNetState
from atlas.prompt_cache import CHECKPOINT_TAIL, MIN_TAIL_PROMPT
from atlas.safetensors import Checkpoint
from atlas.speculative import SpeculativeEngine
from test_speculative import demo_mtp as demo_mtp  # noqa: F401  (the module-scoped fixture)

GREEDY = SamplingParams()
NO_EOS: set[int] = set()
VOCAB = 512  # the demo's
NEW_TOKENS = 6
RTOL = 2e-4  # fp32 passes split at other positions: rounding only


def engine(prompt_cache: int, model_dir: Path = DEMO_DIR) -> Engine:
    return Engine(load_spec(model_dir), Checkpoint.open(model_dir), NumpyBackend(), max_seq_len=256,
                  prompt_cache=prompt_cache)


def ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n).tolist()


# second prompt given the first (a) and the tokens generated after it (gen) -> (prompt, tokens it resumes after)
Scenario = Callable[[np.random.Generator, list[int], list[int]], tuple[list[int], int]]
SCENARIOS: dict[str, Scenario] = {
    "extends the prompt": lambda rng, a, gen: (a + ids(rng, 9), len(a)),  # end checkpoint
    "extends the generation": lambda rng, a, gen: (a + gen + ids(rng, 5), len(a) + len(gen) - 1),  # live state
    "leaves the prompt near its end": lambda rng, a, gen: (a[:-5] + ids(rng, 7), len(a) - CHECKPOINT_TAIL),
    "equals the prompt": lambda rng, a, gen: (list(a), len(a)),  # no pass at all
    "shares only a short start": lambda rng, a, gen: (a[:20] + ids(rng, 30), 0),
    "shares nothing": lambda rng, a, gen: (ids(rng, 40), 0),
}


def states_close(got: list[Any], want: list[Any], positions: int) -> None:
    """DeltaNet states equal; KV rows of the first `positions` equal (later rows are never read)."""
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        if isinstance(g, DeltaNetState):
            pairs = [(g.conv, w.conv), (g.recurrent, w.recurrent)]
        else:
            assert isinstance(g, KVCache)
            pairs = [(g.k[:positions], w.k[:positions]), (g.v[:positions], w.v[:positions])]
        for a, b in pairs:
            a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * float(np.abs(b).max()), err_msg=f"layer {layer}")


def greedy_after(e: Engine, logits: Any, position: int) -> list[int]:
    """NEW_TOKENS greedy tokens from a prefill's logits, decoding on."""
    rng = np.random.default_rng(0)
    tokens = [e.pick(logits, GREEDY, rng)]
    for _ in range(NEW_TOKENS - 1):
        tokens.append(e.pick(e.decode(tokens[-1], position), GREEDY, rng))
        position += 1
    return tokens


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_resume_leaves_what_a_fresh_prefill_does(scenario: str, rng: np.random.Generator) -> None:
    cached, fresh = engine(prompt_cache=4), engine(prompt_cache=0)
    for _ in range(MAX_DRAWS):
        first = ids(rng, int(rng.integers(MIN_TAIL_PROMPT, 170)))
        gen = cached.generate(first, NEW_TOKENS, GREEDY, None, NO_EOS).token_ids
        second, expected_hit = SCENARIOS[scenario](rng, first, gen)
        want_logits = fresh.backend.to_numpy(fresh.prefill(second))
        got_logits = cached.backend.to_numpy(cached.prefill(second))
        assert cached.prompt_cache.last_hit == expected_hit
        assert fresh.prompt_cache.last_hit == 0
        np.testing.assert_allclose(got_logits, want_logits, rtol=RTOL, atol=RTOL * float(np.abs(want_logits).max()))
        states_close(cached.states, fresh.states, len(second))
        want = greedy_after(fresh, fresh.prefill(second), len(second))
        if well_conditioned(DEMO_DIR, second, want):
            assert greedy_after(cached, cached.prefill(second), len(second)) == want
            return
    pytest.fail(f"no well-conditioned draw in {MAX_DRAWS}")


def test_a_chat_reuses_each_turn(rng: np.random.Generator) -> None:
    """Turns that re-render the previous answer differently still resume near the previous prompt's end."""
    cached, fresh = engine(prompt_cache=4), engine(prompt_cache=0)
    conversation, expected_hit = ids(rng, 150), 0
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    for turn in range(3):
        got = cached.generate(conversation, NEW_TOKENS, sampling, turn, NO_EOS)
        want = fresh.generate(conversation, NEW_TOKENS, sampling, turn, NO_EOS)
        assert got.token_ids == want.token_ids
        assert got.cached_tokens == expected_hit
        expected_hit = len(conversation) - CHECKPOINT_TAIL  # the next turn leaves this prompt 3 tokens before its end
        conversation = conversation[:-3] + ids(rng, 4) + got.token_ids[:-1] + ids(rng, 30)


def test_what_the_rows_no_longer_hold_is_not_reused(rng: np.random.Generator) -> None:
    cached = engine(prompt_cache=4)
    a, b = ids(rng, 140), ids(rng, 140)
    tail = len(a) - CHECKPOINT_TAIL
    cached.prefill(a)
    assert [len(c.ids) for c in cached.prompt_cache.checkpoints] == [tail, len(a)]
    cached.prefill(a[:-5] + [a[-5] ^ 1])  # resumes at the tail, rewrites rows tail..: a's end checkpoint goes
    assert cached.prompt_cache.last_hit == tail
    assert [len(c.ids) for c in cached.prompt_cache.checkpoints] == [tail, len(a) - 4]
    cached.prefill(a + [1])
    assert cached.prompt_cache.last_hit == tail
    cached.prefill(b)  # rewrites every row
    cached.prefill(a + [1])
    assert cached.prompt_cache.last_hit == 0


def test_checkpoints_stay_within_capacity(rng: np.random.Generator) -> None:
    cached = engine(prompt_cache=3)
    prompt = ids(rng, 130)
    for _ in range(5):
        cached.prefill(prompt)  # each takes two checkpoints (tail and end)
        cached.prefill(prompt)  # the end checkpoint answers: nothing new taken
        prompt = prompt + ids(rng, 20)
    cache = cached.prompt_cache
    assert sorted(len(c.ids) for c in cache.checkpoints) == [190, 194, 210]  # least recently used out first
    assert len(cache.checkpoints) + len(cache.spare) == 3  # buffers reused, not piled up


def test_a_failed_pass_forgets_the_state(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    cached, fresh = engine(prompt_cache=4), engine(prompt_cache=0)
    a = ids(rng, 140)
    cached.prefill(a)
    forward = cached.forward

    def fails_half_way(token_ids: Any, positions: Any) -> Any:
        forward(token_ids, positions)  # the states moved on
        raise RuntimeError("injected fault")

    monkeypatch.setattr(cached, "forward", fails_half_way)
    with pytest.raises(RuntimeError):
        cached.prefill(a + ids(rng, 10))
    assert cached.prompt_cache.history is None and not cached.prompt_cache.checkpoints
    monkeypatch.setattr(cached, "forward", forward)
    second = a + ids(rng, 12)
    got = cached.backend.to_numpy(cached.prefill(second))
    assert cached.prompt_cache.last_hit == 0
    np.testing.assert_allclose(got, fresh.backend.to_numpy(fresh.prefill(second)), rtol=RTOL, atol=1e-5)


def test_an_interrupted_reset_forgets_the_checkpoints(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while a fresh prompt's states were being made had left the engine without states but
    with checkpoints: the next prompt that resumed from one crashed (IndexError)."""
    import atlas.engine as engine_module

    cached, fresh = engine(prompt_cache=4), engine(prompt_cache=0)
    a = ids(rng, int(rng.integers(20, 140)))
    cached.prefill(a)
    make_states = engine_module.new_states

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_module, "new_states", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cached.prefill(ids(rng, 30))  # shares nothing: a fresh state
    monkeypatch.setattr(engine_module, "new_states", make_states)
    second = a + ids(rng, 5)
    np.testing.assert_allclose(cached.backend.to_numpy(cached.prefill(second)),
                               fresh.backend.to_numpy(fresh.prefill(second)), rtol=RTOL, atol=1e-5)


def test_a_decode_without_its_token_id_forgets(rng: np.random.Generator) -> None:
    cached = engine(prompt_cache=4)
    a = ids(rng, 40)
    token = cached.pick_tensor(cached.prefill(a), GREEDY, rng)[1]
    cached.decode_tensor(token, len(a))  # the id is not given: the cache cannot know what the state holds
    cached.prefill(a + ids(rng, 5))
    assert cached.prompt_cache.last_hit == 0


def test_a_dump_runs_every_prompt_in_full(rng: np.random.Generator) -> None:
    cached = engine(prompt_cache=4)
    a = ids(rng, 40)
    cached.prefill(a)
    seen: list[str] = []
    cached.dump = lambda name, t: seen.append(name)
    cached.prefill(a + ids(rng, 3))
    assert cached.prompt_cache.last_hit == 0 and "positions" in seen


def spec_engine(model_dir: Path, prompt_cache: int) -> SpeculativeEngine:
    return SpeculativeEngine(load_spec(model_dir), Checkpoint.open(model_dir), NumpyBackend(), 2,
                             max_seq_len=256, prompt_cache=prompt_cache)


def head_rows(e: SpeculativeEngine, positions: int) -> list[np.ndarray]:
    return [np.asarray(e.mtp_cache.k[:positions], np.float32), np.asarray(e.mtp_cache.v[:positions], np.float32)]


@pytest.mark.parametrize("first_turn", ["greedy", "sampled", "scored"])
def test_speculative_resume_keeps_the_head_rows(demo_mtp: Path, rng: np.random.Generator, first_turn: str) -> None:
    """Greedy output with speculation and the cache equals plain greedy; after a greedy or a
    sampled first turn (both speculate) the second resumes at the end checkpoint with the head's
    rows as a fresh prefill writes them (after a turn that asked for prompt logprobs, which
    decodes without the head, its rows were not written, so the second runs in full)."""
    from atlas.engine import GenerationRequest

    cached, fresh, plain = spec_engine(demo_mtp, 4), spec_engine(demo_mtp, 0), engine(0, demo_mtp)
    sampling = GREEDY if first_turn == "greedy" else SamplingParams(temperature=0.7)
    for _ in range(MAX_DRAWS):
        first = ids(rng, 140)
        request = GenerationRequest(first, NEW_TOKENS, sampling, 1, NO_EOS,
                                    prompt_logprobs=1 if first_turn == "scored" else None)
        gen = cached.run(request).token_ids
        second = first + [gen[0] ^ 1] + ids(rng, 9)  # the head's row 139 must read the new token 140
        want = plain.generate(second, 12, GREEDY, None, NO_EOS).token_ids
        if well_conditioned(demo_mtp, second, want):
            break
    got = cached.generate(second, 12, GREEDY, None, NO_EOS)
    assert got.token_ids == want
    assert got.cached_tokens == (0 if first_turn == "scored" else len(first))  # the live state has no head row
    cursor, want_cursor = cached._prefill(second), fresh._prefill(second)  # type: ignore[attr-defined]
    assert cached._draft(cursor, 2) == fresh._draft(want_cursor, 2)  # type: ignore[attr-defined]
    for g, w in zip(head_rows(cached, len(second)), head_rows(fresh, len(second)), strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * float(np.abs(w).max()))


def test_memory_checks_count_the_checkpoints() -> None:
    from atlas.backends.host_memory import host_footprint, host_state_bytes
    from atlas.backends.run_plan import RunPlan

    spec, checkpoint = load_spec(DEMO_DIR), Checkpoint.open(DEMO_DIR)
    off = host_footprint(spec, checkpoint, RunPlan(prompt_cache=0))
    on = host_footprint(spec, checkpoint, RunPlan(prompt_cache=4))
    assert on.total - off.total == 4 * host_state_bytes(spec) > 0


@pytest.mark.parametrize("bad", [-1, 65, 2.0, "4", True])
def test_a_bad_checkpoint_count_is_one_line(bad: object) -> None:
    from atlas import LLM

    with pytest.raises(AtlasError, match="prompt_cache must be an integer in 0..64"):
        LLM(device="cpu", prompt_cache=bad)  # type: ignore[arg-type]


def test_llm_keeps_checkpoints_by_default(rng: np.random.Generator) -> None:
    from atlas import LLM

    llm = LLM(device="cpu")
    prompt = ids(rng, 60)
    first = llm.generate(prompt, max_tokens=8)
    again = llm.generate(prompt, max_tokens=8)
    extended = prompt + again.token_ids + ids(rng, 3)  # the live state holds all but the last new token
    longer = llm.generate(extended, max_tokens=8)
    assert (first.cached_tokens, again.cached_tokens) == (0, len(prompt))
    assert longer.cached_tokens == len(prompt) + len(again.token_ids) - 1
    assert again.token_ids == first.token_ids
    assert longer.token_ids == LLM(device="cpu", prompt_cache=0).generate(extended, max_tokens=8).token_ids
