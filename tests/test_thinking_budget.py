"""The thinking budget (atlas.thinking_budget): the cap's state machine on a made-up vocabulary
(tags split across tokens, characters split across tokens, a rule that forbids the closing), the
demo model closing its block after the budget (greedy and sampled, the forced tokens fed to the
model as its own), and the budget through /v1/chat/completions and the Messages API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlas import LLM
from atlas.errors import AtlasError
from atlas.thinking_budget import CLOSING, WAIT, ThinkingBudget, check_budget, prompt_state
from atlas.token_rules import AllConstraints, AllowedTokens
from _demo_copy import demo_copy
from test_reasoning import THINKING_TEMPLATE

# A made-up vocabulary: plain text, characters split across tokens, the tags whole and in pieces.
PLAIN = [b"a", b" the", b"\n", b"\n\n", b"ok."]
SPLIT_CHARS = [b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"\xf0\x9f", b"\x98\x80", "é".encode()]
TAGS = [b"<think>", b"</think>", b"<th", b"ink>", b"</", b"think>"]
VOCAB = PLAIN + SPLIT_CHARS + TAGS
ID = {piece: i for i, piece in enumerate(VOCAB)}
CLOSING_IDS = [ID[b"\n"], ID[b"</think>"], ID[b"\n\n"]]


def budget_of(budget: int, opened: bool, last_turn: bytes | None = None) -> ThinkingBudget:
    """opened: the prompt's last turn ends with <think> (else it holds no tag), unless given."""
    turn = last_turn if last_turn is not None else b"assistant\n<think>\n" if opened else b"assistant\n"
    return ThinkingBudget(budget, lambda t: VOCAB[t], CLOSING_IDS, turn)


def run(cap: Any, picks: Iterator[int], steps: int) -> list[int]:
    """`steps` tokens: each the cap's forced one, else the next of `picks`."""
    out = []
    for _ in range(steps):
        forced = cap.forced()
        out.append(forced if forced is not None else next(picks))
        cap.advance(out[-1])
    return out


def plain_picks(rng: np.random.Generator) -> Iterator[int]:
    while True:
        yield ID[PLAIN[int(rng.integers(len(PLAIN)))]]


def closing_at(tokens: list[int]) -> int:
    """Where the closing sequence starts in tokens (-1: nowhere)."""
    n = len(CLOSING_IDS)
    return next((i for i in range(len(tokens) - n + 1) if tokens[i:i + n] == CLOSING_IDS), -1)


def test_an_opened_block_closes_after_the_budget(rng: np.random.Generator) -> None:
    for budget in [0, 1, *rng.integers(2, 40, size=4).tolist()]:
        tokens = run(budget_of(budget, opened=True), plain_picks(rng), budget + 20)
        assert closing_at(tokens) == budget, (budget, tokens)
        assert closing_at(tokens[budget + 1:]) == -1, "forced twice"


def test_an_answer_opens_the_block_at_its_start(rng: np.random.Generator) -> None:
    """As the server's reasoning split: a <think> (split across tokens, after whitespace) opening
    the answer opens the block; one later in the answer is text and opens none."""
    budget = int(rng.integers(1, 10))
    lead = [ID[b"\n"], ID[b"<th"]]
    picks = iter([*lead, ID[b"ink>"], *[ID[b" the"]] * 40])
    tokens = run(budget_of(budget, opened=False), picks, budget + 10)
    assert closing_at(tokens) == len(lead) + 1 + budget  # counted from the token after the tag
    idle = run(budget_of(budget, opened=False), plain_picks(rng), budget + 30)
    assert closing_at(idle) == -1, "no block was opened, yet it was closed"
    later = iter([ID[b"ok."], ID[b" the"], ID[b"<think>"], *[ID[b"a"]] * 40])
    assert closing_at(run(budget_of(budget, opened=False), later, budget + 20)) == -1


