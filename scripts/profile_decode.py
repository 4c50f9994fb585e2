"""Kernels of one decode step (batch B, one token per row after a P-token prefill): how many, and
where the GPU time goes, from the torch profiler.

    python scripts/profile_decode.py --model 0.6b --batch 1
"""

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_generate import build  # noqa: E402

from qwen3 import KVCache  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.6b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--norm", default="auto")
    args = p.parse_args()
    device = torch.device("cuda")
    _, model = build(args.model, device, torch.bfloat16, args.norm)
    B, P = args.batch, args.prompt
    cache = KVCache.for_model(model, B, P + 8)
    ids = torch.randint(0, model.config.vocab_size, (B, P), device=device)
    positions = torch.arange(P, device=device).expand(B, P)
    with torch.inference_mode():
        model(ids, positions, cache=cache, last_only=True)
        step_ids, step_pos = ids[:, -1:], positions[:, -1:] + 1
        for _ in range(3):
            model(step_ids, step_pos, cache=cache, last_only=True)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            model(step_ids, step_pos, cache=cache, last_only=True)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels)
    by_name = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e.name[:90]][0] += 1
        by_name[e.name[:90]][1] += e.device_time
    print(f"{args.model} batch {B}: {len(kernels)} kernels per step "
          f"({len(kernels) / model.config.num_hidden_layers:.1f} per layer), {total / 1e3:.3f} ms of kernel time")
    for name, (count, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:20]:
        print(f"{us:9.1f} us {count:5d} x  {name}")


if __name__ == "__main__":
    main()
