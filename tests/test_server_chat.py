"""What a chat reply is taken apart into: reasoning (message.reasoning_content, delta.reasoning_content),
the answer (content) and Qwen3's tool calls (tool_calls), through the real server and the official
`openai` client.

The checkpoint is made to say a chosen reply: one layer whose attention and MLP add nothing, so each
position's hidden state is its token's embedding, and an LM head that maps each token of the reply
to the next one (`scripted_checkpoint`). So the parser sees real <think> and </think> tokens from the
engine, greedy, whatever the batch. Its tokenizer is the shipped one with Qwen3's think tags (and
"\\n\\n", so that a prompt whose template closed an empty think block ends in a token of its own),
and whole replies with tool calls as tokens of their own, which the test's template asks for with
a token at the end of the prompt (chat_template_kwargs {"script": "call"} and so on)."""

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from servers import REQUEST_TIMEOUT_S, SHIPPED, load_serve_py, serving

from runtime.reasoning import ReasoningSplitter
from runtime.text import load_tokenizer
from serve.reply import ReplyParser, call_begin

THINKING, ANSWER = "Let me add them.", "The sum is 5"
# Qwen3's template (its newlines kept), and what the thinking-only (2507) templates do: open the think
# block in the prompt (think_opened).
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' + (tools | tojson) + '</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' + message.content + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.reasoning_content %}{{- '<think>' + message.reasoning_content + '</think>' }}{%- endif %}"
    "{{- message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson)"
    " + '</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- if think_opened is defined and think_opened %}{{- '<think>' }}{%- endif %}"
    "{%- if script is defined %}{{- '<|' + script + '|>' }}{%- endif %}"
    "{%- endif %}"
)
ARGUMENTS = '{"city": "Paris"}'
CALL = '{"name": "get_weather", "arguments": ' + ARGUMENTS + "}"
SCRIPTS = {  # what the prompt's last token makes the model say, token by token
    "call": ["I will check the weather.", f"<tool_call>\n{CALL}\n</tool_call>"],
    "inside": ['<think>Perhaps <tool_call>{"name": "get_weather", "arguments": {}}</tool_call> helps.</think>',
               "No call is needed."],
    "bad": ['<tool_call>{"name": "get_weather", "arguments": {bad json</tool_call>'],
    "unknown": ['<tool_call>{"name": "launch", "arguments": {}}</tool_call>'],
    "json": ["<think>Sum it.</think>", '\n\n{"sum": 5}'],  # the reasoning, then a JSON answer
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def scripted_checkpoint(path: Path) -> Path:
    """A checkpoint whose greedy reply to a chat prompt is <think>THINKING</think>ANSWER, then EOS
    (ANSWER alone after a prompt that closed the think block; THINKING</think>ANSWER after one that
    opened it)."""
    tok = load_tokenizer(SHIPPED)
    tok.add_tokens(["<think>", "</think>", "\n\n"] + [f"<|{name}|>" for name in SCRIPTS]
                   + [piece for pieces in SCRIPTS.values() for piece in pieces])
    tok.chat_template = TEMPLATE
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    think, close, blank, newline = ids("<think>") + ids("</think>") + ids("\n\n") + ids("\n")
    thinking, answer = ids(THINKING), ids(ANSWER)
    reply = [think, *thinking, close, *answer]
    assert len(set(reply)) == len(reply) and newline not in reply and blank not in reply  # a chain of distinct tokens
    successor = dict(zip([newline, *reply], [*reply, tok.eos_token_id]))
    successor[blank] = answer[0]  # after "</think>\n\n" in the prompt: the answer
    for name, pieces in SCRIPTS.items():
        chain = [ids(f"<|{name}|>")[0]] + [ids(piece)[0] for piece in pieces]
        assert all(len(ids(piece)) == 1 for piece in pieces) and not set(chain) & set(successor)
        successor |= dict(zip(chain, chain[1:] + [tok.eos_token_id]))

    config = transformers.Qwen3Config.from_pretrained(SHIPPED)
    config.num_hidden_layers, config.tie_word_embeddings, config.vocab_size = 1, False, len(tok)
    config.layer_types = ["full_attention"]
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).float()
    with torch.no_grad():
        embed = torch.randn(config.vocab_size, config.hidden_size)
        model.model.embed_tokens.weight.copy_(embed)
        for layer in model.model.layers:  # adds nothing to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(config.vocab_size, config.hidden_size)
        for token, nxt in successor.items():
            head[nxt] += 10 * embed[token] / embed[token].norm()
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return scripted_checkpoint(tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    with serving(checkpoint, tmp_path_factory.mktemp("serve")) as served:
        yield served.url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def ask(url: str, stream: bool, max_tokens: int = 64, **kwargs) -> tuple[str | None, str | None, str]:
    """(reasoning_content, content, finish_reason) of a chat reply; streamed, its deltas joined
    (None where no delta had that field), each chunk carrying something."""
    c = client(url)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    extra = {"chat_template_kwargs": kwargs} if kwargs else None
    if not stream:
        done = c.chat.completions.create(model=c.models.list().data[0].id, messages=messages, max_tokens=max_tokens,
                                         temperature=0, extra_body=extra)
        message = done.choices[0].message
        assert getattr(message, "reasoning", None) == getattr(message, "reasoning_content", None)  # both names
        return getattr(message, "reasoning_content", None), message.content, done.choices[0].finish_reason
    reasoning, content, reason = None, None, None
    for chunk in c.chat.completions.create(model=c.models.list().data[0].id, messages=messages,
                                           max_tokens=max_tokens, temperature=0, stream=True, extra_body=extra):
        delta = chunk.choices[0].delta
        assert (delta.role or delta.content or getattr(delta, "reasoning_content", None) or delta.tool_calls
                or chunk.choices[0].finish_reason), chunk  # a chunk of nothing (text held back) is not sent
        assert getattr(delta, "reasoning", None) == getattr(delta, "reasoning_content", None)  # both names
        if getattr(delta, "reasoning_content", None):
            reasoning = (reasoning or "") + delta.reasoning_content
        if delta.content:
            content = (content or "") + delta.content
        reason = chunk.choices[0].finish_reason or reason
    return reasoning, content, reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_reasoning_goes_to_reasoning_content_and_the_answer_to_content(server, stream):
    reasoning, content, reason = ask(server, stream)
    assert (reasoning, content, reason) == (THINKING, ANSWER, "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_with_thinking_off_the_reply_is_all_content(server, stream):
    """The template closes an empty think block in the prompt: what the model says is the answer."""
    reasoning, content, _ = ask(server, stream, enable_thinking=False)
    assert reasoning is None and content == ANSWER


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_reply_cut_before_its_think_block_closes_is_all_reasoning(server, stream):
    reasoning, content, reason = ask(server, stream, max_tokens=4)  # <think>, then 3 of THINKING's tokens
    assert reason == "length" and THINKING.startswith(reasoning) and reasoning and content is None
    assert ask(server, stream, max_tokens=1) == (None, None, "length")  # <think> alone: no answer, none begun


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_prompt_that_opened_the_think_block_starts_the_reply_in_reasoning(server, stream):
    reasoning, content, _ = ask(server, stream, think_opened=True)
    assert (reasoning, content) == (THINKING, ANSWER)


def test_without_the_parser_the_reasoning_stays_in_content(checkpoint, tmp_path):
    assert load_serve_py().parse_args(["--no-reasoning-parser"]).reasoning is False
    with serving(checkpoint, tmp_path, "--no-reasoning-parser") as served:
        for stream in (False, True):
            assert ask(served.url, stream)[:2] == (None, f"<think>{THINKING}</think>{ANSWER}")


def chat(url: str, stream: bool, script: str | None = None, tools=TOOLS, messages=None, **fields):
    """(message as a dict, finish_reason) of a chat reply; streamed, its deltas put together."""
    c = client(url)
    kwargs = dict(model=c.models.list().data[0].id, temperature=0, max_tokens=64, tools=tools,
                  messages=messages or [{"role": "user", "content": "Weather in Paris?"}],
                  extra_body={"chat_template_kwargs": {"script": script}} if script else None, **fields)
    if not stream:
        done = c.chat.completions.create(**kwargs)
        return done.choices[0].message.model_dump(), done.choices[0].finish_reason
    message, reason, calls = {"content": None, "reasoning_content": None}, None, {}
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta.model_dump()
        for key in ("content", "reasoning_content"):
            if delta.get(key):
                message[key] = (message[key] or "") + delta[key]
        for call in delta.get("tool_calls") or []:
            calls[call["index"]] = call
        reason = chunk.choices[0].finish_reason or reason
    message["tool_calls"] = [{k: v for k, v in calls[i].items() if k != "index"} for i in sorted(calls)] or None
    return message, reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_in_the_answer_becomes_tool_calls(server, stream):
    message, reason = chat(server, stream, "call")
    assert reason == "tool_calls" and message["content"] == "I will check the weather."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_inside_the_reasoning_is_reasoning(server, stream):
    message, reason = chat(server, stream, "inside")
    assert reason == "stop" and not message["tool_calls"] and message["content"] == "No call is needed."
    assert message["reasoning_content"] == SCRIPTS["inside"][0].removeprefix("<think>").removesuffix("</think>")


@pytest.mark.parametrize("script", ["bad", "unknown"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_malformed_call_or_one_of_an_unknown_tool_stays_in_content(server, stream, script):
    message, reason = chat(server, stream, script)
    assert reason == "stop" and not message["tool_calls"] and message["content"] == SCRIPTS[script][0]


def test_with_tool_choice_none_or_no_tools_a_call_is_content(server):
    for fields in ({"tool_choice": "none"}, {"tools": openai.NOT_GIVEN}):
        message, reason = chat(server, False, "call", **fields)
        assert reason == "stop" and not message["tool_calls"]
        assert message["content"] == "".join(SCRIPTS["call"])


def test_two_tools_of_one_name_are_a_400_naming_the_second(server):
    """A call names its function: with two of one name it could not say which it meant."""
    r = httpx.post(f"{server}/v1/chat/completions", timeout=REQUEST_TIMEOUT_S, json={
        "messages": [{"role": "user", "content": "Weather?"}], "tools": [TOOLS[0], TOOLS[0]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[1].function.name", r.text


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": "Weather?"}, {"role": "tool", "content": "18C"}], "messages[1].tool_call_id"),
])
def test_a_message_without_what_its_role_needs_is_a_400_naming_it(server, messages, param):
    """As OpenAI: content for every role but the assistant's (whose calls may stand alone), and a
    tool message's tool_call_id."""
    r = httpx.post(f"{server}/v1/chat/completions", timeout=REQUEST_TIMEOUT_S, json={"messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_tool_round_trip_renders_the_call_and_the_result_through_the_template(server):
    """The assistant's call and the tool's answer, sent back in the history, reach the prompt as the
    checkpoint's template writes them (prompt_token_ids: return_token_ids)."""
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
               {"role": "tool", "content": "18C and sunny", "tool_call_id": "call_1"}]
    c = client(server)
    done = c.chat.completions.create(model=c.models.list().data[0].id, messages=history, tools=TOOLS, max_tokens=4,
                                     temperature=0, extra_body={"return_token_ids": True})
    prompt = load_tokenizer(SHIPPED).decode(done.choices[0].prompt_token_ids)
    assert f"<tool_call>{CALL}</tool_call>" in prompt
    assert "<tool_response>18C and sunny</tool_response>" in prompt and '"get_weather"' in prompt.split("</tools>")[0]
    not_an_object = [{"type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}]
    bad = [history[0], {**history[1], "tool_calls": not_an_object}]
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(model=c.models.list().data[0].id, messages=bad, max_tokens=4)
    assert refused.value.body["param"] == "messages[1].tool_calls[0].function.arguments"
    misnamed = [{"type": "function", "id": "c", "function": {"name": 'get "x"', "arguments": "{}"}}]
    with pytest.raises(openai.BadRequestError) as refused:  # a name the template writes into JSON as it is
        c.chat.completions.create(model=c.models.list().data[0].id, max_tokens=4,
                                  messages=[history[0], {**history[1], "tool_calls": misnamed}])
    assert refused.value.body["param"] == "messages[1].tool_calls[0].function.name"
    no_arguments = [{"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]
    done = c.chat.completions.create(model=c.models.list().data[0].id, max_tokens=4, temperature=0,
                                     messages=[history[0], {**history[1], "tool_calls": no_arguments}, history[2]],
                                     extra_body={"return_token_ids": True})  # as some clients send a call of none
    prompt = load_tokenizer(SHIPPED).decode(done.choices[0].prompt_token_ids)
    assert '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>' in prompt
    cut = [{"id": "call_3", "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}}]
    done = c.chat.completions.create(model=c.models.list().data[0].id, max_tokens=4, temperature=0,
                                     messages=[history[0], {**history[1], "tool_calls": cut}, history[2]],
                                     extra_body={"return_token_ids": True})  # a call cut short, as returned
    prompt = load_tokenizer(SHIPPED).decode(done.choices[0].prompt_token_ids)
    assert '<tool_call>{"name": "get_weather", "arguments": "{\\"ci"}</tool_call>' in prompt  # a string: tojson's


def test_a_reply_sent_back_as_clients_send_it_continues_the_conversation(server, checkpoint):
    """What agents do: the reply itself (the client's message object, its model_dump() with every
    field null or not, or a streamed reply's calls gathered with their index) appended to the
    history with the tool's answer: accepted, and the call rendered by the template."""
    c = client(server)
    kwargs = dict(model=c.models.list().data[0].id, tools=TOOLS, temperature=0, max_tokens=4,
                  extra_body={"return_token_ids": True})
    user = {"role": "user", "content": "Weather in Paris?"}
    done = c.chat.completions.create(messages=[user], max_tokens=64, tools=TOOLS, model=kwargs["model"],
                                     temperature=0, extra_body={"chat_template_kwargs": {"script": "call"}})
    reply = done.choices[0].message
    (call,) = reply.tool_calls
    streamed = {"role": "assistant", "content": reply.content, "reasoning_content": None,
                "tool_calls": [{"index": 0, **call.model_dump()}]}
    for sent in (reply, reply.model_dump(), streamed):
        answer = {"role": "tool", "content": "18C", "tool_call_id": call.id}
        again = c.chat.completions.create(messages=[user, sent, answer], **kwargs)
        prompt = load_tokenizer(checkpoint).decode(again.choices[0].prompt_token_ids)  # the reply's own tokens
        assert f"I will check the weather.<tool_call>{CALL}</tool_call>" in prompt, sent


def test_the_reasoning_sent_back_reaches_the_template(server, checkpoint):
    """An assistant message's reasoning_content (or reasoning, its shorter name) in the history is
    handed to the chat template, which decides where to show it (Qwen3's: after the last user
    message, in a tool-calling turn); this test's template always shows it."""
    c = client(server)
    for name in ("reasoning_content", "reasoning"):
        history = [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello", name: "I should greet."},
                   {"role": "user", "content": "Bye"}]
        done = c.chat.completions.create(model=c.models.list().data[0].id, messages=history, max_tokens=4,
                                         temperature=0, extra_body={"return_token_ids": True})
        prompt = load_tokenizer(checkpoint).decode(done.choices[0].prompt_token_ids)  # its think tags
        assert "assistant\n<think>I should greet.</think>Hello" in prompt, name


def test_messages_as_agent_frameworks_send_them_reach_the_template(server, checkpoint):
    """A developer message is a system message (Qwen3's templates render no developer role); a
    message's name is accepted (LlamaIndex and AutoGen send it); text parts are kept apart."""
    c = client(server)
    history = [{"role": "developer", "content": "Answer in French."},
               {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Hi"},
                                                           {"type": "text", "text": "there"}]}]
    done = c.chat.completions.create(model=c.models.list().data[0].id, messages=history, max_tokens=4,
                                     temperature=0, extra_body={"return_token_ids": True})
    prompt = load_tokenizer(checkpoint).decode(done.choices[0].prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>")


def test_a_prompt_that_fills_the_context_is_a_400_naming_messages(server):
    long = " ".join(["word"] * 3000)
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]},
                   timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_chat_template_kwargs_set_template_variables_not_the_servers_arguments(server):
    """The server's own variables, a variable the template never reads (it would be silently
    ignored) and a non-boolean enable_thinking ("false" is a true string to the template) are 400s
    naming the key."""
    server_sets = "the server sets it"
    cases = [("add_generation_prompt", False, server_sets), ("chat_template", "{{ 1 / 0 }}", server_sets),
             ("tools", [], server_sets), ("messages", [], server_sets), ("bogus", 1, "no variable 'bogus'"),
             ("enable_thinking", "false", "must be true or false")]
    for key, value, says in cases:
        r = httpx.post(f"{server}/v1/chat/completions", timeout=REQUEST_TIMEOUT_S, json={
            "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {key: value}})
        assert r.status_code == 400 and r.json()["error"]["param"] == f"chat_template_kwargs.{key}", r.text
        assert says in r.json()["error"]["message"], r.text


def test_n_chat_choices_each_take_their_reply_apart(server):
    """n 2, streamed and not: each choice has the reasoning, the answer and the tool call apart."""
    c = client(server)
    kwargs = dict(model=c.models.list().data[0].id, messages=[{"role": "user", "content": "Weather?"}],
                  temperature=0, max_tokens=64, n=2, tools=TOOLS,
                  extra_body={"chat_template_kwargs": {"script": "call"}})
    whole = c.chat.completions.create(**kwargs).choices
    assert [(ch.index, ch.message.content, ch.finish_reason) for ch in whole] == [
        (i, "I will check the weather.", "tool_calls") for i in range(2)]
    content, calls = ["", ""], [[], []]
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            content[ch.index] += ch.delta.content or ""
            calls[ch.index] += [call.function.name for call in ch.delta.tool_calls or []]
    assert content == ["I will check the weather."] * 2 and calls == [["get_weather"]] * 2


SUM = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_answer_may_follow_the_reasoning_block(server, stream):
    """response_format with thinking on: the grammar takes the model's reasoning block, then the
    JSON of the schema (serve/constraints.py); the reasoning and the answer land apart."""
    c = client(server)
    fields = dict(model=c.models.list().data[0].id, messages=[{"role": "user", "content": "What is 2 + 3?"}],
                  max_tokens=16, temperature=0, extra_body={"chat_template_kwargs": {"script": "json"}},
                  response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": SUM}})
    if not stream:
        message = c.chat.completions.create(**fields).choices[0].message
        reasoning, content = message.reasoning_content, message.content
    else:
        deltas = [ch.choices[0].delta for ch in c.chat.completions.create(stream=True, **fields)]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    assert reasoning == "Sum it." and json.loads(content) == {"sum": 5}


def test_a_reply_cut_anywhere_gives_the_same_parts():
    """Reasoning with a call in it, text, two calls (one of a known tool, one not), a malformed one:
    streamed in two pieces cut at every place, the deltas add up to what the whole reply gives."""
    known = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    reply = (f"<think>\nMaybe <tool_call>{known}</tool_call> later.\n</think>\n\nSure.\n<tool_call>\n{known}\n"
             '</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n<tool_call>{bad</tool_call>\n')

    def parse(pieces):
        parser = ReplyParser(ReasoningSplitter(), {"get_weather"})
        reasoning, content, calls = "", "", []
        for i, piece in enumerate(pieces):
            delta = parser.feed(piece, final=i == len(pieces) - 1)
            reasoning, content = reasoning + delta.reasoning, content + delta.content
            calls += [(call.index, call.name, call.arguments) for call in delta.calls]
        return reasoning, content, calls

    whole = parse([reply])
    assert whole == (f"Maybe <tool_call>{known}</tool_call> later.",
                     'Sure.\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n<tool_call>{bad</tool_call>',
                     [(0, "get_weather", '{"city": "Paris"}')])
    for cut in range(1, len(reply)):
        assert parse([reply[:cut], reply[cut:]]) == whole, cut


def test_a_forced_call_streams_its_arguments_and_keeps_them_when_cut():
    """Where the grammar writes the calls: a call is a call from its name on, its arguments arrive
    as they come, and the reply cut anywhere (max_tokens) keeps what it has: streamed in two pieces
    cut at every place, the pieces joined by index give the whole reply's calls; cut at every
    place, a call has the arguments written so far, and Qwen3's markup is never content."""
    arguments = '{"city": "Paris", "days": [1, 2]}'
    reply = (f'<think>\nWeather.\n</think>\n\n<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n'
             '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')

    def parse(pieces):
        parser = ReplyParser(ReasoningSplitter(), {"get_weather", "now"}, forced="required")
        reasoning, content, calls = "", "", {}
        for i, piece in enumerate(pieces):
            delta = parser.feed(piece, final=i == len(pieces) - 1)
            reasoning, content = reasoning + delta.reasoning, content + delta.content
            for call in delta.calls:
                if call.name is not None:
                    assert call.index not in calls and call.id.startswith("call_")
                    calls[call.index] = [call.name, ""]
                calls[call.index][1] += call.arguments
        return reasoning, content, [tuple(calls[i]) for i in sorted(calls)]

    whole = parse([reply])
    assert whole == ("Weather.", "", [("get_weather", arguments), ("now", "{}")])
    for cut in range(1, len(reply)):
        assert parse([reply[:cut], reply[cut:]]) == whole, cut
    for cut in range(len("<think>"), len(reply)):  # <think> is one token of Qwen3's: never cut inside
        reasoning, content, calls = parse([reply[:cut]])
        assert content == "" and all(arguments.startswith(a) or a == "{}" for _, a in calls), cut
    start = reply.index(arguments)
    for cut in range(start, start + len(arguments)):
        assert parse([reply[:cut]])[2] == [("get_weather", reply[start:cut])], cut
    # Text may end in what could begin a call where the reply may be text ("auto"): it is text
    # until a <tool_call> is written; where it is calls only, a call's beginning is markup.
    for end, auto in (("a <", "a <"), ("a <tool_c", "a <tool_c"), ("a <tool_call>\n{", "a ")):
        assert ReplyParser(None, {"get_weather"}, forced="auto").feed(end, final=True).content == auto
    for end in ("<", "<tool_c", "<tool_call>\n{"):
        assert ReplyParser(None, {"get_weather"}, forced="required").feed(end, final=True).content == ""
    # Cut right after the arguments' own last brace (a stop string at the call's end): the call is whole.
    for end, whole in (('{"city": "Paris"}', True), ('{"city": "Paris"}}', True), ('{"city": "Par', False)):
        parser = ReplyParser(None, {"get_weather"}, forced="required")
        (call,) = parser.feed(call_begin("get_weather") + end, final=True).calls
        assert call.arguments == '{"city": "Paris"}' if whole else call.arguments == end
        assert parser.finishes_with_calls() is whole


def test_the_example_template_writes_a_history_call_as_qwen3s_does():
    """examples/qwen3-chat-template.jinja: a call's arguments as an object through tojson, as a string
    (a call cut short, sent back) as it is, as Qwen3's own template does."""
    tok = load_tokenizer(SHIPPED)
    tok.chat_template = (Path(__file__).resolve().parent.parent / "examples" / "qwen3-chat-template.jinja").read_text()

    def rendered(arguments) -> str:
        call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        return tok.apply_chat_template([{"role": "user", "content": "Weather?"},
                                        {"role": "assistant", "content": "", "tool_calls": [call]}], tokenize=False)

    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered(
        {"city": "Paris"})
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"ci}\n</tool_call>' in rendered('{"ci')