@pytest.mark.parametrize(("last_turn", "state"), [
    (b"assistant\n<think>\n", "counting"),  # the generation prompt opens it
    (b"assistant\n<think>\nLet me see", "counting"),  # a continued message inside its block
    (b"assistant\n<think>\n\n</think>\n\n", "done"),  # thinking off: closed before the answer
    (b"Tell me about <think> tags</think> and <think>", "counting"),
    (b"assistant\n", "undecided"),
])
def test_the_prompts_last_turn_sets_the_state(last_turn: bytes, state: str, rng: np.random.Generator) -> None:
    assert prompt_state(last_turn) == state
    budget = int(rng.integers(0, 6))
    answer = iter([ID[b"<think>"], *[ID[b"a"]] * 40])  # opens a block only when the prompt left it undecided
    at = closing_at(run(budget_of(budget, False, last_turn), answer, budget + 10))
    assert at == {"counting": budget, "undecided": budget + 1, "done": -1}[state]


def test_a_block_the_text_closes_is_left_alone(rng: np.random.Generator) -> None:
    """</think> written in two pieces before the budget: nothing is forced, and a later <think>
    opens no second capped block."""
    budget = int(rng.integers(4, 10))
    picks = iter([ID[b"a"], ID[b"</"], ID[b"think>"], ID[b"<think>"], *[ID[b"a"]] * 60])
    tokens = run(budget_of(budget, opened=True), picks, budget + 40)
    assert closing_at(tokens) == -1


@pytest.mark.parametrize("char", [[b"\xc3", b"\xa9"], [b"\xe2\x82", b"\xac"], [b"\xf0\x9f", b"\x98\x80"]])
def test_the_closing_waits_for_a_character(char: list[bytes], rng: np.random.Generator) -> None:
    budget = int(rng.integers(2, 10))
    picks = iter([*[ID[b"a"]] * (budget - 1), ID[char[0]], ID[char[1]], *[ID[b"a"]] * 20])
    tokens = run(budget_of(budget, opened=True), picks, budget + 10)
    assert closing_at(tokens) == budget + 1  # after the character's last piece
    lone_leads = iter([*[ID[b"a"]] * (budget - 1), *[ID[b"\xf0\x9f"]] * 40])  # never finishes: the wait is bounded
    assert closing_at(run(budget_of(budget, opened=True), lone_leads, budget + WAIT + 5)) == budget + WAIT


def test_the_closing_waits_for_a_started_end_tag(rng: np.random.Generator) -> None:
    """The budget spent just after "</": the text may finish its own "</think>" (nothing is then
    forced) or go on otherwise (the closing comes next)."""
    budget = int(rng.integers(2, 10))
    spent = [*[ID[b"a"]] * (budget - 1), ID[b"</"]]
    own = run(budget_of(budget, opened=True), iter([*spent, ID[b"think>"], *[ID[b"a"]] * 20]), budget + 10)
    assert closing_at(own) == -1 and b"".join(VOCAB[t] for t in own).count(b"</think>") == 1
    other = run(budget_of(budget, opened=True), iter([*spent, ID[b"a"], *[ID[b"a"]] * 20]), budget + 10)
    assert closing_at(other) == budget + 1


def test_random_text_closes_within_the_wait_on_a_whole_character(rng: np.random.Generator) -> None:
    """Any mix of plain and split characters: the closing comes at budget + w (w <= WAIT) and,
    unless the wait ran out, after a whole character."""
    pieces = PLAIN + SPLIT_CHARS
    for _ in range(50):
        budget = int(rng.integers(0, 30))
        picks = (ID[pieces[int(rng.integers(len(pieces)))]] for _ in iter(int, 1))
        tokens = run(budget_of(budget, opened=True), picks, budget + WAIT + len(CLOSING_IDS) + 2)
        assert closing_at(tokens) >= 0, (budget, tokens)
        at = closing_at(tokens)
        assert budget <= at <= budget + WAIT, (budget, tokens)
        text = b"".join(VOCAB[t] for t in tokens[:at])
        assert at == budget + WAIT or ends_whole(text), (budget, text)


