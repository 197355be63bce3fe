"""JSON mode: the prefix recognizer against Python's json module on random documents and random
damage to them, the pick among allowed tokens (greedy: the best allowed; sampled: only allowed
ones), and generation on the demo model: every text is a prefix of a JSON object, a whole one when
it ends with the end-of-sequence token, and each greedy token the most likely allowed one."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from atlas import LLM
from atlas.backends.base import SamplingParams
from atlas.engine import GenerationRequest
from atlas.errors import AtlasError
from atlas.json_match import ANY_OBJECT, MAX_INDENT, Matcher, Text, Transitions
from atlas.structured import OutputConstraint
from atlas.sampling import softmax_probs

TIE = 1e-4  # relative logit gap under which float32 rounding may decide a pick
DAMAGE_BYTES = b'{}[]:,"\\-+.0123456789eEtrufalsn\x01\x7f' + "é".encode()  # no whitespace (its rule is stricter than JSON's)


def random_value(rng: np.random.Generator, depth: int) -> Any:
    kind = int(rng.integers(0, 8 if depth < 4 else 5))
    if kind == 0:
        return int(rng.integers(-10**12, 10**12))
    if kind == 1:
        return float(rng.standard_normal() * 10.0 ** int(rng.integers(-30, 30)))
    if kind == 2:
        return [None, True, False][int(rng.integers(0, 3))]
    if kind in (3, 4):
        return random_text(rng)
    if kind in (5, 6):
        return random_object(rng, depth + 1)
    return [random_value(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]


def random_text(rng: np.random.Generator) -> str:
    alphabet = 'ab "\\/\n\t\x00\x1fé€😀\u2028{}[],:'
    return "".join(alphabet[int(i)] for i in rng.integers(0, len(alphabet), int(rng.integers(0, 8))))


def random_object(rng: np.random.Generator, depth: int = 0) -> dict[str, Any]:
    return {random_text(rng): random_value(rng, depth) for _ in range(int(rng.integers(0, 4)))}


def dumps(rng: np.random.Generator, value: Any) -> bytes:
    indent = [None, 0, 1, 2, 4, "\t"][int(rng.integers(0, 6))]
    separators = [(",", ":"), (", " if indent is None else ",", ": ")][int(rng.integers(0, 2))]  # no " \n"
    return json.dumps(value, indent=indent, separators=separators, ensure_ascii=bool(rng.integers(0, 2))).encode()


def recognised(data: bytes) -> bool:
    state = Matcher(ANY_OBJECT)
    return state.feed(data) and state.complete


def python_accepts(data: bytes) -> bool:
    def no_constant(name: str) -> None:
        raise ValueError(name)  # NaN / Infinity are Python's extension, not JSON

    try:
        return isinstance(json.loads(data, parse_constant=no_constant), dict)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return False


def test_a_set_of_states_reached_two_ways_is_one_object(rng: np.random.Generator) -> None:
    """The moves cache keeps one object per distinct set of stacks: after [a-z] any letter leads to
    the same regex position, and the cache's key comparisons then stop at identity (a bounded
    regex's state set holds a state per count: comparing two copies walked them all)."""
    from atlas.json_regex import compile_regex

    shape = Transitions(Text(compile_regex("[a-z]{0,%d}" % int(rng.integers(50, 500)), search=False)))
    first, second = (shape.move(shape.start, ord(c)) for c in rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 2, replace=False))
    assert first == second and first is second
    assert shape.move(first, ord("q")) is shape.move(second, ord("z"))


def test_every_prefix_of_a_json_object_is_accepted(rng: np.random.Generator) -> None:
    for _ in range(300):
        data = dumps(rng, random_object(rng))
        state = Matcher(ANY_OBJECT)
        for i, byte in enumerate(data):
            assert not state.complete, data[:i]
            assert state.feed(bytes([byte])), f"rejected at byte {i}: {data[: i + 1]!r}"
        assert state.complete, data


