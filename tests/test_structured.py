"""Structured output: the grammars of serve/constraints.py, the engine choosing among the tokens a
grammar allows (serve/engine.py, runtime/grammar.py), and the server's response_format and forced
tool calls through the official `openai` client, on the shipped model with a chat template.

The reference for which tokens a grammar allows is xgrammar itself (a matcher of the test's own);
for the model's choice among them, transformers' model of the same checkpoint."""

import asyncio
import json
import random
import re
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest
import torch
import transformers
import xgrammar
from checkpoints import hf_model, save
from conftest import DEVICE, use_path
from in_process import load_script
from servers import NAME, REQUEST_TIMEOUT_S, ROOT, SHIPPED, error_of, serving, with_chat_template
from tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

from qwen3 import Qwen3ForCausalLM
from runtime.grammar import Grammars, allow, mask_words, structural_tag
from runtime.sampling import SamplingParams
from runtime.text import load_tokenizer
from serve.constraints import json_format, reasoning_of, response_grammar, tool_grammar
from serve.engine import Engine, Request

random_schema = load_script("bench_structured").random_schema
GREEDY = SamplingParams(temperature=0.0)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(SHIPPED)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=4096, stop_token_ids=[0])
    return xgrammar.GrammarCompiler(info)


def follows(compiler, tokenizer, spec: str, text: str) -> bool:
    """Whether the grammar of spec takes text's tokens, then the stop token."""
    matcher = xgrammar.GrammarMatcher(compiler.compile_structural_tag(spec))
    return all(matcher.accept_token(t) for t in tokenizer.encode(text)) and matcher.accept_token(0)


