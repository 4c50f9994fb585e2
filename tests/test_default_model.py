"""The model shipped in weights/: it loads in transformers and in ours, they agree, and the
README's first command runs on it."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

from qwen3 import Qwen3ForCausalLM
from runtime.text import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "weights" / "qwen3-stdlib-tiny"


@pytest.fixture(scope="module")
def both():
    theirs = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    ours = Qwen3ForCausalLM.from_pretrained(MODEL, dtype=torch.float32, progress=False)
    return theirs, ours, load_tokenizer(MODEL)


def test_layout_and_size():
    files = {p.name for p in MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md"} <= files
    assert sum(p.stat().st_size for p in MODEL.iterdir()) <= 25 * 2**20


def test_fp32_logits_agree_with_transformers(both):
    theirs, ours, tok = both
    ids = torch.tensor([tok("def fibonacci(n):\n    if n < 2:\n        return n\n")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=LOGITS_FP32_RTOL, atol=LOGITS_FP32_ATOL)


def test_greedy_48_tokens_equal_transformers(both):
    theirs, ours, tok = both
    ids = torch.tensor([tok("import os\n")["input_ids"]])
    expected = theirs.generate(ids, max_new_tokens=48, min_new_tokens=48, do_sample=False,
                               pad_token_id=tok.eos_token_id)
    actual = ours.generate(ids, max_new_tokens=48, temperature=0.0, eos_token_id=[])
    assert torch.equal(actual, expected)


def test_readme_first_command_runs_offline():
    result = subprocess.run(
        [sys.executable, "scripts/generate.py", "--prompt", "def fibonacci(n):", "--max-new-tokens", "24",
         "--seed", "0"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "no text generated"
    assert "decode steps" in result.stderr


def test_readme_greedy_example_prints_what_readme_shows(run_cli):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### The shipped model", 1)[1]
    command, shown = re.search(r"```bash\n(.+?)\n```.*?```text\n(.*?)```", section, re.DOTALL).groups()
    argv = shlex.split(command)
    assert argv[:2] == ["python", "scripts/generate.py"] and "--temperature" in argv
    result = run_cli(*argv[2:])
    assert result.returncode == 0, result.stderr
    assert result.stdout == shown
