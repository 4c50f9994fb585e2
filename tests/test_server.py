"""The HTTP server end to end: scripts/serve.py started on 127.0.0.1 (the shipped weights, with a
chat template added, on the CPU) and talked to with the official `openai` client, as a user would;
its answers compared with the model's own greedy generation (model.generate on the same
checkpoint, decoded by the same tokenizer). Faults (clients that leave, signals, a dead engine,
damaged checkpoints, unsupported fields) are tests/test_server_faults.py's.

Every wait is bounded: the server must answer /health within SERVER_START_S, and each request
has a client timeout."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import transformers
from servers import (
    NAME,
    REQUEST_TIMEOUT_S,
    SHIPPED,
    Reference,
    error_of,
    health,
    load_serve_py,
    serving,
    wait_until_idle,
    with_chat_template,
)
from tolerances import LOGITS_FP32_ATOL, logprobs_fp32_atol

from runtime.text import load_tokenizer, prompt_ids

MAX_BATCH, MAX_WAITING = 16, 4


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return with_chat_template(tmp_path_factory.mktemp("chat-model"))


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    """serve.py on the shipped weights, with the chat template, under the shipped model's name."""
    with serving(chat_model, tmp_path_factory.mktemp("serve"), "--served-model-name", NAME, "--max-batch",
                 str(MAX_BATCH), "--max-waiting", str(MAX_WAITING)) as served:
        yield served.url


@pytest.fixture(scope="module")
def reference():
    return Reference(SHIPPED, load_tokenizer(SHIPPED))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def async_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [NAME]
    assert client(server).models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("gpt-4o")
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", "stream_options": {"include_usage": True}},
                   timeout=30)
    assert r.status_code == 400 and error_of(r)["param"] == "stream_options", r.text
    h = health(server)
    assert h["status"] == "ok" and h["free_blocks"] == h["total_blocks"] > 0
    head = httpx.head(f"{server}/health", timeout=30)  # a load balancer's check
    assert head.status_code == 200 and head.content == b""


