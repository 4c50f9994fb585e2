"""scripts/generate.py end to end, in a subprocess, on a checkpoint and tokenizer made here."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import hf_model, save, save_tokenizer

from qwen3.text import TextStream, load_tokenizer, prompt_ids

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli-model")
    save(hf_model(seed=21), path)
    return save_tokenizer(path)


def run_cli(*args, timeout=300):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_chat_prompt_is_the_tokenizers_chat_template(model_dir):
    tok = load_tokenizer(model_dir)
    messages = [{"role": "user", "content": "Write a loop"}]
    for thinking in (True, False):
        expected = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking,
                                           tokenize=False)
        assert tok.decode(prompt_ids(tok, "Write a loop", chat=True, thinking=thinking)) == expected
    assert "<think>" in tok.decode(prompt_ids(tok, "x", thinking=False))
    assert "<think>" not in tok.decode(prompt_ids(tok, "x", thinking=True))
    assert tok.decode(prompt_ids(tok, "def f():", chat=False)) == "def f():"


def test_stream_never_splits_a_multibyte_character(model_dir):
    tok = load_tokenizer(model_dir)
    text = "naïve café 你好 🙂!"
    stream = TextStream(tok)
    pieces = [stream.push(t) for t in tok(text, add_special_tokens=False)["input_ids"]]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_generates_and_reports_timing(model_dir):
    result = run_cli("--model", str(model_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "12",
                     "--temperature", "0", "--no-chat", "--norm", "triton")
    assert result.returncode == 0, result.stderr
    assert "prompt tokens" in result.stderr and "prefill" in result.stderr and "tok/s" in result.stderr
    greedy = result.stdout
    again = run_cli("--model", str(model_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "12",
                    "--temperature", "0", "--no-chat", "--norm", "torch")
    assert again.stdout == greedy  # the norm switch does not change greedy text
    assert len(greedy.strip()) > 0


def test_batch_of_prompts_and_seeded_sampling(model_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\nfor i in range(3):\n")
    args = ["--model", str(model_dir), "--prompt-file", str(prompts), "--max-new-tokens", "8", "--seed", "7",
            "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--chat", "--no-thinking"]
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert "=== [0] import os" in first.stdout and "=== [1] for i in range(3):" in first.stdout
    assert first.stdout == second.stdout


def test_bad_flags_and_missing_model_are_one_line_errors(tmp_path):
    bad = run_cli("--prompt", "x", "--top-k", "lots")
    assert bad.returncode == 2 and "invalid int value" in bad.stderr
    missing = run_cli("--model", str(tmp_path / "nothing"), "--prompt", "x")
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "no model directory" in missing.stderr
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    broken = run_cli("--model", str(tmp_path / "broken"), "--prompt", "x")
    assert broken.returncode != 0 and "Traceback" not in broken.stderr and "error" in broken.stderr


def test_prompt_longer_than_the_context_is_refused(model_dir):
    result = run_cli("--model", str(model_dir), "--prompt", "x " * 600, "--no-chat")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "exceeds the model's context" in result.stderr


def test_cuda_graph_on_the_cpu_is_refused(model_dir):
    result = run_cli("--model", str(model_dir), "--prompt", "x", "--device", "cpu", "--cuda-graph")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "cuda_graph=True needs the model on a CUDA device" in result.stderr