def test_the_grammars_take_qwen3s_formats_and_nothing_else(compiler, tokenizer):
    """A JSON answer after the reasoning block as the prompt left it (the model opens it; the
    prompt opened it; none), any JSON object, and Qwen3's tool calls: named, required, strict."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    ok = lambda spec, text: follows(compiler, tokenizer, spec, text)  # noqa: E731
    first = response_grammar("json_schema", schema, "first")
    assert ok(first, '<think>hm</think>\n\n{"a": 1}')
    assert not ok(first, '{"a": 1}') and not ok(first, '<think>hm</think>\n\n{"a": "x"}')
    inside = response_grammar("json_schema", schema, "inside")
    assert ok(inside, 'hm</think>\n\n{"a": 1}') and not ok(inside, '<think>hm</think>\n\n{"a": 1}')
    any_object = response_grammar("json_object", None, "none")
    assert ok(any_object, '{"q": [1, 2]}') and not ok(any_object, "[1]") and not ok(any_object, '{"q":  1}')
    assert response_grammar("text", None, "none") is None

    tools = [("get_weather", WEATHER, False), ("now", None, False)]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    named = tool_grammar(tools, "get_weather", "none")
    assert ok(named, call) and not ok(named, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert not ok(named, call.replace('"Paris"', "3"))
    required = tool_grammar(tools, "required", "first")
    assert ok(required, "<think>x</think>\n\n" + call) and not ok(required, "<think>x</think>\n\nhello")
    strict = tool_grammar([("get_weather", WEATHER, True)], "auto", "none")
    assert ok(strict, "hello") and ok(strict, "hi " + call) and not ok(strict, "hi " + call.replace("Paris", "P" * 11))
    assert ok(required, "<think>x</think>\n\n" + call + "\n" + call)  # parallel calls, a newline apart
    assert not ok(required, "<think>x</think>\n\n" + call + " and more")  # calls only
    one = tool_grammar(tools, "required", "none", parallel=False)
    assert ok(one, call) and not ok(one, call + "\n" + call)
    assert tool_grammar(tools, "auto", "none", parallel=False) is not None  # one call at most: enforced
    assert tool_grammar(tools, "auto", "none") is None and tool_grammar(tools, "none", "none") is None


def test_the_reasoning_block_is_read_from_the_template_and_the_prompt():
    """Opened by the prompt: inside it; a template that switches thinking, not closed in the
    prompt: the model opens it; closed (thinking off), or a template without the switch: none."""
    hybrid = "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    assert reasoning_of(hybrid, "<|im_start|>assistant\n") == "first"
    assert reasoning_of(hybrid, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == "none"
    assert reasoning_of("{{ '<think>' }}", "<|im_start|>assistant\n<think>\n") == "inside"
    assert reasoning_of("{{ m.content.split('</think>')[-1] }} <think>", "<|im_start|>assistant\n") == "none"
    assert reasoning_of(None, "assistant\n") == "none"


def alone(model, prompt, n):
    out = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=n, eos_token_id=[], temperature=0.0,
                         repetition_penalty=1.0)  # the engine request's: no penalty (the checkpoint has one)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("fill_threads", [1, 3])
def test_the_masks_of_a_step_are_each_grammars_own(tokenizer, compiler, fill_threads):
    """Grammars filling on one thread and on three write, for 13 requests walking their schemas
    (random allowed tokens, some ending early), each row's mask exactly as a matcher of xgrammar's
    own fed the same tokens, and every token for a request whose grammar has ended."""
    schemas = [random_schema(random.Random(seed)) for seed in range(13)]
    specs = [structural_tag(json_format(schema)) for schema in schemas]
    grammars = Grammars(tokenizer, 4096, [0], fill_threads=fill_threads)
    matchers = [grammars.matcher(spec) for spec in specs]
    for m in matchers:
        assert m.ready(60.0)
        m.start()
    own = [xgrammar.GrammarMatcher(compiler.compile_structural_tag(spec)) for spec in specs]
    words = torch.zeros(len(specs), mask_words(4096), dtype=torch.int32)
    expected = xgrammar.allocate_token_bitmask(1, 4096)
    generator = torch.Generator().manual_seed(0)
    ended = 0
    for _ in range(40):
        grammars.fill(matchers, words)
        for i, (m, reference) in enumerate(zip(matchers, own)):
            if m.terminated:
                assert (words[i] == -1).all()
            else:
                reference.fill_next_token_bitmask(expected, 0)
                assert torch.equal(words[i], expected[0])
        tokens = allow(torch.rand(len(specs), 4096, generator=generator), words).argmax(-1).tolist()
        live = [i for i, m in enumerate(matchers) if not m.terminated]
        grammars.accept([matchers[i] for i in live], [tokens[i] for i in live])
        for i in live:
            assert own[i].accept_token(tokens[i]) and not matchers[i].rejected
        ended = sum(m.terminated for m in matchers)
    assert 0 < ended < len(specs)  # both kinds of row were seen


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A one-layer random model of the shipped tokenizer's vocabulary: the fused path's kernels,
    interpreted, in seconds (the shipped model's eight layers take minutes)."""
    return save(hf_model(seed=7, vocab_size=4096, num_hidden_layers=1), tmp_path_factory.mktemp("small"))


