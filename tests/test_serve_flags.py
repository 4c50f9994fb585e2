"""scripts/serve.py's flags and start-up failures: each a user's mistake, answered with one line
and a non-zero exit before anything loads (the server itself: tests/test_server.py)."""

import json
import socket

import pytest
from servers import SHIPPED, load_serve_py


@pytest.mark.parametrize("flags, message", [
    (["--num-blocks", "0"], "serve.py: error: --num-blocks must be >= 1, got 0 (see --help)"),
    (["--threads", "0"], "serve.py: error: --threads must be >= 1, got 0 (see --help)"),
    (["--shutdown-timeout", "-1"], "serve.py: error: --shutdown-timeout must be >= 0, got -1 (see --help)"),
    (["--engine-timeout", "1"], "serve.py: error: --engine-timeout must be > 2 s, got 1 (see --help)"),
    (["--served-model-name", " "],
     "serve.py: error: --served-model-name must not be empty (leave it out for the checkpoint's name) (see --help)"),
    (["--max-batch", "0"], "serve.py: error: --max-batch, --block-size and --prefill-tokens must be >= 1, "
                           "--max-waiting >= 0 (see --help)"),
    (["--prefill-tokens", "0"], "serve.py: error: --max-batch, --block-size and --prefill-tokens must be >= 1, "
                                "--max-waiting >= 0 (see --help)"),
])
def test_a_bad_flag_ends_serve_py_with_one_line(flags, message, capsys):
    """A user's mistake in a flag: one line naming it (status 2), before anything loads."""
    with pytest.raises(SystemExit) as exit:
        load_serve_py().parse_args(flags)
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines() == [message]


def test_a_chat_template_file_replaces_the_tokenizers(tmp_path):
    """--chat-template: the shipped base model gets Qwen3's chat format (examples/): tools in the
    system turn, the think block closed with thinking off, calls after the assistant's text and
    consecutive tool responses in one user turn, as Qwen3's template writes them; a file that is
    missing or does not render ends serve.py with one line naming it."""
    serve = load_serve_py()
    template = SHIPPED.parent.parent / "examples" / "qwen3-chat-template.jinja"
    args = serve.parse_args(["--chat-template", str(template)])
    serve.check_model(args)
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    question = [{"role": "user", "content": "What time is it?"}]
    text = serve.tokenizer_of(args).apply_chat_template(question, tools=[tool], tokenize=False,
                                                        add_generation_prompt=True, enable_thinking=False)
    assert text.startswith("<|im_start|>system\n# Tools\n") and f"<tools>\n{json.dumps(tool)}\n</tools>" in text
    assert text.endswith("<|im_start|>user\nWhat time is it?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "now", "arguments": {}}} for i in range(2)]
    history = question + [{"role": "assistant", "content": "", "tool_calls": calls},
                          {"role": "tool", "tool_call_id": "c0", "content": "9:00"},
                          {"role": "tool", "tool_call_id": "c1", "content": "9:01"}]
    text = serve.tokenizer_of(args).apply_chat_template(history, tools=[tool], tokenize=False)
    call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert text.endswith(f"<|im_start|>assistant\n{call}\n{call}<|im_end|>\n<|im_start|>user\n<tool_response>\n9:00\n"
                         "</tool_response>\n<tool_response>\n9:01\n</tool_response><|im_end|>\n"), text
    (tmp_path / "broken.jinja").write_text("{% for %}")
    for path, says in ((tmp_path / "missing.jinja", "cannot read --chat-template"),
                       (tmp_path / "broken.jinja", "does not render a conversation")):
        args = serve.parse_args(["--chat-template", str(path)])
        serve.check_model(args)
        with pytest.raises(SystemExit) as exit:
            serve.tokenizer_of(args)
        assert says in str(exit.value.code) and "\n" not in str(exit.value.code)


@pytest.mark.parametrize("flags, message", [
    (["--device", "tpu"], "--device: unknown device 'tpu'; expected 'cpu', 'cuda' or 'cuda:N'"),
    (["--device", "cpu", "--cuda-graph"], "--cuda-graph needs a CUDA device, and the model runs on cpu "
                                          "(use --device cuda)"),
    (["--model", str(SHIPPED.parent)], f"--model: no model at {SHIPPED.parent}: it has no config.json (pass --model "
                                       "DIR with a Hugging Face Qwen3 checkpoint, or train one with "
                                       "scripts/train_tiny.py)"),
])
def test_a_flag_naming_no_device_or_no_model_ends_serve_py_with_one_line(flags, message, capsys):
    """As generate.py's: one line, status 2 (a flag's mistake), before anything loads."""
    serve = load_serve_py()
    with pytest.raises(SystemExit) as exit:
        serve.check_model(serve.parse_args(flags))
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"serve.py: error: {message} (see --help)"]


def test_a_port_in_use_ends_serve_py_with_one_line():
    """Another program listens on the port: one line that says so (bind() runs before the engine starts)."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(SystemExit) as exit:
            load_serve_py().bind("127.0.0.1", port)
    assert exit.value.code == f"serve.py: error: port {port} on 127.0.0.1 is in use; pick another with --port"