def test_greedy_completion_equals_the_models_own_streaming_and_not(server, reference):
    prompt, n = "def fibonacci(n):", 24
    ids = reference.ids(prompt)
    expected = reference.text(ids, n)
    c = client(server)
    done = c.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0)
    assert done.choices[0].text == expected
    assert done.usage.prompt_tokens == len(ids)
    assert done.usage.completion_tokens == n and done.usage.total_tokens == len(ids) + n
    assert done.choices[0].finish_reason == "length"

    chunks = list(c.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert len(chunks) > 3 and chunks[-1].usage.completion_tokens == n  # streamed in pieces, usage last
    assert chunks[-1].choices == [] and all("usage" in ch.model_fields_set and ch.usage is None
                                            for ch in chunks[:-1])  # null on the others, as OpenAI's


def test_raw_stream_is_openai_sse_ending_with_done(server):
    with httpx.stream("POST", f"{server}/v1/completions", timeout=REQUEST_TIMEOUT_S,
                      json={"prompt": "import os", "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert '"object": "text_completion"' in events[0]


def test_chat_streaming_and_not_equal_the_models_own(server, chat_model):
    """Through the tokenizer's chat template, with enable_thinking off as vLLM takes it
    (chat_template_kwargs): the text the model generates for that prompt (generate.py --chat --no-thinking)."""
    prompt, n = "Write a loop", 16
    tokenizer = load_tokenizer(chat_model)
    expected = Reference(chat_model, tokenizer).text(prompt_ids(tokenizer, prompt, chat=True, thinking=False), n)
    c = client(server)
    messages = [{"role": "user", "content": prompt}]
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    done = c.chat.completions.create(model=NAME, messages=messages, max_tokens=n, temperature=0, extra_body=extra)
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == expected
    assert done.usage.completion_tokens <= n
    stream = c.chat.completions.create(model=NAME, messages=messages, max_tokens=n, temperature=0, stream=True,
                                       extra_body=extra)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    thinking = c.chat.completions.create(model=NAME, messages=messages, max_tokens=n, temperature=0)
    assert thinking.usage.prompt_tokens < done.usage.prompt_tokens  # no pre-filled empty think block


def test_16_concurrent_streams_each_equal_the_request_alone(server):
    prompts = [f"def f{i}(x):\n    return" + " x +" * i for i in range(16)]
    max_tokens = [4 + 2 * i for i in range(16)]
    c = client(server)
    alone = [c.completions.create(model=NAME, prompt=p, max_tokens=m, temperature=0).choices[0].text
             for p, m in zip(prompts, max_tokens)]

    async def streamed(ac, prompt, n):
        stream = await ac.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream])

    async def all_at_once():
        ac = async_client(server)
        try:
            return await asyncio.gather(*(streamed(ac, p, m) for p, m in zip(prompts, max_tokens)))
        finally:
            await ac.close()

    together = asyncio.run(asyncio.wait_for(all_at_once(), REQUEST_TIMEOUT_S))
    assert together == alone
    h = wait_until_idle(server)
    assert h["free_blocks"] == h["total_blocks"]
    assert h["peak_running"] >= 8  # they were decoded together, not one after another


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    c = client(server)
    stream = c.completions.create(model=NAME, prompt="class Parser:", max_tokens=900, temperature=0, stream=True)
    pieces = [next(stream).choices[0].text for _ in range(3)]
    assert health(server)["running"] == 1 and health(server)["free_blocks"] < health(server)["total_blocks"]
    stream.close()
    h = wait_until_idle(server, timeout_s=30)
    assert h["running"] == 0 and h["free_blocks"] == h["total_blocks"], h
    assert len(pieces) == 3


def test_prompts_that_share_a_prefix_reuse_its_blocks_and_answer_as_alone(server, reference):
    """Two completions whose prompts share a long beginning: the second finds the first's full
    blocks in the prefix cache (/health counts the hit), and each answer equals the model's own."""
    shared = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find " * 3
    first, second = (reference.ids(shared + ending) for ending in ("food.", "its friends, who wait there"))
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)  # tokens the prompts share
    before = health(server)["prefix_cache"]
    c = client(server)
    for ids in (first, second):
        answer = c.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
        assert answer.choices[0].text == reference.text(ids, 8)
    after = health(server)["prefix_cache"]
    block = health(server)["block_size"]
    assert common >= 3 * block and after["enabled"]
    assert after["hit_tokens"] - before["hit_tokens"] >= block * (common // block)
    assert after["cached_blocks"] > 0 and after["used_blocks"] == 0 and 0 < after["hit_rate"] <= 1


def test_return_token_ids_gives_the_prompts_and_the_replys_tokens(server, reference):
    """vLLM's return_token_ids: a choice carries the prompt's ids and the generated ones (the
    model's own greedy tokens), streamed as each chunk's own ids, which add up to the whole; a
    next turn that resends them exactly is then a cached prefix."""
    prompt, n = "import numpy as np", 10
    ids = list(reference.ids(prompt))
    want = reference.model.generate(torch.tensor([ids]), max_new_tokens=n, temperature=0.0, eos_token_id=[])
    want = want[0, len(ids) :].tolist()
    c = client(server)
    extra = {"return_token_ids": True, "ignore_eos": True}
    done = c.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0, extra_body=extra)
    assert done.choices[0].token_ids == want and done.choices[0].prompt_token_ids == ids
    chunks = list(c.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                       extra_body=extra))
    assert chunks[0].choices[0].prompt_token_ids == ids
    assert sum((chunk.choices[0].token_ids for chunk in chunks), []) == want
    plain = c.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert "token_ids" not in plain.choices[0].model_extra