def ends_whole(text: bytes) -> bool:
    """The character the text's last lead (or ASCII) byte starts has all its bytes (earlier
    broken ones are the random draw's)."""
    tail = text[-4:]
    starts = [i for i, byte in enumerate(tail) if byte < 0x80 or byte >= 0xC0]
    if not starts:
        return True
    byte = tail[starts[-1]]
    need = 1 if byte < 0x80 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
    return len(tail) - starts[-1] >= need


def test_a_rule_that_forbids_the_closing_wins(rng: np.random.Generator) -> None:
    """Structured output from the first token (here allowed_token_ids without the closing's ids):
    nothing is forced and the cap gives way."""
    cap = budget_of(0, opened=True)
    both = AllConstraints([cap, AllowedTokens([ID[b"a"], ID[b" the"]])])
    assert cap.forced() == CLOSING_IDS[0] and both.forced() is None
    both.advance(ID[b"a"])
    assert cap.forced() is None and both.forced() is None


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_bad_budget(bad: object) -> None:
    with pytest.raises(AtlasError, match="thinking_token_budget must be an integer >= 0"):
        check_budget(bad)


# --- the demo model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_copy(tmp_path_factory.mktemp("budget") / "demo", THINKING_TEMPLATE)


@pytest.fixture(scope="module")
def llm(thinking_dir: Path) -> LLM:
    return LLM(str(thinking_dir), device="cpu", prompt_cache=0)


def ask_demo(llm: LLM, rng: np.random.Generator, **options: Any) -> tuple[list[int], list[int]]:
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Beautiful is"}], True, None)
    return prompt, llm.generate(prompt, **options).token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_demo_closes_its_block_and_answers_on(llm: LLM, rng: np.random.Generator, temperature: float) -> None:
    """The closing comes after the budget (sampled: within the wait for a character), and the
    answer after it is what the model writes after those tokens as a prompt: the forced tokens
    went through the model."""
    closing = llm.tokenizer.encode(CLOSING, add_special_tokens=False)
    budget = int(rng.integers(0, 12))
    seed = int(rng.integers(1 << 30))
    # ignore_eos: a sampled end of text inside the budget would end the answer before its closing
    prompt, tokens = ask_demo(llm, rng, max_tokens=budget + len(closing) + 10, thinking_token_budget=budget,
                              temperature=temperature, seed=seed, ignore_eos=True)
    at = next(i for i in range(len(tokens)) if tokens[i:i + len(closing)] == closing)
    assert budget <= at <= budget + (WAIT if temperature else 0), (budget, tokens)
    fed = at + len(closing)
    if temperature == 0:
        rest = llm.generate(prompt + tokens[:fed], max_tokens=len(tokens) - fed, ignore_eos=True).token_ids
        assert rest == tokens[fed:]
        free = llm.generate(prompt, max_tokens=len(tokens), ignore_eos=True).token_ids
        assert free[:at] == tokens[:at] and free != tokens


def test_demo_without_an_open_block_is_not_capped(llm: LLM) -> None:
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Flat is"}], True, {"enable_thinking": False})
    free = llm.generate(prompt, max_tokens=20)
    assert llm.generate(prompt, max_tokens=20, thinking_token_budget=2).token_ids == free.token_ids


def test_demo_stream_equals_generate(llm: LLM, rng: np.random.Generator) -> None:
    budget = int(rng.integers(1, 8))
    prompt, tokens = ask_demo(llm, rng, max_tokens=20, thinking_token_budget=budget)
    assert "".join(llm.stream(prompt, max_tokens=20, thinking_token_budget=budget)) == llm.tokenizer.decode(tokens)


# --- the server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(thinking_dir: Path) -> Iterator[Any]:
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from atlas.demo import DEMO_NAME
    from atlas.server.app import ServerState, create_app
    from atlas.server.worker import EngineWorker

    worker = EngineWorker(lambda: LLM(str(thinking_dir), device="cpu", prompt_cache=0))
    served = worker.start()
    try:
        yield TestClient(create_app(ServerState(DEMO_NAME, worker, served, reasoning_parser="qwen3")))  # type: ignore[arg-type]
    finally:
        worker.stop()


