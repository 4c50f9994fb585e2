"""scripts/train_tiny.py: a short run exports a loadable checkpoint, and a rerun resumes from it."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

from qwen3 import Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parent.parent


def train(out: Path, run: Path, steps: int) -> str:
    result = subprocess.run(
        [sys.executable, "scripts/train_tiny.py", "--out", str(out), "--run-dir", str(run), "--steps", str(steps),
         "--eval-every", "2", "--batch", "2", "--seq", "32", "--norm", "torch", "--device", "cpu",
         "--max-train-files", "40"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_short_run_exports_and_resumes(tmp_path):
    out, run = tmp_path / "model", tmp_path / "run"
    first = train(out, run, steps=2)
    assert "resumed" not in first
    assert (run / "resume.pt").exists()
    assert (run / "loss.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    second = train(out, run, steps=4)
    assert "resumed at step 2" in second
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "val_loss" in r] == [2, 4]  # the first run's log carried over
    model = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32, progress=False)
    assert model.config.num_hidden_layers == 8 and (out / "tokenizer.json").exists()