@pytest.mark.parametrize("path, n", [("reference", 40), ("fused", 12)])
def test_a_constrained_greedy_token_is_transformers_argmax_among_the_allowed(tokenizer, compiler, small, path, n):
    """Two constrained requests, one greedy and one sampled, beside a free one in one batch: every
    constrained token is one its grammar allows there (xgrammar's matcher of the test's own), the
    greedy one's the most likely of those by transformers' logits of the same checkpoint
    teacher-forced on the output, and their top log-probabilities are of allowed tokens only; the
    free request gets what it gets alone. The shipped model on the reference path; a one-layer
    random one on the fused path (its kernels and sampler interpreted)."""
    checkpoint = SHIPPED if path == "reference" else small
    model = Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, device=DEVICE, progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    prompt = tokenizer("def main():\n    config = ", add_special_tokens=False)["input_ids"]
    schemas = [random_schema(random.Random(seed)) for seed in (1, 2)]
    specs = [structural_tag(json_format(schema)) for schema in schemas]
    use_path(model, path)
    try:
        engine = Engine(model, tokenizer, max_batch=3, n_blocks=64)
        outputs = [[] for _ in range(3)]
        sampled = SamplingParams(temperature=1.0, top_k=50)
        for spec, params, out in zip([*specs, None], [GREEDY, sampled, GREEDY], outputs):
            engine.add(Request(prompt, n, params, seed=3, grammar=spec, eos_ids=() if spec is None else None,
                               logprobs=5 if spec is not None else None), out.append)
        engine.run()
    finally:
        use_path(model, None)
    assert [t for o in outputs[2] for t in o.token_ids] == alone(model, prompt, n)
    for spec, schema, out, greedy in zip(specs, schemas, outputs[:2], (True, False)):
        tokens = [t for o in out for t in o.token_ids]
        matcher = xgrammar.GrammarMatcher(compiler.compile_structural_tag(spec))
        words = xgrammar.allocate_token_bitmask(1, 4096)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :]
        logprobs = [lp for o in out for lp in o.logprobs]
        for token, row, (_, top_ids, _) in zip(tokens, logits, logprobs):
            matcher.fill_next_token_bitmask(words, 0)
            allowed = torch.tensor([(words[0, i // 32] >> (i % 32)) & 1 for i in range(4096)], dtype=torch.bool)
            best = row.masked_fill(~allowed, float("-inf")).max()
            assert allowed[token]
            assert not greedy or row[token] >= best - (LOGITS_FP32_ATOL + LOGITS_FP32_RTOL * best.abs())
            assert top_ids and all(allowed[i] for i in top_ids)  # log-probabilities of the grammar's tokens only
            assert matcher.accept_token(token)
        if out[-1].finish_reason == "stop":  # complete within n tokens: a JSON document of its schema
            jsonschema.validate(json.loads("".join(o.text for o in out)), schema)
    if path == "reference":
        assert outputs[0][-1].finish_reason == "stop"


def test_a_grammar_that_compiles_long_does_not_hold_the_requests_behind_it(tokenizer):
    """A schema whose grammar takes long to build (a long bounded repetition: a second or more)
    waits for it in the queue while a request sent after it is admitted and finishes."""
    model = Qwen3ForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32, progress=False)
    engine = Engine(model, tokenizer, max_batch=4, n_blocks=64)
    slow = structural_tag(json_format({"type": "string", "pattern": "(a|b){1,4000}"}))
    outputs = [[], []]
    engine.add(Request([5, 6, 7], 4, GREEDY, grammar=slow), outputs[0].append)
    engine.add(Request([5, 6, 7], 4, GREEDY, eos_ids=()), outputs[1].append)
    while not (outputs[1] and outputs[1][-1].finish_reason):
        engine.step()
    assert not outputs[0]  # still compiling
    engine.run()
    assert outputs[0][-1].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """serve.py on the shipped weights with a chat template (thinking switched off by the tests)."""
    path = with_chat_template(tmp_path_factory.mktemp("structured-model"))
    with serving(path, tmp_path_factory.mktemp("serve"), "--served-model-name", NAME, "--max-batch", "16") as served:
        yield served.url


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def chat(**fields) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": "Reply in JSON"}], "max_tokens": 200,
            "temperature": 0, "extra_body": NO_THINKING, **fields}


def test_fifty_random_schemas_each_parse_and_validate(server):
    """50 random JSON schemas (nested objects, arrays, enums, required fields), all at once: every
    reply is a JSON document of its schema; a stream's pieces add up to its whole reply."""
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    rng = random.Random(50)
    schemas = [random_schema(rng) for _ in range(50)]

    async def ask(schema):
        fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
        return await client.chat.completions.create(**chat(response_format=fmt))

    async def all_of_them():
        return await asyncio.gather(*(ask(schema) for schema in schemas))

    replies = asyncio.run(all_of_them())
    for schema, reply in zip(schemas, replies):
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    c = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schemas[0]}}
    pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**chat(response_format=fmt),
                                                                                   stream=True)]
    assert "".join(pieces) == replies[0].choices[0].message.content
    anything = c.chat.completions.create(**chat(response_format={"type": "json_object"}))
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    completion = c.completions.create(model=NAME, prompt="config = ", max_tokens=200, temperature=0,
                                      extra_body={"response_format": fmt})  # vLLM's extension of completions
    jsonschema.validate(json.loads(completion.choices[0].text), schemas[0])


