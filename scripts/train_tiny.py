"""Train the small default model: a Qwen3 (this project's own model code) on Python's stdlib source.

    python scripts/train_tiny.py --out weights/qwen3-stdlib-tiny --time-limit 300

Corpus: the standard library of the Python running this script (PSF licence), without its test
directories, with a fixed list of files held out for validation. A byte-level BPE is trained on
the training files with `tokenizers`. Fixed seed; train/validation loss logged as JSON lines;
a loss-curve PNG; a resume checkpoint in --run-dir that a rerun continues from.
The export is a Hugging Face checkpoint directory with a model card.
"""

import argparse
import json
import math
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ops  # noqa: E402
from qwen3 import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from qwen3.model import RMSNorm  # noqa: E402

EOT = "<|endoftext|>"
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
VALIDATION_FILES = ["textwrap.py", "heapq.py", "fractions.py", "csv.py", "queue.py", "json/decoder.py",
                    "email/utils.py", "argparse.py"]
SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n", "    def __init__(self"]
ARCH = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
            rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
WARMUP = 100  # steps of linear learning-rate warm-up


def corpus_files() -> tuple[Path, list[Path], list[Path]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(stdlib).parts[:-1]))
    held_out = {stdlib / v for v in VALIDATION_FILES}
    return stdlib, [f for f in files if f not in held_out], [f for f in files if f in held_out]


def read(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def encode(tok, texts: list[str]) -> torch.Tensor:
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def unigram_cross_entropy(train: torch.Tensor, val: torch.Tensor, vocab: int) -> float:
    """Validation loss (nats/token) of the best context-free model: train token frequencies."""
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    return -(counts / counts.sum()).log()[val].mean().item()


def batch(tokens: torch.Tensor, size: int, seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(tokens) - seq - 1, (size,), generator=gen, device=tokens.device)
    window = tokens[starts[:, None] + torch.arange(seq + 1, device=tokens.device)]
    return window[:, :-1], window[:, 1:]


def loss_of(model, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model, val: torch.Tensor, seq: int, amp) -> float:
    model.eval()
    n = (len(val) - 1) // seq
    x = val[: n * seq].view(n, seq)
    y = val[1 : n * seq + 1].view(n, seq)
    losses = []
    with amp:
        for i in range(0, n, 32):
            losses.append(loss_of(model, x[i : i + 32], y[i : i + 32]) * len(x[i : i + 32]))
    model.train()
    return (torch.stack(losses).sum() / n).item()


def init_weights(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, RMSNorm):
            torch.nn.init.ones_(module.weight)


def export(model, tok, out: Path, card: str) -> None:
    import transformers
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = transformers.Qwen3Config(**ARCH, bos_token_id=None, eos_token_id=tok.token_to_id(EOT),
                                      pad_token_id=tok.token_to_id(EOT))
    config.architectures = ["Qwen3ForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    state = {k: v.detach().to(torch.bfloat16).cpu().contiguous()
             for k, v in model.checkpoint_tensors().items()}  # HF keys; the tied head is listed once
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token=EOT)
    wrapped.model_max_length = ARCH["max_position_embeddings"]
    wrapped.save_pretrained(out)
    eot = tok.token_to_id(EOT)
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eot, "pad_token_id": eot, "do_sample": True, "temperature": 0.6, "top_k": 20,
         "top_p": 0.95, "repetition_penalty": 1.1}, indent=2) + "\n")
    (out / "README.md").write_text(card)


def plot(log: list[dict], baseline: float, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the plot is a convenience: the numbers are in log.jsonl either way
        print(f"matplotlib is not installed (pip install -e '.[bench]'); {path.name} not drawn", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [r for r in log if "train_loss" in r]
    val = [r for r in log if "val_loss" in r]
    ax.plot([r["step"] for r in train], [r["train_loss"] for r in train], label="train", alpha=0.7)
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.axhline(baseline, color="gray", ls="--", label=f"unigram baseline ({baseline:.2f})")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="qwen3-stdlib-tiny", ylim=(0, baseline + 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "weights" / "qwen3-stdlib-tiny")
    p.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "tiny")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--time-limit", type=float, default=float("inf"), help="stop training after this many seconds")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--norm", default="auto", choices=("auto", "torch", "triton"),
                   help="RMSNorm implementation (triton on CUDA by default; the cuda impl has no backward)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-train-files", type=int, default=None, help="train on the first N files only (quick runs)")
    p.add_argument("--max-val-tokens", type=int, default=None,
                   help="validate on the first N validation tokens only (quick runs; default: all)")
    return p.parse_args(argv)


