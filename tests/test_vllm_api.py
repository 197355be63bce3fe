"""vLLM's offline API (atlas.vllm_api): `llm.generate(prompts, SamplingParams(...))` and
`llm.chat(messages, SamplingParams(...))` answer with RequestOutputs whose completions are what
atlas's keyword API generates for the same settings, in vLLM's field names and shapes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from atlas import LLM, SamplingParams, StructuredOutputsParams
from atlas.errors import AtlasError
from atlas.llm import context_capacity
from atlas.sampling_params import GuidedDecodingParams
from runtime_checkpoint import fresh_tiny_checkpoint

WORDS = ["Beautiful", "is", "better", "than", "ugly", "Flat", "dense.", "Sparse", "nested"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights: sampled completions differ from one seed to the next."""
    return fresh_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> LLM:
    return LLM(str(tiny_dir), device="cpu", max_seq_len=96)


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM(device="cpu", prompt_cache=0)


def text_prompt(rng: np.random.Generator) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(2, 6))))


def test_a_batch_answers_as_the_keyword_api(tiny: LLM, rng: np.random.Generator) -> None:
    """Texts, token ids and vLLM's prompt dicts; one RequestOutput per prompt, in order, with
    fresh request ids, each completion j sampled with seed + j."""
    texts = [text_prompt(rng) for _ in range(2)]
    ids = tiny.tokenizer.encode(text_prompt(rng))
    seed, n = int(rng.integers(1 << 30)), int(rng.integers(2, 4))
    params = SamplingParams(n=n, temperature=0.9, top_p=0.95, seed=seed, max_tokens=int(rng.integers(3, 9)), ignore_eos=True)
    outputs = tiny.generate([texts[0], {"prompt": texts[1]}, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [o.prompt for o in outputs] == [*texts, None]
    assert [int(o.request_id) for o in outputs] == list(range(int(outputs[0].request_id), int(outputs[0].request_id) + 3))
    for output, prompt in zip(outputs, [texts[0], texts[1], ids]):
        assert output.prompt_token_ids == (tiny.tokenizer.encode(prompt) if isinstance(prompt, str) else ids)
        assert output.finished and [c.index for c in output.outputs] == list(range(n))
        for j, completion in enumerate(output.outputs):
            want = tiny.generate(prompt, temperature=0.9, top_p=0.95, seed=seed + j, max_tokens=params.max_tokens,
                                 ignore_eos=True)
            assert (completion.text, completion.token_ids) == (want.text, want.token_ids)
            assert completion.finish_reason == "length" and completion.stop_reason is None
            assert completion.logprobs is None and completion.cumulative_logprob is None
    assert len({tuple(c.token_ids) for c in outputs[0].outputs}) > 1 or params.max_tokens < 4  # seeds differ
    by_keyword = tiny.generate(prompts=texts, sampling_params=params, use_tqdm=False)  # vLLM's argument names
    assert [[c.token_ids for c in o.outputs] for o in by_keyword] == [[c.token_ids for c in o.outputs] for o in outputs[:2]]


def test_logprobs_in_vllms_shape(tiny: LLM, rng: np.random.Generator) -> None:
    """Per position: the chosen token first (its rank among the logits), then the k most likely
    (ranks 1..k); the cumulative log-probability is their sum; prompt_logprobs start with None."""
    prompt, k = text_prompt(rng), int(rng.integers(1, 6))
    params = SamplingParams(temperature=0.7, seed=int(rng.integers(1 << 30)), max_tokens=6, logprobs=k, prompt_logprobs=k)
    (output,) = tiny.generate(prompt, params)
    want = tiny.generate(prompt, temperature=0.7, seed=params.seed, max_tokens=6, logprobs=k, prompt_logprobs=k)
    completion = output.outputs[0]
    assert completion.token_ids == want.token_ids and want.logprobs is not None
    for entry, token, score in zip(completion.logprobs or [], completion.token_ids, want.logprobs, strict=True):
        assert next(iter(entry)) == token and entry[token].logprob == score.logprob and entry[token].rank == score.rank
        assert entry[token].decoded_token == tiny.tokenizer.decode([token], skip_special_tokens=False)
        tops = [(t, entry[t].logprob, entry[t].rank) for t, _ in score.top]
        assert tops == [(t, lp, r if t != token else score.rank) for r, (t, lp) in enumerate(score.top, 1)]
        assert len(entry) == k + (token not in dict(score.top))
    assert completion.cumulative_logprob == pytest.approx(sum(s.logprob for s in want.logprobs), abs=0)
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(output.prompt_token_ids)
    for entry, token in zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:]):
        assert entry is not None and next(iter(entry)) == token