def streamed_calls(stream) -> tuple[list[tuple[str, str]], int, str | None, str | None]:
    """A chat stream's tool calls as agent frameworks put them together (name from a call's first
    piece, its arguments' pieces joined by index): [(name, arguments)], how many pieces the
    arguments came in, the content, the finish reason."""
    calls, pieces, content, reason = {}, 0, None, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content = content + delta.content if delta.content else content
        reason = chunk.choices[0].finish_reason or reason
        for piece in delta.tool_calls or []:
            if piece.function.name is not None:
                assert piece.id.startswith("call_") and piece.index not in calls
                calls[piece.index] = [piece.function.name, ""]
            calls[piece.index][1] += piece.function.arguments or ""
            pieces += bool(piece.function.arguments)
    return [tuple(calls[i]) for i in sorted(calls)], pieces, content, reason


def test_a_forced_tool_call_is_a_call_of_that_tool_with_valid_arguments(server):
    """tool_choice a named function: one call of it, its arguments of its schema, finish_reason
    stop (OpenAI's for a named function), streamed as they come or whole; "required" with
    parallel_tool_calls false: one call of one of the tools, nothing else, finish_reason
    tool_calls; a tool without parameters: calls with no arguments ({})."""
    c = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
             {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = c.chat.completions.create(**chat(tools=tools, tool_choice=named)).choices[0]
    assert reply.finish_reason == "stop" and len(reply.message.tool_calls) == 1 and reply.message.content is None
    call = reply.message.tool_calls[0].function
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    calls, pieces, content, reason = streamed_calls(c.chat.completions.create(**chat(tools=tools, tool_choice=named),
                                                                              stream=True))
    assert calls == [(call.name, call.arguments)] and pieces > 1 and (content, reason) == (None, "stop")
    required = c.chat.completions.create(**chat(tools=tools, tool_choice="required", parallel_tool_calls=False))
    calls = required.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "now")
    assert required.choices[0].message.content is None and required.choices[0].finish_reason == "tool_calls"
    ping = [{"type": "function", "function": {"name": "ping"}}]  # no parameters: OpenAI's empty parameter list
    for seed in range(3):
        calls = c.chat.completions.create(**chat(tools=ping, tool_choice="required", temperature=1.0,
                                                 seed=seed)).choices[0].message.tool_calls
        assert calls and all((t.function.name, json.loads(t.function.arguments)) == ("ping", {}) for t in calls)


def test_a_forced_call_cut_short_is_a_call_with_the_arguments_written(server):
    """max_tokens ending a forced call anywhere: once it has its name, a call (as OpenAI's) whose
    arguments are what the model wrote, finish_reason length; before, no call; never Qwen3's markup
    in content. The stream's pieces add up to the whole reply, at every cut (all asked at once)."""
    c = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]

    async def streamed(fields):
        return streamed_calls([chunk async for chunk in await c.chat.completions.create(**fields, stream=True)])

    async def cuts(one, first):  # every other place: the two choices' cuts together take every one
        whole = await c.chat.completions.create(**chat(**one))
        fields = [chat(**one, max_tokens=n) for n in range(first, whole.usage.completion_tokens, 2)]
        replies = await asyncio.gather(*(c.chat.completions.create(**f) for f in fields),
                                       *(streamed(f) for f in fields))
        return whole, replies[: len(fields)], replies[len(fields) :]

    async def both():
        return [await cuts(dict(tools=tools, tool_choice=choice, parallel_tool_calls=False), first)
                for first, choice in enumerate(("required", {"type": "function", "function": {"name": "get_weather"}}),
                                               start=1)]

    for whole, cut, streams in asyncio.run(both()):
        arguments = whole.choices[0].message.tool_calls[0].function.arguments
        for reply, stream in zip(cut, streams):
            reply = reply.choices[0]
            assert (reply.finish_reason, reply.message.content) == ("length", None)
            calls = [(t.function.name, t.function.arguments) for t in reply.message.tool_calls or []]
            assert calls == [] or (len(calls) == 1 and calls[0][0] == "get_weather"
                                   and arguments.startswith(calls[0][1])), calls
            assert stream[::2] == (calls, None)
        assert sum(bool(reply.choices[0].message.tool_calls) for reply in cut) > 5  # cut at many places
    sync = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    fields = chat(tools=tools, tool_choice="required", parallel_tool_calls=False, stop=['"city'])
    stopped = sync.chat.completions.create(**fields).choices[0]  # the stop string inside the arguments
    calls = [(t.function.name, t.function.arguments) for t in stopped.message.tool_calls]
    assert calls == [("get_weather", "{")] and stopped.finish_reason == "stop"  # not "tool_calls": not whole
    assert streamed_calls(sync.chat.completions.create(**fields, stream=True))[::2] == (calls, None)
    assert streamed_calls(sync.chat.completions.create(**fields, stream=True))[3] == "stop"