def damage(data: bytes, rng: np.random.Generator) -> bytes:
    """data with one byte of DAMAGE_BYTES inserted, or one byte deleted or replaced by one."""
    out = bytearray(data)
    at, byte = int(rng.integers(0, len(out) + 1)), DAMAGE_BYTES[int(rng.integers(0, len(DAMAGE_BYTES)))]
    action = int(rng.integers(0, 3))
    if action == 0:
        out.insert(at, byte)
    elif at < len(out):
        out[at : at + 1] = b"" if action == 1 else bytes([byte])
    return bytes(out)


def test_damaged_documents_agree_with_json_loads(rng: np.random.Generator) -> None:
    """Insert, delete or replace one byte of a compact document: accepted as a whole object exactly
    when Python's json accepts the result as one."""
    differing = 0
    for _ in range(2000):
        data = bytearray(dumps(rng, random_object(rng)).replace(b" ", b"").replace(b"\n", b"").replace(b"\t", b""))
        if not python_accepts(bytes(data)):
            continue  # a string held a tab or newline: dropping it broke the document
        data = damage(bytes(data), rng)
        differing += not python_accepts(data)
        assert recognised(data) == python_accepts(data), data
    assert differing > 100  # the damage broke many documents: both sides were tested on bad input


@pytest.mark.parametrize(("text", "ok"), [
    (b" {}", False),  # the text starts with the object
    (b"[1]", False), (b'"x"', False), (b"1", False),  # JSON, but not an object
    (b"{}\n", False),  # nothing after the close
    (b'{"a":\n' + b" " * MAX_INDENT + b"1}", True),
    (b'{"a":\n' + b" " * (MAX_INDENT + 1) + b"1}", False),
    (b'{"a":\n\n1}', False),  # one line break per run of whitespace
    (b'{"a": \n1}', False),  # and it comes first
    (b'{"a":"\xc3\xa9\xf0\x9f\x98\x80"}', True), (b'{"a":"\xc3"}', False), (b'{"a":"\x80"}', False),
    (b'{"a":"\\u00e9\\n"}', True), (b'{"a":"\\x41"}', False), (b'{"a":"\\u00g9"}', False),
    (b'{"a":-0.5e+3,"b":[true,false,null,{}]}', True), (b'{"a":01}', False), (b'{"a":1.}', False),
    (b'{"a":-}', False), (b'{"a":tru}', False),
])
def test_examples(text: bytes, ok: bool) -> None:
    assert recognised(text) == ok


TOY_VOCAB = [b"{", b"}", b'"', b"a", b":", b"1", b" ", b"\n", b'{"', b'":', None, b""]  # None: special, b"": empty
TOY_END = 10


def test_greedy_takes_the_best_allowed_token(rng: np.random.Generator) -> None:
    """On a toy vocabulary, from random states: the pick is the highest-logit token that continues
    the JSON, never one that does not, and only the end id once the object is closed."""
    for _ in range(200):
        constraint = OutputConstraint(TOY_VOCAB, {TOY_END})
        for _ in range(int(rng.integers(0, 8))):  # walk to a random state by random allowed tokens
            allowed = [t for t in range(len(TOY_VOCAB)) if constraint.allows(t)]
            if constraint.complete:
                break
            constraint.advance(int(rng.choice(allowed)))
        logits = rng.standard_normal(len(TOY_VOCAB)).astype(np.float32)
        allowed = [t for t in range(len(TOY_VOCAB)) if constraint.allows(t)]
        best = max(allowed, key=lambda t: (logits[t], -t))
        assert constraint.greedy(logits) == best
        assert (allowed == [TOY_END]) == constraint.complete
        assert all(TOY_VOCAB[t] for t in allowed if t != TOY_END)  # never a special or empty token
        masked = constraint.mask(logits, 1.0)
        assert set(np.flatnonzero(np.isfinite(masked))) <= set(allowed)