def test_metrics_count_requests_tokens_and_latencies_in_prometheus_format(server):
    """GET /metrics (Prometheus' text, vLLM's names): two completions, one stopped by max_tokens and
    one cancelled by its client, move the counters by what they did; the latency histograms count
    each first token and each gap between tokens; nothing is running once they are done."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        r = httpx.get(f"{server}/metrics", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return {(s.name, s.labels.get("finished_reason", s.labels.get("le"))): s.value
                for family in text_string_to_metric_families(r.text) for s in family.samples}

    before = scrape()
    c = client(server)
    done = c.completions.create(model=NAME, prompt="import os", max_tokens=6, temperature=0,
                                extra_body={"ignore_eos": True})
    stream = c.completions.create(model=NAME, prompt="class Parser:", max_tokens=900, temperature=0, stream=True)
    next(stream)
    stream.close()
    wait_until_idle(server, timeout_s=30)
    after = scrape()

    def moved(name, label=None):
        return after.get((name, label), 0) - before.get((name, label), 0)

    assert moved("vllm:request_success_total", "length") == 1 and moved("vllm:request_success_total", "abort") == 1
    generated = moved("vllm:generation_tokens_total")
    assert generated >= 6 + 1 and moved("vllm:prompt_tokens_total") == done.usage.prompt_tokens + len(
        load_tokenizer(SHIPPED)("class Parser:", add_special_tokens=False)["input_ids"])
    assert moved("vllm:time_to_first_token_seconds_count") == 2
    assert moved("vllm:inter_token_latency_seconds_count") == generated - 2
    assert after[("vllm:num_requests_running", None)] == 0 and after[("vllm:kv_cache_usage_perc", None)] == 0


def test_n_choices_are_each_a_sequence_sharing_one_prefill(server, reference):
    """n 3: three choices, each the model's greedy text; with a seed, choice i is what the request
    alone gives with seed + i; the prompt is prefilled once (its later choices find its blocks);
    streamed, each index's pieces add up to its whole choice; n 0 and n 65 are 400s naming n."""
    c = client(server)
    prompt = "def read_config(path):\n    " * 3
    ids = reference.ids(prompt)
    before = health(server)["prefix_cache"]["hit_tokens"]
    done = c.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, n=3)
    assert [choice.index for choice in done.choices] == [0, 1, 2]
    assert [choice.text for choice in done.choices] == [reference.text(ids, 8)] * 3
    one = c.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0).usage
    assert done.usage.prompt_tokens == one.prompt_tokens == len(ids)
    assert done.usage.completion_tokens == 3 * one.completion_tokens
    block = health(server)["block_size"]
    assert health(server)["prefix_cache"]["hit_tokens"] - before >= 2 * block * ((len(ids) - 1) // block)
    sampled = dict(model=NAME, prompt=prompt, max_tokens=8, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    three = [choice.text for choice in c.completions.create(n=3, **sampled).choices]
    alone = [c.completions.create(**{**sampled, "seed": 7 + i}).choices[0].text for i in range(3)]
    assert three == alone and len(set(three)) > 1
    pieces = ["", ""]
    for chunk in c.completions.create(n=2, stream=True, **sampled):
        for choice in chunk.choices:
            pieces[choice.index] += choice.text
    assert pieces == alone[:2]
    for n in (0, 65):
        r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", "n": n}, timeout=30)
        assert r.status_code == 400 and error_of(r)["param"] == "n", r.text


def test_a_batch_of_prompts_gives_each_its_choices_as_alone(server, reference):
    """A completion's prompt as a list of texts or of token-id lists (OpenAI's batch): prompt p's
    choice i at index p * n + i, each what its prompt alone gives (a seed: seed + i, as alone),
    whole and streamed; usage counts each prompt once; one bad prompt is a 400 naming prompt."""
    c = client(server)
    texts = ["def read_config(path):", "class Stack:", "import os\n"]
    sampled = dict(model=NAME, max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    alone = [c.completions.create(prompt=text, n=2, **sampled) for text in texts]
    batch = c.completions.create(prompt=texts, n=2, **sampled)
    assert [ch.index for ch in batch.choices] == list(range(6))
    assert [ch.text for ch in batch.choices] == [ch.text for one in alone for ch in one.choices]
    assert batch.usage.prompt_tokens == sum(one.usage.prompt_tokens for one in alone)
    assert batch.usage.completion_tokens == sum(one.usage.completion_tokens for one in alone)
    as_ids = c.completions.create(prompt=[reference.ids(text) for text in texts[:2]], **sampled)
    assert [ch.text for ch in as_ids.choices] == [one.choices[0].text for one in alone[:2]]
    pieces, usage = [""] * 6, None
    for chunk in c.completions.create(prompt=texts, n=2, stream=True, stream_options={"include_usage": True},
                                      **sampled):
        for choice in chunk.choices:
            pieces[choice.index] += choice.text
        usage = chunk.usage or usage
    assert pieces == [ch.text for ch in batch.choices] and usage == batch.usage
    r = httpx.post(f"{server}/v1/completions", json={"prompt": ["x", ""]}, timeout=30)
    assert r.status_code == 400 and error_of(r)["param"] == "prompt" and "empty" in error_of(r)["message"], r.text
    r = httpx.post(f"{server}/v1/completions", json={"prompt": ["x"] * (MAX_BATCH + MAX_WAITING), "n": 2}, timeout=30)
    assert r.status_code == 400 and error_of(r)["param"] == "prompt", r.text


def test_the_prefix_cache_can_be_turned_off():
    assert load_serve_py().parse_args(["--no-prefix-cache"]).prefix_cache is False
    assert load_serve_py().parse_args([]).prefix_cache is True


def assert_logprobs_of_transformers(ids: list[int], tokens: list[int], logprobs: list, k: int, tokenizer) -> None:
    """logprobs: per token, (its text, its log-prob, [(text, log-prob) of its k top ones]), against
    transformers' model of the same checkpoint teacher-forced on the prompt and the tokens:
    log_softmax in fp32. Each top one must be a token transformers ranks there, with its value."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
    truth, atol = logits.log_softmax(-1), logprobs_fp32_atol(logits)
    assert len(logprobs) == len(tokens)
    for token, (text, logprob, top), row in zip(tokens, logprobs, truth):
        assert text == tokenizer.decode([token]) and abs(logprob - row[token].item()) <= atol
        values = [value for _, value in top]
        assert len(top) == k and values == sorted(values, reverse=True)
        assert torch.allclose(torch.tensor(values), row.topk(k).values, rtol=0, atol=atol)
        near = row.topk(k + 2).indices.tolist()  # ranks may swap with the next ones within the tolerance
        for name, value in top:
            assert any(tokenizer.decode([i]) == name and abs(row[i].item() - value) <= atol for i in near)


def test_logprobs_are_transformers_log_softmax_streamed_or_not(server, reference, chat_model):
    """Completions' logprobs 5 and chat's logprobs + top_logprobs 3, greedy and sampled: each token's
    log-prob and its top ones equal transformers' log_softmax (fp32) of the same checkpoint,
    teacher-forced on the tokens the server chose; top ones sorted, a greedy token the first of
    them; the tokens' bytes add up to the text; a stream's entries add up to the whole."""
    c = client(server)
    prompt, n = "import collections", 8
    # no repetition penalty (the checkpoint's default): greedy is then the raw logits' argmax
    extra = {"return_token_ids": True, "ignore_eos": True, "repetition_penalty": 1.0}
    done = c.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0, logprobs=5, extra_body=extra)
    choice, lp = done.choices[0], done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n == len(choice.token_ids)
    assert "".join(lp.tokens) == choice.text and lp.text_offset[0] == 0
    assert all(max(top.values()) == top[tok] for tok, top in zip(lp.tokens, lp.top_logprobs))  # greedy: the first
    assert_logprobs_of_transformers(list(reference.ids(prompt)), choice.token_ids, [
        (text, value, list(top.items())) for text, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)
    ], 5, reference.tokenizer)
    streamed = [ch.choices[0].logprobs for ch in c.completions.create(
        model=NAME, prompt=prompt, max_tokens=n, temperature=0, logprobs=5, stream=True, extra_body=extra)]
    assert sum((s.token_logprobs for s in streamed if s), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed if s), []) == lp.text_offset

    messages = [{"role": "user", "content": "Sort a list"}]
    sampled = dict(model=NAME, messages=messages, max_tokens=n, temperature=1.0, seed=11, logprobs=True,
                   top_logprobs=3, extra_body=extra)
    chat = c.chat.completions.create(**sampled)
    content = chat.choices[0].logprobs.content
    assert bytes(sum((entry.bytes for entry in content), [])).decode() == chat.choices[0].message.content
    assert_logprobs_of_transformers(chat.choices[0].prompt_token_ids, chat.choices[0].token_ids, [
        (e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content
    ], 3, load_tokenizer(chat_model))
    # Streamed: the same tokens, and values within the tolerance (its prompt is a cached prefix now:
    # computed once more in another order, the last fp32 bits may differ).
    pieces = [e for ch in c.chat.completions.create(stream=True, **sampled) if ch.choices[0].logprobs
              for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in pieces] == \
        [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in content]
    assert [e.logprob for e in pieces] == pytest.approx([e.logprob for e in content], abs=LOGITS_FP32_ATOL)
    greedy = c.chat.completions.create(**{**sampled, "temperature": 0, "top_logprobs": 0}).choices[0].logprobs
    assert all(entry.top_logprobs == [] for entry in greedy.content) and len(greedy.content) == n
    plain = c.chat.completions.create(**{**sampled, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_a_long_prompt_is_tokenized_without_holding_up_the_server(server):
    """A megabyte of prompt text takes the tokenizer seconds: /health answers meanwhile, and the
    prompt gets its 400 (longer than the context) naming it."""
    with ThreadPoolExecutor(1) as pool:
        started = time.perf_counter()
        long = pool.submit(httpx.post, f"{server}/v1/completions", json={"prompt": "abc " * 250_000, "max_tokens": 1},
                           timeout=120)
        time.sleep(0.3)  # the body is in, its tokenization under way
        asked = time.perf_counter()
        assert httpx.get(f"{server}/health", timeout=120).status_code == 200
        health_s = time.perf_counter() - asked
        r = long.result()
        long_s = time.perf_counter() - started
    assert r.status_code == 400 and error_of(r)["param"] == "prompt", r.text
    assert health_s < long_s / 2, (health_s, long_s)


def test_bad_requests_get_openai_errors_naming_the_field(server):
    url = f"{server}/v1/completions"
    r = httpx.post(url, content=b'{"prompt": "x", ', headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "Malformed JSON" in error_of(r)["message"]
    r = httpx.post(url, json=["not", "an", "object"], timeout=30)
    assert r.status_code == 400 and "JSON object" in error_of(r)["message"]
    # each refusal names the field it is about, as the API names it (no pydantic union tags)
    for body, param, says in (
        ({"prompt": "x", "temperature": "hot"}, "temperature", "Invalid value for 'temperature'"),
        ({"prompt": 42}, "prompt", "Invalid type for 'prompt': expected a string, a list of strings"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens", "valid integer (got true)"),  # not taken as 1
        ({"prompt": "x", "max_tokens": 2.0}, "max_tokens", "valid integer"),
        ({"prompt": "x", "stream": "yes"}, "stream", "valid boolean"),
        ({"max_tokens": 3}, "prompt", "Missing required parameter: 'prompt'"),
        ({"prompt": "x", "temprature": 0}, "temprature", "Unrecognized request argument supplied: temprature"),
        ({"prompt": "x", "seed": -1}, "seed", "seed must be"),
        ({"prompt": ""}, "prompt", "the prompt is empty"),
        ({"prompt": [99999]}, "prompt", "prompt token ids must be"),
        ({"prompt": "x", "temperature": -1}, "temperature", "temperature must be >= 0"),
        ({"prompt": "x", "top_p": 2}, "top_p", "top_p must be in (0, 1]"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"prompt": "x", "logprobs": True}, "logprobs", "valid integer"),
        ({"prompt": [5] * 1024, "max_tokens": 1}, "prompt", "maximum context length is 1024"),  # the prompt alone
        ({"prompt": "x", "user": 5}, "user", "valid string"),  # ignored, but typed as the API types it
        ({"prompt": "x", "stop": ["a", ""]}, "stop", "stop strings must not be empty"),
    ):
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400 and error_of(r)["param"] == param, (body, r.text)
        assert says in error_of(r)["message"], (body, r.text)
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": 5}]}, timeout=30)
    assert r.status_code == 400 and error_of(r)["param"] == "messages[0].content", r.text
    hi = [{"role": "user", "content": "hi"}]
    for body, param, says in (
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"logprobs": 1}, "logprobs", "valid boolean"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be an integer >= 1"),
        ({"max_completion_tokens": 5000}, "max_completion_tokens", "maximum context length"),
        ({"metadata": 5}, "metadata", "valid dictionary"),
        ({"service_tier": "fastest"}, "service_tier", "service_tier"),
    ):
        r = httpx.post(f"{server}/v1/chat/completions", json={"messages": hi, **body}, timeout=30)
        assert r.status_code == 400 and error_of(r)["param"] == param and says in error_of(r)["message"], r.text

    c = client(server)
    with pytest.raises(openai.BadRequestError) as err:  # prompt + max_tokens over the context
        c.completions.create(model=NAME, prompt=[5] * 1000, max_tokens=100)
    assert err.value.status_code == 400
    assert "maximum context length is 1024 tokens" in str(err.value) and "1100 tokens" in str(err.value)
    assert "1000 in the prompt" in str(err.value)
    with pytest.raises(openai.NotFoundError) as err:
        c.completions.create(model="gpt-5", prompt="x", max_tokens=2)
    assert err.value.status_code == 404 and "gpt-5" in str(err.value)
    with pytest.raises(openai.BadRequestError, match="'best_of' is not supported by this server: use n for"):
        c.completions.create(model=NAME, prompt="x", max_tokens=2, best_of=2)
    with pytest.raises(openai.BadRequestError, match="temperature must be >= 0"):
        c.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=-1)
    assert c.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=0).usage.completion_tokens >= 1


def test_an_unknown_path_or_method_gets_an_openai_error(server):
    """Not FastAPI's {"detail": "Not Found"}: the error shape of every other refusal, naming what was asked."""
    r = httpx.post(f"{server}/v1/complete", json={"prompt": "x"}, timeout=30)
    error = error_of(r)
    assert r.status_code == 404 and error["type"] == "invalid_request_error", r.text
    assert "POST /v1/complete)" in error["message"] and "POST /v1/completions" in error["message"], error
    r = httpx.get(f"{server}/v1/completions", timeout=30)
    error = error_of(r)
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
    assert "GET /v1/completions" in error["message"] and "takes POST" in error["message"], error
    with pytest.raises(openai.NotFoundError, match=r"Invalid URL \(POST /v1/embeddings\)"):  # what the client says
        client(server).embeddings.create(model=NAME, input="x")


def test_past_the_queue_bound_requests_get_429_and_closing_the_rest_cancels_them(server):
    """MAX_BATCH run, MAX_WAITING wait, the rest are refused with 429 and Retry-After; closing every
    stream cancels the accepted ones (waiting ones included) and the cache comes back full."""
    n = MAX_BATCH + MAX_WAITING + 4
    body = {"model": NAME, "prompt": "import sys", "max_tokens": 600, "temperature": 0, "stream": True}

    async def flood():
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=2 * n)) as http:
            responses = await asyncio.gather(*(
                http.send(http.build_request("POST", f"{server}/v1/completions", json=body), stream=True)
                for _ in range(n)))
            statuses = [r.status_code for r in responses]
            refused = [r for r in responses if r.status_code == 429]
            errors = [error_of(httpx.Response(429, content=await r.aread())) for r in refused]
            retry_after = [r.headers.get("retry-after") for r in refused]
            for r in responses:
                await r.aclose()
            return statuses, errors, retry_after

    statuses, errors, retry_after = asyncio.run(asyncio.wait_for(flood(), REQUEST_TIMEOUT_S))
    assert statuses.count(200) == MAX_BATCH + MAX_WAITING and statuses.count(429) == n - MAX_BATCH - MAX_WAITING
    assert all("the server is full" in e["message"] and e["type"] == "rate_limit_error" for e in errors)
    assert retry_after == ["1"] * len(errors)
    h = wait_until_idle(server, timeout_s=60)
    assert h["running"] == 0 and h["waiting"] == 0 and h["free_blocks"] == h["total_blocks"], h
    after = client(server).completions.create(model=NAME, prompt="import sys", max_tokens=3, temperature=0)
    assert after.choices[0].finish_reason in ("length", "stop")