BROKEN = {"type": "object", "properties": {"a": {"$ref": "#/x"}}}  # a reference to nothing
UNENFORCED_SCHEMAS = [  # what xgrammar would not enforce: output that fails them would get through
    {"type": "object", "required": ["zz"], "properties": {}},
    {"anyOf": []},
    {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
    {"allOf": [{"type": "object"}, {"required": ["a"], "properties": {"a": {}}}]},
    {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 3}}, "required": ["x"]},
    {"type": "string", "pattern": "a+", "maxLength": 3},
    {"type": "object", "properties": {"x": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
    {"oneOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}], "$defs": {  # tags that may be equal
        "a": {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]},
        "b": {"type": "object", "properties": {"k": {"const": "y"}}, "required": ["k"]}}},
    {"oneOf": [{"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},  # 1 and 1.0: one number
               {"type": "object", "properties": {"k": {"const": 1.0}}, "required": ["k"]}]},
    {"type": "object", "properties": {"x": {"oneOf": [{"$ref": "#num"}, {"type": "integer"}]}},  # an anchor
     "$defs": {"n": {"$anchor": "num", "type": "number"}}},
    {"type": "object", "properties": {"x": {"$ref": "#/components/u"}},  # a target outside $defs
     "components": {"u": {"type": "array", "uniqueItems": True}}},
    {"type": "object", "properties": {"x": {"$ref": "#/components/u"}},
     "components": {"u": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
    {"type": "object", "properties": {"x": {"$ref": "#/$defs/a", "maximum": 3}}, "$defs": {"a": {"type": "integer"}}},
    {"type": "object", "properties": {"x": {"enum": ["abc", 5], "maxLength": 2}}},
    {"type": "object", "properties": {"x": {"type": "integer", "multipleOf": 2.5}}},
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "dependencies": {"a": ["b"]}},
    {"type": "object", "properties": {"x": {"$id": "http://example.com/x", "type": "integer"}}},
    # not JSON Schema (the metaschema), some where xgrammar does not look (a definition nothing refers to)
    {"type": "object", "$defs": {"u": {"required": True}}},
    {"type": "object", "$defs": {"u": {"allOf": 5}}},
    {"type": "object", "$defs": {"u": {"required": [{}], "properties": {}}}},
    {"type": "object", "properties": {"x": {"oneOf": [{"type": []}, {"type": "integer"}]}}},
]


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "now"}}],
      "tool_choice": {"type": "function", "function": {"name": "later"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "now", "strict": True, "parameters": BROKEN}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "now"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": 'say "hi"'}}]}, "tools[0].function.name"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "r", "schema": {}}}},
     "response_format.json_schema"),
    *[({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}},
       "response_format.json_schema.schema") for schema in UNENFORCED_SCHEMAS],
])
def test_a_grammar_the_server_cannot_follow_is_a_400_naming_the_field(server, fields, param):
    """Each a 400 naming the field: not JSON schemas, or schemas whose grammar would let through
    output that fails them (UNENFORCED_SCHEMAS: xgrammar ignores those keywords, or follows such a
    oneOf as anyOf), so that an answer always validates."""
    r = httpx.post(f"{server}/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields})
    assert r.status_code == 400 and error_of(r)["param"] == param, r.text


TAGGED = {"type": "object", "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],
                                                  "discriminator": {"propertyName": "kind"}}},
          "required": ["pet"], "$defs": {
              "cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                      "required": ["kind", "lives"]},
              "dog": {"type": "object", "properties": {"kind": {"const": "dog"}, "name": {"type": "string",
                                                                                        "maxLength": 8}},
                      "required": ["kind", "name"]}}}