def chat(server: Any, **fields: Any) -> Any:
    from atlas.demo import DEMO_NAME

    return server.post("/v1/chat/completions", json={
        "model": DEMO_NAME, "messages": [{"role": "user", "content": "Beautiful is"}], "max_tokens": 24,
        "temperature": 0, **fields})


def test_chat_completion_reasoning_holds_the_budget(server: Any, llm: LLM, rng: np.random.Generator) -> None:
    budget = int(rng.integers(1, 10))
    answer = chat(server, thinking_token_budget=budget)
    assert answer.status_code == 200, answer.text
    message = answer.json()["choices"][0]["message"]
    prompt, tokens = ask_demo(llm, rng, max_tokens=24, thinking_token_budget=budget)
    assert message["reasoning_content"] == llm.tokenizer.decode(tokens[:budget]) + "\n"
    assert message["content"] == llm.tokenizer.decode(tokens).split("</think>", 1)[1].lstrip("\n")


@pytest.mark.parametrize("bad", [-1, 2.5, "4", True])
def test_chat_completion_bad_budget(server: Any, bad: object) -> None:
    answer = chat(server, thinking_token_budget=bad)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "thinking_token_budget", answer.text


def test_messages_thinking_block_holds_budget_tokens(server: Any, llm: LLM, rng: np.random.Generator) -> None:
    anthropic = pytest.importorskip("anthropic")
    from atlas.demo import DEMO_NAME

    client = anthropic.Anthropic(base_url="http://testserver", api_key="none", http_client=server, max_retries=0)
    budget = int(rng.integers(1, 10))
    message = client.messages.create(model=DEMO_NAME, max_tokens=24, messages=[{"role": "user", "content": "Beautiful is"}],
                                     thinking={"type": "enabled", "budget_tokens": budget}, extra_body={"temperature": 0})
    _, tokens = ask_demo(llm, rng, max_tokens=24, thinking_token_budget=budget)
    assert message.content[0].type == "thinking"
    assert message.content[0].thinking == llm.tokenizer.decode(tokens[:budget]) + "\n"
    for thinking in ({"type": "enabled"}, {"type": "enabled", "budget_tokens": 0}, {"type": "enabled", "budget_tokens": "9"}):
        with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
            client.messages.create(model=DEMO_NAME, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                   thinking=thinking)  # type: ignore[arg-type]


def test_serve_reasoning_budget_is_the_requests_default(rng: np.random.Generator) -> None:
    """atlas.serve --reasoning-budget N: requests without thinking_token_budget get N; one with it
    keeps its own."""
    from atlas.demo import DEMO_NAME
    from test_serve import HOST, TIMEOUT_S, cli_server, openai

    budget, own = (int(b) for b in rng.choice(8, 2, replace=False))
    prompt = "Flat is<think>\n"
    demo = LLM(device="cpu", prompt_cache=0)
    with cli_server("--reasoning-budget", str(budget), "--prompt-cache", "0") as (port, stderr):
        client = openai.OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)
        for sent, cap in ((None, budget), (own, own)):
            extra = {} if sent is None else {"extra_body": {"thinking_token_budget": sent}}
            text = client.completions.create(model=DEMO_NAME, prompt=prompt, max_tokens=16, temperature=0, **extra).choices[0].text
            assert text == demo.generate(prompt, max_tokens=16, thinking_token_budget=cap).text, (sent, cap)
    assert any(f"reasoning blocks closed after {budget} tokens" in line for line in stderr), stderr


