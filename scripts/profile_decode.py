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

from runtime import metadata  # noqa: E402
from runtime.cache import PagedKVCache  # noqa: E402
from runtime.generate import BLOCK_SIZE  # noqa: E402


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
    per_row = -(-(P + 8) // BLOCK_SIZE)
    cache = PagedKVCache.for_model(model, B * per_row, BLOCK_SIZE)  # as generate lays it out
    tables = torch.arange(B * per_row, device=device).view(B, per_row)
    ids = torch.randint(0, model.config.vocab_size, (B * P,), device=device)
    positions = metadata.rows_positions(B, P, device)
    cu_seqlens = torch.arange(0, (B + 1) * P, P, dtype=torch.int32, device=device)
    with torch.inference_mode():
        model(ids, positions, metadata.prefill(positions, cu_seqlens, cache, tables, P, rows=P))
        step_ids, step_pos = ids.view(B, P)[:, -1], torch.full((B,), P, device=device)

        def step():
            model(step_ids, step_pos, metadata.decode(step_pos, cache, tables))

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
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