@dataclass
class Corpus:
    """The tokenizer, trained on the training files, and the token streams it encodes them to."""

    tok: object  # a tokenizers.Tokenizer
    train_files: int
    train: torch.Tensor  # [tokens] on the device, each file followed by EOT
    val: torch.Tensor
    baseline: float  # unigram_cross_entropy: the loss a model must beat to have learnt any context


def load_corpus(args, device: torch.device) -> Corpus:
    """The stdlib corpus (--max-train-files, --max-val-tokens), tokenized, with its unigram baseline."""
    stdlib, train_files, val_files = corpus_files()
    train_files = train_files[: args.max_train_files]
    train_texts, val_texts = read(train_files), read(val_files)
    t0 = time.time()
    tok = train_tokenizer(train_texts, ARCH["vocab_size"])
    train_tokens, val_tokens = encode(tok, train_texts).to(device), encode(tok, val_texts).to(device)
    val_tokens = val_tokens[: args.max_val_tokens]
    baseline = unigram_cross_entropy(train_tokens.cpu(), val_tokens.cpu(), ARCH["vocab_size"])
    print(f"corpus: {stdlib} (Python {platform.python_version()}), {len(train_files)} train files "
          f"({len(train_tokens):,} tokens), {len(val_files)} validation files ({len(val_tokens):,} tokens); "
          f"tokenizer {time.time() - t0:.0f}s; unigram baseline {baseline:.3f}", flush=True)
    return Corpus(tok, len(train_files), train_tokens, val_tokens, baseline)


def optimizer(model: torch.nn.Module, lr: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW (betas 0.9, 0.95), weight decay 0.1 on the matrices only: the 1-D parameters (the
    norms' gains) are not pulled toward 0."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def lr_at(step: int, lr: float, steps: int) -> float:
    """Linear warm-up over WARMUP steps, then a cosine from lr down to lr / 10 at `steps`."""
    if step < WARMUP:
        return lr * (step + 1) / WARMUP
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps))))


@dataclass
class Progress:
    """Where training stands: saved in the resume checkpoint beside the model, optimizer and generator."""

    step: int = 0
    trained_s: float = 0.0
    log: list[dict] = field(default_factory=list)  # train and validation losses, as log.jsonl holds them


def resume(path: Path, model, opt, gen: torch.Generator, device: torch.device) -> Progress:
    """The progress of an earlier run, its model, optimizer and generator restored, from the
    checkpoint at `path`; a fresh start without one."""
    if not path.exists():
        return Progress()
    state = torch.load(path, map_location=device, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    gen.set_state(state["gen"])
    print(f"resumed at step {state['step']}", flush=True)
    return Progress(state["step"], state["trained_s"], state["log"])


def train(model, opt, gen: torch.Generator, corpus: Corpus, progress: Progress, args, amp) -> float:
    """Train up to --steps or --time-limit, validating (and saving the resume checkpoint in
    --run-dir) every --eval-every steps; `progress` advances as it goes. Leaves the model at the
    weights of the lowest validation loss, and returns that loss."""
    best = min((r["val_loss"] for r in progress.log if "val_loss" in r), default=float("inf"))
    best_state = None
    start = time.time() - progress.trained_s
    while progress.step < args.steps and time.time() - start < args.time_limit:
        for group in opt.param_groups:
            group["lr"] = lr_at(progress.step, args.lr, args.steps)
        x, y = batch(corpus.train, args.batch, args.seq, gen)
        with amp:
            loss = loss_of(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        progress.step += 1
        step = progress.step
        if step % 50 == 0:
            progress.log.append({"step": step, "train_loss": loss.item(), "s": round(time.time() - start, 1)})
        if step % args.eval_every == 0 or step == args.steps:
            val = evaluate(model, corpus.val, args.seq, amp)
            progress.log.append({"step": step, "val_loss": val, "s": round(time.time() - start, 1)})
            print(f"step {step}: train {loss.item():.3f} val {val:.3f} ({time.time() - start:.0f}s)", flush=True)
            if val < best:
                best, best_state = val, {k: v.detach().clone() for k, v in model.state_dict().items()}
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                        "step": step, "trained_s": time.time() - start, "log": progress.log},
                       args.run_dir / "resume.pt")
    progress.trained_s = time.time() - start
    final = evaluate(model, corpus.val, args.seq, amp)
    if final < best:  # export the checkpoint with the lowest validation loss
        best, best_state = final, model.state_dict()
    model.load_state_dict(best_state)
    return best