def test_stop_reasons(demo: LLM) -> None:
    """The stop string that ended a completion, a stop_token_ids id, or None after the eos; the
    keyword API's results carry the same."""
    line = "Beautiful is better than ugly."
    words = demo.tokenizer.encode(" than")
    by_string = demo.generate("Beautiful is", SamplingParams(temperature=0, stop=["than", "zzz"], max_tokens=20))
    by_id = demo.generate("Beautiful is", SamplingParams(temperature=0, stop_token_ids=words[-1:], max_tokens=20))
    assert (by_string[0].outputs[0].stop_reason, by_string[0].outputs[0].finish_reason) == ("than", "stop")
    assert by_id[0].outputs[0].stop_reason == words[-1] and by_id[0].outputs[0].token_ids[-1] == words[-1]
    eos = demo.generate(line, SamplingParams(temperature=0, max_tokens=None))[0].outputs[0]
    assert eos.finish_reason == "stop" and eos.stop_reason is None and eos.token_ids[-1] in demo.eos_ids()
    assert demo.generate("Beautiful is", stop=["than"], max_tokens=20).stop_reason == "than"


def test_max_tokens_none_fills_the_context(tiny: LLM, rng: np.random.Generator) -> None:
    """vLLM's max_tokens None: as many tokens as the context holds after the prompt."""
    prompt = text_prompt(rng)
    (output,) = tiny.generate(prompt, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    room = context_capacity(tiny.parts.spec, tiny.parts.engine) - len(output.prompt_token_ids) + 1
    assert len(output.outputs[0].token_ids) == room
    least = int(rng.integers(2, room + 1))  # min_tokens is held to the room, not to a stand-in max_tokens
    (held,) = tiny.generate(prompt, SamplingParams(max_tokens=None, min_tokens=least, temperature=0))
    assert len(held.outputs[0].token_ids) >= least
    with pytest.raises(AtlasError, match="min_tokens"):
        tiny.generate(prompt, SamplingParams(max_tokens=None, min_tokens=room + 1))


def test_per_prompt_params_and_structured_outputs(demo: LLM, rng: np.random.Generator) -> None:
    choices = [str(w) for w in rng.choice(WORDS, size=3, replace=False)]
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    params = [SamplingParams(temperature=0, guided_decoding=GuidedDecodingParams(choice=choices)),  # the earlier names
              SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))]
    picked, shaped = demo.generate([text_prompt(rng), text_prompt(rng)], params)
    assert picked.outputs[0].text in choices
    assert shaped.outputs[0].text == demo.generate(shaped.prompt, max_tokens=40, json_schema=json.loads(schema)).text


def test_chat_answers_as_the_keyword_api(demo: LLM, rng: np.random.Generator) -> None:
    conversations = [[{"role": "user", "content": text_prompt(rng)}] for _ in range(2)]
    outputs = demo.chat(conversations, SamplingParams(temperature=0, max_tokens=8), chat_template_kwargs={})
    for output, conversation in zip(outputs, conversations, strict=True):
        want = demo.chat(conversation, max_tokens=8)
        assert output.outputs[0].text == want.text
        assert output.prompt == demo.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)
        assert output.prompt_token_ids == demo.tokenizer.encode_chat(conversation)
    (one,) = demo.chat(conversations[0], SamplingParams(temperature=0, max_tokens=8))
    assert one.outputs[0].text == outputs[0].outputs[0].text


@pytest.mark.parametrize("call, needle", [
    (lambda llm: llm.generate("Flat", {"temperature": 0}), "must be an atlas.SamplingParams"),
    (lambda llm: llm.generate(["Flat", "is"], [SamplingParams()] * 3), "3 entries for 2 prompts"),
    (lambda llm: llm.generate("Flat", SamplingParams(n=0)), "SamplingParams.n"),
    (lambda llm: llm.generate("Flat", SamplingParams(), max_tokens=3), "not both"),
    (lambda llm: llm.generate({"text": "Flat"}, SamplingParams()), "'prompt' (text) or 'prompt_token_ids'"),
    (lambda llm: llm.generate("Flat", SamplingParams(temperature=-1)), "temperature"),
    (lambda llm: llm.generate("Flat", SamplingParams(structured_outputs=StructuredOutputsParams(json="{"))), "not JSON"),
    (lambda llm: llm.generate("Flat", SamplingParams(), use_tqdm="no"), "use_tqdm"),
    (lambda llm: llm.generate("Flat", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"),
                                                     guided_decoding=StructuredOutputsParams(regex="b"))), "give one"),
    (lambda llm: llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(), max_tokens=2), "not both"),
])
def test_bad_input_is_one_line(demo: LLM, call: object, needle: str) -> None:
    with pytest.raises(AtlasError) as err:
        call(demo)  # type: ignore[operator]
    assert needle in str(err.value) and "\n" not in str(err.value), err.value