def test_tags_that_are_special_tokens_and_the_last_turn() -> None:
    """A tokenizer whose <think> / </think> are special tokens (no bytes in decoded text): the cap
    still reads them; the prompt's last turn starts after its last other special token."""
    from types import SimpleNamespace

    table = [None, b"user\nhi <think>", b"assistant\n", b"a", None, None, b"\n", b"\n\n"]  # 0: a turn's start
    tags = {"<think>": 4, "</think>": 5}
    tokenizer = SimpleNamespace(token_bytes=table, backend=SimpleNamespace(token_to_id=tags.get),
                                encode=lambda text, add_special_tokens: [6, 5, 7])
    llm = LLM.from_loaded(SimpleNamespace(tokenizer=tokenizer))  # type: ignore[arg-type]

    def closing_after(prompt: list[int]) -> int:
        cap = llm.thinking_budget(2, prompt)
        return closing_at_ids(run(cap, iter([3] * 20), 8), [6, 5, 7])

    assert closing_after([0, 2, 4]) == 2  # opened by the special <think>
    assert closing_after([0, 2, 4, 6, 5, 7]) == -1  # closed before the answer
    assert closing_after([0, 1, 0, 2]) == -1  # the user's literal <think> is an earlier turn's


def closing_at_ids(tokens: list[int], closing: list[int]) -> int:
    return next((i for i in range(len(tokens)) if tokens[i:i + len(closing)] == closing), -1)


def test_forced_tokens_count_as_picks(llm: LLM, rng: np.random.Generator) -> None:
    """A forced token skips the sampler but enters the pick state (penalties, min_tokens count it)."""
    from atlas.backends.base import SamplingParams
    from atlas.sampling import Penalties

    engine = llm.parts.engine
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Flat is"}], True, None)
    cap = llm.thinking_budget(0, prompt)
    penalties = Penalties(prompt, set(), cap)
    logits = engine.prefill(prompt)
    sampling = SamplingParams(temperature=0.7, presence_penalty=1.0)
    token, _ = engine.pick_tensor(logits, sampling, rng, penalties)
    closing = llm.tokenizer.encode(CLOSING, add_special_tokens=False)
    assert token == closing[0] and penalties.generated == [closing[0]] and cap.forced() == closing[1]


def test_a_continued_block_is_capped_and_a_closed_one_is_not(llm: LLM) -> None:
    """LLM.generate on raw prompts: a prompt whose last <think> is still open (a continued
    message) gets its closing after the budget; one whose block closed gets none."""
    closing = llm.tokenizer.encode(CLOSING, add_special_tokens=False)
    opened = llm.tokenizer.encode("Beautiful is<think>\nLet me see", add_special_tokens=False)
    tokens = llm.generate(opened, max_tokens=20, thinking_token_budget=3).token_ids
    assert closing_at_ids(tokens, closing) == 3
    closed = llm.tokenizer.encode("Beautiful is<think>\n\n</think>\n\n", add_special_tokens=False)
    assert llm.generate(closed, max_tokens=12, thinking_token_budget=1).token_ids == llm.generate(closed, max_tokens=12).token_ids


def test_responses_reasoning_holds_the_budget(server: Any, llm: LLM, rng: np.random.Generator) -> None:
    from atlas.demo import DEMO_NAME

    budget = int(rng.integers(1, 10))
    answer = server.post("/v1/responses", json={"model": DEMO_NAME, "input": "Beautiful is", "max_output_tokens": 24,
                                                "temperature": 0, "thinking_token_budget": budget})
    assert answer.status_code == 200, answer.text
    reasoning = answer.json()["output"][0]
    _, tokens = ask_demo(llm, rng, max_tokens=24, thinking_token_budget=budget)
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == llm.tokenizer.decode(tokens[:budget]) + "\n"


def test_chat_continuing_a_block_is_capped(server: Any, llm: LLM) -> None:
    answer = chat(server, thinking_token_budget=2, continue_final_message=True, add_generation_prompt=False,
                  messages=[{"role": "user", "content": "Beautiful is"}, {"role": "assistant", "content": "<think>\nLet me see"}])
    assert answer.status_code == 200, answer.text
    message = answer.json()["choices"][0]["message"]
    assert message["reasoning_content"] is not None and len(llm.tokenizer.encode(message["reasoning_content"])) <= 3
