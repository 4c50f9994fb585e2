"""A chat reply's reasoning apart from its answer (message.reasoning_content, delta.reasoning_content),
through the real server and the official `openai` client.

The checkpoint is made to say a chosen reply: one layer whose attention and MLP add nothing, so each
position's hidden state is its token's embedding, and an LM head that maps each token of the reply
to the next one (`scripted_checkpoint`). So the parser sees real <think> and </think> tokens from the
engine, greedy, whatever the batch. Its tokenizer is the shipped one with Qwen3's think tags (and
"\\n\\n", so that a prompt whose template closed an empty think block ends in a token of its own)."""

from pathlib import Path

import openai
import pytest
import torch
import transformers
from servers import REQUEST_TIMEOUT_S, SHIPPED, load_serve_py, serving

from runtime.text import load_tokenizer

THINKING, ANSWER = "Let me add them.", "The sum is 5"
# Qwen3's template (its newlines kept), and what the thinking-only (2507) templates do: open the think
# block in the prompt (think_opened).
TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- if think_opened is defined and think_opened %}{{- '<think>' }}{%- endif %}"
    "{%- endif %}"
)


def scripted_checkpoint(path: Path) -> Path:
    """A checkpoint whose greedy reply to a chat prompt is <think>THINKING</think>ANSWER, then EOS
    (ANSWER alone after a prompt that closed the think block; THINKING</think>ANSWER after one that
    opened it)."""
    tok = load_tokenizer(SHIPPED)
    tok.add_tokens(["<think>", "</think>", "\n\n"])
    tok.chat_template = TEMPLATE
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    think, close, blank, newline = ids("<think>") + ids("</think>") + ids("\n\n") + ids("\n")
    thinking, answer = ids(THINKING), ids(ANSWER)
    reply = [think, *thinking, close, *answer]
    assert len(set(reply)) == len(reply) and newline not in reply and blank not in reply  # a chain of distinct tokens
    successor = dict(zip([newline, *reply], [*reply, tok.eos_token_id]))
    successor[blank] = answer[0]  # after "</think>\n\n" in the prompt: the answer

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
    (None where no delta had that field)."""
    c = client(url)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    extra = {"chat_template_kwargs": kwargs} if kwargs else None
    if not stream:
        done = c.chat.completions.create(model=c.models.list().data[0].id, messages=messages, max_tokens=max_tokens,
                                         temperature=0, extra_body=extra)
        message = done.choices[0].message
        return getattr(message, "reasoning_content", None), message.content, done.choices[0].finish_reason
    reasoning, content, reason = None, None, None
    for chunk in c.chat.completions.create(model=c.models.list().data[0].id, messages=messages,
                                           max_tokens=max_tokens, temperature=0, stream=True, extra_body=extra):
        delta = chunk.choices[0].delta
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
    assert reason == "length" and THINKING.startswith(reasoning) and reasoning and not content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_prompt_that_opened_the_think_block_starts_the_reply_in_reasoning(server, stream):
    reasoning, content, _ = ask(server, stream, think_opened=True)
    assert (reasoning, content) == (THINKING, ANSWER)


def test_without_the_parser_the_reasoning_stays_in_content(checkpoint, tmp_path):
    assert load_serve_py().parse_args(["--no-reasoning-parser"]).reasoning is False
    with serving(checkpoint, tmp_path, "--no-reasoning-parser") as served:
        for stream in (False, True):
            assert ask(served.url, stream)[:2] == (None, f"<think>{THINKING}</think>{ANSWER}")