def test_vllms_import_paths() -> None:
    import atlas.sampling_params as sampling_params

    assert sampling_params.SamplingParams is SamplingParams
    assert sampling_params.StructuredOutputsParams is StructuredOutputsParams
    assert SamplingParams().max_tokens == 16 and SamplingParams().temperature == 1.0  # vLLM's defaults


def test_vllms_engine_arguments(tiny_dir: Path, rng: np.random.Generator) -> None:
    """LLM(max_model_len=, seed=, enable_prefix_caching=False, kv_cache_dtype="auto", and the ones
    with nothing to do on one GPU): the context; calls without a seed draw theirs from the seed's
    stream, so two LLMs given one seed sample alike (the keyword API too) and another seed differs."""
    seed, length = int(rng.integers(1 << 30)), int(rng.integers(40, 90))
    settings = {"max_model_len": length, "enable_prefix_caching": False, "kv_cache_dtype": "auto",
                "gpu_memory_utilization": 0.9, "trust_remote_code": True, "tensor_parallel_size": 1, "dtype": "auto"}
    runs = []
    for s in (seed, seed, seed + 1):
        llm = LLM(str(tiny_dir), device="cpu", seed=s, **settings)
        assert context_capacity(llm.parts.spec, llm.parts.engine) == length and llm.parts.engine.prompt_cache.capacity == 0
        vllm_style = llm.generate(["Flat is", "Sparse is"], SamplingParams(max_tokens=8, ignore_eos=True))
        keyword = llm.generate("Flat is", temperature=1.0, max_tokens=8, ignore_eos=True)
        runs.append(([o.outputs[0].token_ids for o in vllm_style], keyword.token_ids))
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("args, needle", [
    ({"tensor_parallel_size": 2}, "one GPU"),
    ({"max_model_len": 64, "max_seq_len": 32}, "disagree"),
    ({"max_modle_len": 64}, "did you mean 'max_model_len'"),
    ({"dtype": "float16"}, "dtype='float16'"),
    ({"seed": -1}, "seed"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
    ({"speculative_config": {"method": "eagle"}}, "MTP head"),
    ({"speculative_config": {"method": "mtp"}, "spec_k": 1}, "exclude each other"),
])
def test_bad_engine_arguments_are_one_line(tiny_dir: Path, args: dict[str, object], needle: str) -> None:
    with pytest.raises(AtlasError) as err:
        LLM(str(tiny_dir), device="cpu", **args)  # type: ignore[arg-type]
    assert needle in str(err.value) and "\n" not in str(err.value), err.value


def test_default_sampling_params_are_the_models_recommended(tiny_dir: Path, tmp_path: Path, rng: np.random.Generator) -> None:
    import shutil

    recommended = {"temperature": round(float(rng.uniform(0.1, 1.5)), 3), "top_p": 0.95, "top_k": int(rng.integers(1, 50))}
    model = Path(shutil.copytree(tiny_dir, tmp_path / "model"))
    (model / "generation_config.json").write_text(json.dumps({**recommended, "do_sample": True}))
    params = LLM(str(model), device="cpu", max_seq_len=32).get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == tuple(recommended.values())
    assert params.max_tokens == SamplingParams().max_tokens and params.min_p == SamplingParams().min_p


def test_reset_prefix_cache_runs_the_next_prompt_whole(tiny: LLM, rng: np.random.Generator) -> None:
    prompt = text_prompt(rng)
    first = tiny.generate(prompt, max_tokens=3)
    again = tiny.generate(prompt, max_tokens=3)
    assert again.cached_tokens > 0 and again.token_ids == first.token_ids
    assert tiny.reset_prefix_cache() is True
    fresh = tiny.generate(prompt, max_tokens=3)
    assert fresh.cached_tokens == 0 and fresh.token_ids == first.token_ids


def test_get_tokenizer_renders_a_chat_as_vllm_scripts_do(demo: LLM, rng: np.random.Generator) -> None:
    """vLLM's llm.get_tokenizer().apply_chat_template(messages, tokenize=False / True) -> the text /
    ids LLM.chat runs."""
    messages = [{"role": "user", "content": text_prompt(rng)}]
    tokenizer = demo.get_tokenizer()
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ids == tokenizer.encode_chat(messages) == tokenizer.encode(text, add_special_tokens=False)
    (output,) = demo.generate(text, SamplingParams(temperature=0, max_tokens=6))
    assert output.outputs[0].text == demo.chat(messages, max_tokens=6).text
