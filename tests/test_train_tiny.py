"""scripts/train_tiny.py: a short run exports a loadable checkpoint, and a rerun resumes from it
(its main() called in this process, with what it prints)."""

import importlib.util
import json
from pathlib import Path

import torch
from in_process import load_script

from qwen3 import Qwen3ForCausalLM

TRAIN_TINY = load_script("train_tiny")


def train(out: Path, run: Path, steps: int, capsys) -> str:
    TRAIN_TINY.main(["--out", str(out), "--run-dir", str(run), "--steps", str(steps), "--eval-every", "2",
                     "--batch", "2", "--seq", "32", "--norm", "torch", "--device", "cpu", "--max-train-files", "40",
                     "--max-val-tokens", "4096"])
    return capsys.readouterr().out


def test_short_run_exports_and_resumes(tmp_path, capsys):
    out, run = tmp_path / "model", tmp_path / "run"
    first = train(out, run, steps=2, capsys=capsys)
    assert "resumed" not in first
    assert (run / "resume.pt").exists()
    assert (run / "loss.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    second = train(out, run, steps=4, capsys=capsys)
    assert "resumed at step 2" in second
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "val_loss" in r] == [2, 4]  # the first run's log carried over
    model = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32, progress=False)
    assert model.config.num_hidden_layers == 8 and (out / "tokenizer.json").exists()