def test_sampled_mask_stops_early_without_changing_the_filtered_set(demo: LLM, rng: np.random.Generator) -> None:
    """With top_k or min_p, the walk over the vocabulary stops where the filters would drop every
    later token: what the sampler keeps is what it keeps from the full allowed set, but for tokens
    the mass rule leaves out (under NEGLIGIBLE_MASS of what it keeps, by design)."""
    from atlas.sampling import top_k_mask
    from atlas.structured import NEGLIGIBLE_MASS

    tokenizer = demo.tokenizer
    for _ in range(30):
        constraint = walked_constraint(tokenizer.token_bytes, rng)
        logits = (rng.standard_normal(len(tokenizer.token_bytes)) * rng.uniform(1, 12)).astype(np.float32)  # peaked too
        top_k, min_p = [(1, 0.0), (3, 0.0), (20, 0.05), (0, 0.05), (0, 0.3), (3, 0.3)][int(rng.integers(0, 6))]
        full = np.array([constraint.allows(t) for t in range(logits.size)])  # [V]

        def kept(allowed: np.ndarray) -> np.ndarray:
            p = softmax_probs(np.where(allowed, logits, -np.inf).astype(np.float32), 1.0)  # [V]
            return top_k_mask(p, top_k) & (p >= np.float32(min_p) * p.max()) & allowed  # [V]

        fast, whole = kept(np.isfinite(constraint.mask(logits, 1.0, top_k, min_p))), kept(full)
        weight = np.exp(logits.astype(np.float64) - logits[whole].max())  # [V]
        assert not (fast & ~whole).any()
        assert weight[whole & ~fast].sum() <= 2 * NEGLIGIBLE_MASS * weight[whole].sum(), np.flatnonzero(whole & ~fast)


LISTED_SETTINGS = [SamplingParams(1.0), SamplingParams(0.7, 20, 0.95), SamplingParams(0.3, 0, 0.9),
                   SamplingParams(1.5, 0, 1.0, min_p=0.05), SamplingParams(0.7, 20, 0.8, min_p=0.1)]


def test_sampled_pick_from_the_listed_row_is_the_row_pick(demo: LLM, rng: np.random.Generator) -> None:
    """sample_listed (the walk over the backend's 256 most likely ids and the row's log-sum-exp at
    the temperature, the sampler over the allowed ones alone) picks host_pick's token from the
    whole row, up to float32 rounding of the draw. It declines (None) only where the walk would
    leave the list: the mass rule alone rarely ends it inside (the unchecked tail must be under
    1e-6 of the allowed mass), min_p's floor mostly does."""
    from atlas.backends.numpy_backend import NumpyBackend
    from atlas.sampling import host_pick
    from atlas.structured import SAMPLE_CANDIDATES, ListedRow

    backend, tokenizer = NumpyBackend(), demo.tokenizer
    settled = {True: 0, False: 0}  # by whether min_p is set
    for trial in range(80):
        constraint = walked_constraint(tokenizer.token_bytes, rng)
        logits = (rng.standard_normal(len(tokenizer.token_bytes)) * [1.0, 4.0][trial % 2]).astype(np.float32)  # [V]
        sampling = LISTED_SETTINGS[trial % len(LISTED_SETTINGS)]
        summary = backend.logprob_rows(logits[None], np.zeros(1, np.int32), SAMPLE_CANDIDATES, sampling.temperature)
        listed = ListedRow(summary.ids[0], summary.values[0], float(summary.lse[0].astype(np.float64).sum()), logits.size)
        for uniform in rng.random(4).tolist():
            got = constraint.sample_listed(listed, sampling, uniform)
            if got is None:
                continue
            settled[sampling.min_p > 0] += 1
            want = host_pick(logits, sampling, uniform, constraint)
            assert got == want or within_draw_rounding(constraint, logits, sampling, uniform, got), (sampling, uniform)
    assert settled[True] >= 16 and sum(settled.values()) >= 32, settled  # of 128 and 320 draws (~40 and ~75 seen)