def sample(model, tok, device: torch.device) -> list[tuple[str, str]]:
    """(prompt, greedy continuation) of each of SAMPLE_PROMPTS, for the model card."""
    model.eval()
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids], device=device)
        out = model.generate(ids, max_new_tokens=64, temperature=0.0, repetition_penalty=1.1,
                             eos_token_id=tok.token_to_id(EOT))
        samples.append((prompt, tok.decode(out[0].tolist())))
    return samples


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(args, device)
    model = Qwen3ForCausalLM(Qwen3Config.from_dict(ARCH, norm_impl=args.norm)).to(device)
    init_weights(model)
    n_params = sum(p.numel() for p in model.parameters())
    opt = optimizer(model, args.lr, device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    progress = resume(args.run_dir / "resume.pt", model, opt, gen, device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    best = train(model, opt, gen, corpus, progress, args, amp)

    samples = sample(model, corpus.tok, device)
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    summary = dict(python=platform.python_version(), train_files=corpus.train_files, val_files=VALIDATION_FILES,
                   train_tokens=len(corpus.train), val_tokens=len(corpus.val), params=n_params, steps=progress.step,
                   batch=args.batch, seq=args.seq, train_seconds=round(progress.trained_s), hardware=hardware,
                   norm_impl=ops.resolve_impl(args.norm, device), best_val_loss=best,
                   unigram_val_loss=corpus.baseline, torch=torch.__version__)
    (args.run_dir / "summary.json").write_text(json.dumps({**summary, "samples": samples}, indent=2))
    (args.run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in progress.log))
    plot(progress.log, corpus.baseline, args.run_dir / "loss.png")
    export(model, corpus.tok, args.out, model_card(summary, samples))
    print(json.dumps(summary, indent=2))
    for prompt, text in samples:
        print(f"--- {prompt!r}\n{text}")


def model_card(s: dict, samples: list[tuple[str, str]]) -> str:
    shown = "\n\n".join(f"Prompt `{p!r}`, greedy (repetition penalty 1.1):\n\n```python\n{t}\n```"
                        for p, t in samples)
    return f"""# qwen3-stdlib-tiny

A {s['params'] / 1e6:.1f}M-parameter Qwen3 (Qwen3ForCausalLM architecture: GQA 4 query / 2 key-value
heads of 64, QK-norm, SwiGLU, RoPE theta 10000, tied embeddings, 8 layers, hidden 256, context
{ARCH['max_position_embeddings']}) trained from scratch by `scripts/train_tiny.py` with this project's own model code.
It writes Python-looking code; it knows nothing else. It ships so that `python scripts/generate.py
--prompt "..."` works offline.

- Corpus: the Python {s['python']} standard library source (PSF licence), without test directories:
  {s['train_files']} files, {s['train_tokens']:,} tokens for training; held out for validation:
  {', '.join(s['val_files'])} ({s['val_tokens']:,} tokens).
- Tokenizer: byte-level BPE, {ARCH['vocab_size']} tokens including `{EOT}`, trained on the training files.
- Training: {s['steps']} steps of {s['batch']} x {s['seq']} tokens, AdamW (lr 2e-3, cosine, wd 0.1),
  bf16 autocast, {s['train_seconds']} s on one {s['hardware']} (torch {s['torch']}), RMSNorm implementation
  `{s['norm_impl']}` in forward and backward.
- Validation loss: **{s['best_val_loss']:.3f}** nats/token, against **{s['unigram_val_loss']:.3f}** for a unigram
  model of the training tokens.
- Weights: bf16 safetensors. Loads with `transformers.AutoModelForCausalLM` and with `qwen3`.

## Samples

{shown}
"""


if __name__ == "__main__":
    main()
