"""Generate text with a Qwen3 checkpoint: python scripts/generate.py --prompt "def fibonacci(n):"

Text streams to stdout as it is produced; prompt tokens, prefill time, decode speed and peak
memory go to stderr. Without --model it uses the small model shipped in weights/.
"""

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from ops import IMPLS  # noqa: E402
from qwen3 import Qwen3ForCausalLM  # noqa: E402
from qwen3.text import TextStream, load_tokenizer, prompt_ids  # noqa: E402

DEFAULT_MODEL = ROOT / "weights" / "qwen3-stdlib-tiny"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", help="prompt text; repeat for a batch")
    p.add_argument("--prompt-file", type=Path, help="a file with one prompt per line (a batch)")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint directory (HF layout)")
    p.add_argument("--norm", choices=IMPLS, default="auto", help="RMSNorm implementation (default: auto)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: generation_config)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=False,
                   help="replay each decode step from a CUDA graph captured once (CUDA only; default: off)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap prompts in the tokenizer's chat template when it has one (default: on)")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True,
                   help="let the model think first (Qwen3's enable_thinking; default: on)")
    args = p.parse_args(argv)
    if args.prompt_file:
        try:
            args.prompt = (args.prompt or []) + [line for line in args.prompt_file.read_text().splitlines() if line]
        except OSError as err:
            p.error(f"cannot read --prompt-file: {err}")
    if not args.prompt:
        p.error("give at least one --prompt (or --prompt-file)")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    return args


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if not args.model.is_dir():
        sys.exit(f"generate.py: error: no model directory at {args.model} (pass --model DIR with a "
                 "Hugging Face Qwen3 checkpoint, or train one with scripts/train_tiny.py)")
    try:
        tokenizer = load_tokenizer(args.model)
        model = Qwen3ForCausalLM.from_pretrained(args.model, dtype=dtype, device=device, norm_impl=args.norm,
                                                 progress=False)
    except (OSError, ValueError, KeyError) as err:
        sys.exit(f"generate.py: error: cannot load {args.model}: {err}")

    rows = [prompt_ids(tokenizer, p, chat=args.chat, thinking=args.thinking) for p in args.prompt]
    config_eos = model.generation_config.get("eos_token_id")
    config_eos = [config_eos] if isinstance(config_eos, int) else list(config_eos or [])
    eos = {tokenizer.eos_token_id, *config_eos} - {None}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    input_ids, attention_mask = left_pad(rows, pad)

    streams = [TextStream(tokenizer) for _ in rows]
    stamps: list[float] = []
    finished = [False] * len(rows)

    def on_token(new: torch.Tensor) -> None:
        stamps.append(time.perf_counter())
        for i, token in enumerate(new.tolist()):
            if finished[i]:
                continue
            finished[i] = token in eos
            piece = streams[i].push(token)
            if len(rows) == 1 and piece:
                sys.stdout.write(piece)
                sys.stdout.flush()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    try:
        model.generate(
            input_ids, max_new_tokens=args.max_new_tokens, attention_mask=attention_mask,
            eos_token_id=sorted(eos) or None, pad_token_id=pad, seed=args.seed, on_token=on_token,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            cuda_graph=args.cuda_graph,
        )
    except ValueError as err:
        sys.exit(f"generate.py: error: {err}")
    if len(rows) == 1:
        sys.stdout.write(streams[0].flush() + "\n")
    else:
        for i, (prompt, stream) in enumerate(zip(args.prompt, streams)):
            sys.stdout.write(f"=== [{i}] {prompt}\n{stream.flush()}\n")
    sys.stdout.flush()

    prefill_ms = (stamps[0] - start) * 1e3
    decode_steps = len(stamps) - 1
    decode_rate = decode_steps / (stamps[-1] - stamps[0]) if decode_steps else float("nan")
    if device.type == "cuda":
        peak = f"{torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB GPU"
    else:
        peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB RSS"
    print(
        f"[{len(rows)} prompt(s), {input_ids.numel()} prompt tokens, prefill {prefill_ms:.1f} ms, "
        f"{decode_steps} decode steps at {decode_rate:.1f} steps/s ({decode_rate * len(rows):.1f} tok/s), "
        f"peak {peak}, {device} {str(dtype).removeprefix('torch.')}, norm {args.norm}]",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