def test_only_banned_tokens_allowed_is_one_line_on_both_paths() -> None:
    """Every allowed token at -inf (banned by logit_bias, say): the listed walk declines and the
    row's walk says no token continues the text, instead of drawing from a uniform row."""
    from atlas.backends.numpy_backend import NumpyBackend
    from atlas.structured import ListedRow

    constraint = OutputConstraint(TOY_VOCAB, {TOY_END})
    logits = np.ones(len(TOY_VOCAB), dtype=np.float32)  # [V]
    logits[[t for t in range(len(TOY_VOCAB)) if constraint.allows(t)]] = -np.inf
    summary = NumpyBackend().logprob_rows(logits[None], np.zeros(1, np.int32), len(TOY_VOCAB), 1.0)
    listed = ListedRow(summary.ids[0], summary.values[0], float(summary.lse[0].astype(np.float64).sum()), logits.size)
    assert constraint.sample_listed(listed, SamplingParams(1.0), 0.5) is None
    with pytest.raises(AtlasError, match="no token of the vocabulary continues the text"):
        constraint.mask(logits, 1.0)


def within_draw_rounding(constraint: OutputConstraint, logits: np.ndarray, sampling: SamplingParams,
                         uniform: float, token: int) -> bool:
    """Whether host_pick would choose `token` for a draw off by 1e-6 of the kept mass."""
    from atlas.sampling import top_k_mask, top_p_mask

    probs = softmax_probs(constraint.mask(logits, sampling.temperature, sampling.top_k, sampling.min_p), sampling.temperature)
    keep = top_p_mask(probs, top_k_mask(probs, sampling.top_k) & (probs >= np.float32(sampling.min_p) * probs.max()), sampling.top_p)
    cumulative = np.cumsum(np.where(keep, probs, 0.0).astype(np.float64))  # [V]
    slack, target = 1e-6 * cumulative[-1], uniform * cumulative[-1]
    low = cumulative[token] - np.float64(probs[token]) if keep[token] else np.inf
    return bool(keep[token] and low - slack <= target <= cumulative[token] + slack)


def walked_constraint(token_bytes: list[bytes | None], rng: np.random.Generator) -> OutputConstraint:
    """A constraint walked to a random state by random allowed tokens."""
    constraint = OutputConstraint(token_bytes, {0})
    for _ in range(int(rng.integers(0, 6))):
        allowed = [t for t in range(1, len(token_bytes)) if constraint.allows(t)]
        if not allowed:
            break
        constraint.advance(int(rng.choice(allowed)))
    return constraint


def test_json_mode_needs_an_end_id() -> None:
    with pytest.raises(AtlasError, match="end-of-sequence"):
        OutputConstraint(TOY_VOCAB, set())


def test_engine_without_the_tokenizer_refuses_json_mode() -> None:
    engine = LLM(device="cpu").parts.engine
    with pytest.raises(AtlasError, match="structured output needs the tokenizer"):
        engine.run(GenerationRequest([5, 6, 7], 4, SamplingParams(structured=True), None, {0}))


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM(device="cpu", prompt_cache=0)


def check_json_text(result: Any, eos: set[int]) -> None:
    assert Matcher(ANY_OBJECT).feed(result.text.encode()), result.text
    if result.finish_reason == "stop":
        assert result.token_ids[-1] in eos
        assert isinstance(json.loads(result.text), dict), result.text


def test_greedy_json_on_the_demo(demo: LLM, rng: np.random.Generator) -> None:
    """Each greedy token is the most likely allowed one under the teacher-forced logits."""
    tokenizer, eos = demo.tokenizer, demo.eos_ids()
    for _ in range(3):
        prompt = rng.integers(3, 512, int(rng.integers(2, 20))).tolist()
        result = demo.generate(prompt, max_tokens=24, json_object=True)
        check_json_text(result, eos)
        assert_greedy_allowed(demo, prompt, result.token_ids, OutputConstraint(tokenizer.token_bytes, eos))