TYPED = {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 5},
                                                          {"type": "null"}]}}, "required": ["v"]}


@pytest.mark.parametrize("schema", [TAGGED, TYPED], ids=["tagged", "typed"])
def test_a_oneof_whose_alternatives_cannot_both_match_is_followed(server, schema):
    """oneOf as Pydantic writes a tagged union ($refs to alternatives with a const tag), and oneOf of
    different types: accepted, and every sampled answer validates against the schema (exactly one
    alternative matches)."""
    c = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    for seed in range(4):
        reply = c.chat.completions.create(**chat(response_format=fmt, temperature=1.0, seed=seed))
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


SCALARS = [0, 1, 1.0, -0.0, 2.5, 3, 10, "s", "x", "y", "abc", "cat", "dog", True, False, None, [], [1, 1], ["a"]]
CANDIDATES = [*SCALARS, [1, "s"], {"k": 1, "x": 2}, *({name: v} for name in ("k", "x", "v") for v in SCALARS),
              *({"pet": {"kind": kind, extra: v}} for kind in ("cat", "dog") for extra in ("lives", "name")
                for v in (1, "rex"))]


COUNTED = [  # open in JSON Schema (any items, other properties), closed by xgrammar unless said: serve/schemas.opened
    {"type": "array", "minItems": 2},
    {"type": "object", "minProperties": 1},
    {"type": "object", "properties": {"v": {"type": "array", "minItems": 1, "maxItems": 2}}, "required": ["v"]},
]


@pytest.mark.parametrize("schema", [*UNENFORCED_SCHEMAS, TAGGED, TYPED, WEATHER, *COUNTED,
                                    *(random_schema(random.Random(seed)) for seed in range(5))])
def test_a_schema_the_server_accepts_lets_through_only_what_validates(compiler, tokenizer, schema):
    """The server's check (serve/schemas.py) against the two references: for a schema it accepts,
    every candidate value that the grammar lets through (xgrammar's matcher of the test's own)
    validates (jsonschema). UNENFORCED_SCHEMAS are each refused; on them this shows why."""
    from serve.schemas import unenforced

    if unenforced(schema) is not None:
        assert schema in UNENFORCED_SCHEMAS
        return
    assert schema not in UNENFORCED_SCHEMAS, "refused by the server, and the test expects that"
    spec = structural_tag(json_format(schema))
    let_through = [value for value in CANDIDATES if follows(compiler, tokenizer, spec, json.dumps(value))]
    assert all(jsonschema.Draft202012Validator(schema).is_valid(v) for v in let_through), let_through
    if schema in COUNTED:  # and it lets values through that JSON Schema leaves open
        assert any(len(v) > 1 or (isinstance(v, dict) and len(v.get("v", [])) > 1) for v in let_through), let_through


def test_bench_grammar_times_each_variant_of_the_same_walk(capsys):
    """scripts/bench_grammar.py: one line per fill-thread count and repeat, each over the same walk
    (the same steps and rows), with every time measured."""
    load_script("bench_grammar").main(["--shipped", "--rows", "6", "--steps", "8", "--fill-threads", "1", "2",
                                       "--repeats", "2"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["fill_threads"] for line in lines] == [1, 2, 1, 2]
    assert len({(line["steps"], line["live_rows_per_step"]) for line in lines}) == 1
    assert all(line["fill_ms"] > 0 and line["accept_ms"] > 0 and line["tokenizer"] == 4096 for line in lines)


def test_readme_chat_api_example_prints_what_readme_shows(tmp_path):
    """README's examples/chat_api.py against the shipped model served with the example chat
    template: the lines it prints are README's."""
    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"\$ python examples/chat_api.py\n(.*?)```", readme, re.DOTALL).group(1)
    template = ROOT / "examples" / "qwen3-chat-template.jinja"
    with serving(SHIPPED, tmp_path, "--chat-template", str(template)) as served:
        result = subprocess.run([sys.executable, str(ROOT / "examples" / "chat_api.py"), "--url", f"{served.url}/v1"],
                                capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout == shown