def test_json_at_a_temperature_past_float32(demo: LLM, rng: np.random.Generator) -> None:
    """T = 1e308 rounds to inf in the sampler's float32: the masked tokens' weights must stay 0
    (-inf / inf had made them NaN, and a token the format does not allow was drawn)."""
    for _ in range(3):
        prompt = rng.integers(3, 512, int(rng.integers(2, 20))).tolist()
        result = demo.generate(prompt, max_tokens=12, json_object=True, temperature=1e308,
                               presence_penalty=2.0, seed=int(rng.integers(1 << 31)))
        check_json_text(result, demo.eos_ids())


def test_greedy_json_reads_back_ids_not_rows(demo: LLM, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """A greedy structured pick asks the backend for its 64 most likely ids and reads a row only
    when none of them is allowed: over a generation, fewer rows than tokens are read (inside a
    string nearly every token is allowed). Beside them: the prompt's one non-finite count."""
    backend, vocab = demo.parts.engine.backend, demo.parts.spec.vocab_size
    reads: list[int] = []
    to_numpy = backend.to_numpy
    monkeypatch.setattr(backend, "to_numpy", lambda t: (reads.append(int(np.prod(t.shape))), to_numpy(t))[1])
    prompt = rng.integers(3, 512, int(rng.integers(2, 20))).tolist()
    result = demo.generate(prompt, max_tokens=24, regex=r'\{"note": "[^"\\]{10,60}"\}')
    assert set(reads) <= {1, 64, vocab} and reads.count(64) == len(result.token_ids) and reads.count(1) == 1
    assert reads.count(vocab) <= 0.75 * len(result.token_ids), reads  # 0.46 at most over 40 draws


def test_sampled_json_reads_back_a_summary_not_rows(demo: LLM, rng: np.random.Generator,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled structured pick reads the backend's summary of the row (256 ids and logits, the
    log-sum-exp) and the row only when the walk would leave that list: with top_k 20 (Qwen's
    recommended setting), fewer rows than tokens (inside a string nearly every token is allowed,
    so the walk ends at the 20th)."""
    backend, vocab = demo.parts.engine.backend, demo.parts.spec.vocab_size
    reads: list[int] = []
    to_numpy = backend.to_numpy
    monkeypatch.setattr(backend, "to_numpy", lambda t: (reads.append(int(np.prod(t.shape))), to_numpy(t))[1])
    prompt = rng.integers(3, 512, int(rng.integers(2, 20))).tolist()
    result = demo.generate(prompt, max_tokens=24, temperature=0.7, top_k=20, seed=int(rng.integers(1 << 30)),
                           regex=r'\{"note": "[^"\\]{10,60}"\}')
    assert set(reads) <= {1, 2, 256, vocab} and reads.count(256) == 2 * len(result.token_ids)  # ids, values
    assert reads.count(vocab) <= 0.5 * len(result.token_ids), reads


def assert_greedy_allowed(llm: LLM, prompt: list[int], tokens: list[int], constraint: OutputConstraint) -> None:
    """Each of `tokens` is the most likely token `constraint` allows under the teacher-forced logits."""
    forced = np.asarray(llm.parts.engine.logits(prompt + tokens))[len(prompt) - 1 :]  # [N+1, V]
    for i, token in enumerate(tokens):
        allowed = np.array([constraint.allows(t) for t in range(forced.shape[1])])  # [V]
        z = np.where(allowed, forced[i], -np.inf)  # [V]
        assert allowed[token] and z[token] >= z.max() - TIE * np.abs(forced[i]).max(), f"step {i}"
        constraint.advance(token)


def test_sampled_json_on_the_demo(demo: LLM, rng: np.random.Generator) -> None:
    """Sampled texts are JSON-object prefixes (whole objects when they stop), the same from
    generate() and stream(); penalties and logit_bias combine with JSON mode."""
    eos = demo.eos_ids()
    stopped = 0
    for seed in range(6):
        prompt = rng.integers(3, 512, int(rng.integers(2, 20))).tolist()
        options = {"max_tokens": 40, "temperature": 1.0, "seed": seed, "json_object": True,
                   "presence_penalty": float(rng.uniform(0, 1)), "logit_bias": {int(rng.integers(3, 512)): 2.0}}
        result = demo.generate(prompt, **options)
        check_json_text(result, eos)
        assert "".join(demo.stream(prompt, **options)) == result.text
        stopped += result.finish_reason == "stop"
    assert stopped, "no sampled object was closed: the end id is never allowed?"


def test_the_close_ends_the_text_even_before_min_tokens(demo: LLM) -> None:
    """min_tokens holds the end ids off, but a closed object admits nothing else: it ends there."""
    eos = demo.eos_ids()
    for seed in range(8):
        result = demo.generate("Flat is", max_tokens=60, min_tokens=59, temperature=1.0, seed=seed, json_object=True)
        check_json_text(result, eos)
        if result.finish_reason == "stop":
            return
    pytest.fail("no sampled object was closed in 8 draws")


def test_a_long_literal_keeps_small_states(rng: np.random.Generator) -> None:
    """A const / choice of a few hundred thousand bytes: each state is three integers (a set of
    every prefix took GiBs), and the matcher still takes exactly the options and their prefixes."""
    from atlas.json_match import Literal

    letters = rng.choice(list(b"ab"), size=200_000).astype(np.uint8).tobytes()
    options = [letters, letters[:1000] + b"c", letters[:1000], b"b"]
    literal = Literal(options)
    state = literal.begin()
    for byte in letters[:1000]:
        state = literal.step(state, byte)
        assert state is not None and len(state) == 3 and all(isinstance(x, int) for x in state)
    assert literal.final(state) and literal.open(state)
    ended = literal.step(state, ord("c"))
    assert ended is not None and literal.final(ended) and not literal.open(ended) and literal.text(ended) == options[1]
    assert literal.step(state, ord("d")) is None and literal.step(literal.begin(), ord("c")) is None
    for byte in letters[1000:]:
        state = literal.step(state, byte)
    assert literal.final(state) and not literal.open(state) and literal.text(state) == letters


def test_rules_that_leave_no_token_are_the_requests_400() -> None:
    """A choice that allowed_token_ids rules out entirely: the request's mistake (400), not a 500."""
    from starlette.testclient import TestClient

    from _engine_app import engine_app

    with engine_app() as (app, reference):
        http = TestClient(app)
        other = next(t for t in range(reference.parts.spec.vocab_size) if not reference.tokenizer.decode([t]).startswith("h")
                     and reference.tokenizer.decode([t]))
        body = {"model": "atlas-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "guided_choice": ["hello"], "allowed_token_ids": [other, *sorted(reference.eos_ids())]}
        answer = http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["type"] == "invalid_request_error"
        assert "no token of the vocabulary continues the text" in answer.json()["error"]["message"]
        streamed = http.post("/v1/chat/completions", json={**body, "stream": True}).text
        assert '"type": "invalid_request_error"' in streamed and "no token of the vocabulary" in streamed
        assert http.post("/v1/chat/completions", json={**body, "allowed_token_ids": None}).status_code == 200


def test_nan_logits_are_a_fault_not_the_requests_rules() -> None:
    from atlas.structured import NoAllowedToken

    constraint = OutputConstraint(TOY_VOCAB, {TOY_END})
    with pytest.raises(AtlasError, match="logits are NaN") as caught:
        constraint.mask(np.full(len(TOY_VOCAB), np.nan, dtype=np.float32), 1.0)
    assert not isinstance(caught.value, NoAllowedToken)
    banned = np.where([constraint.allows(t) for t in range(len(TOY_VOCAB))], -np.inf, 1.0).astype(np.float32)
    with pytest.raises(NoAllowedToken):  # every allowed token at -inf: the request's rules
        constraint.mask(banned, 1.0)
