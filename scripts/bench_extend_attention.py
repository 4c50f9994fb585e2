"""The paged chunk-attention kernel (ops/attention/extend_attention.py) against torch's SDPA on the same
queries, keys and values, on a GPU: a whole causal prompt of L tokens (one sequence from position 0),
and chunks of C new tokens deep in an L-token sequence (what chunked prefill runs), for each tile
configuration given; Qwen3's attention shapes (0.6B: 16 query heads over 8 key/value heads; 8B: 32
over 8), head_dim 128, bf16, blocks of 16 tokens.

    python scripts/bench_extend_attention.py [--lengths 4096 16384 32768] [--chunk 2048]
        [--configs 64,64,4,2 128,64,8,2 ...]   (rows,keys,warps,stages) [--json OUT]

A configuration is (rows per program: tokens x the heads of a group, keys per step, warps, pipeline
stages); the module's constants are set to it for its runs. SDPA's time is for the whole causal
prompt only (it has no paged chunk form): the kernel's target. TFLOP/s counts the causal half:
4 * H * hd * (keys each query sees), summed.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ops.attention import extend_attention as ea  # noqa: E402

BLOCK_SIZE = 16
HEAD_DIM = 128
SHAPES = {"0.6b": (16, 8), "8b": (32, 8)}
FAST_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def timed(fn, repeats: int = 5) -> float:
    """Median milliseconds of fn() on the GPU (after one warm-up run)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def paged(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[L, K, hd] keys and values as blocks [n, BLOCK_SIZE, K, hd] in a shuffled order (a real
    cache's), and the sequence's block table [1, n]."""
    L = k.shape[0]
    n = -(-L // BLOCK_SIZE)
    table = torch.randperm(n, device=k.device)
    out = []
    for x in (k, v):
        padded = torch.cat([x, x.new_zeros(n * BLOCK_SIZE - L, *x.shape[1:])])
        blocks = torch.empty(n, BLOCK_SIZE, *x.shape[1:], dtype=x.dtype, device=x.device)
        blocks[table] = padded.view(n, BLOCK_SIZE, *x.shape[1:])
        out.append(blocks)
    return out[0], out[1], table[None]


def causal_flops(H: int, q_len: int, seq_len: int) -> float:
    first = seq_len - q_len
    keys = q_len * first + q_len * (q_len + 1) / 2
    return 4 * H * HEAD_DIM * keys


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--chunk", type=int, default=2048, help="new tokens of a chunk deep in the sequence")
    p.add_argument("--models", nargs="+", default=["0.6b", "8b"], choices=list(SHAPES))
    p.add_argument("--configs", nargs="+", default=["64,64,4,2", "64,64,4,3", "128,64,8,2", "128,64,8,3",
                                                     "128,128,8,2", "64,128,4,2", "128,32,4,3", "128,64,4,3"])
    p.add_argument("--json", type=Path)
    p.add_argument("--commit", default=None, help="the commit measured (recorded in the JSON)")
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for model in args.models:
        H, K = SHAPES[model]
        for L in args.lengths:
            q = torch.randn(L, H, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(L, K, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            v = torch.randn(L, K, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            k_blocks, v_blocks, table = paged(k, v)
            scale = HEAD_DIM ** -0.5
            # As transformers' SDPA attention calls it: keys and values repeated for each query head.
            qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, *(y.repeat_interleave(H // K, 1) for y in (k, v))))

            def sdpa():
                with sdpa_kernel(FAST_SDPA):  # never the math fallback: 32k x 32k scores do not fit
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)

            sdpa_ms = timed(sdpa)
            expected = sdpa()[0].transpose(0, 1)
            whole = dict(cu=torch.tensor([0, L], dtype=torch.int32, device="cuda"), q=q)
            C = min(args.chunk, L)
            deep = dict(cu=torch.tensor([0, C], dtype=torch.int32, device="cuda"), q=q[L - C:])
            seq_lens = torch.tensor([L], device="cuda")
            print(f"{model} L={L}: SDPA whole causal {sdpa_ms:.2f} ms "
                  f"({causal_flops(H, L, L) / sdpa_ms / 1e9:.0f} TFLOP/s)", flush=True)
            for config in args.configs:
                ea.ROWS, ea.BLOCK_N, ea.WARPS, ea.STAGES = map(int, config.split(","))
                run = {name: (lambda c=c: ea.extend_attention(c["q"], k_blocks, v_blocks, c["cu"], seq_lens, table,
                                                             scale, max_new_tokens=c["q"].shape[0]))
                       for name, c in (("whole", whole), ("deep", deep))}
                try:
                    error = (run["whole"]() - expected).abs().max().item()
                    ms = {name: timed(fn) for name, fn in run.items()}
                except Exception as err:  # a configuration the GPU cannot hold (shared memory)
                    print(f"  {config}: failed: {type(err).__name__}: {str(err)[:100]}", flush=True)
                    continue
                row = dict(model=model, length=L, config=config, whole_ms=round(ms["whole"], 3),
                           whole_tflops=round(causal_flops(H, L, L) / ms["whole"] / 1e9),
                           deep_chunk=C, deep_ms=round(ms["deep"], 3),
                           deep_tflops=round(causal_flops(H, C, L) / ms["deep"] / 1e9),
                           sdpa_whole_ms=round(sdpa_ms, 3), vs_sdpa=round(ms["whole"] / sdpa_ms, 3),
                           max_abs_error_vs_sdpa=error)
                rows.append(row)
                print(f"  {config}: whole {ms['whole']:.2f} ms ({row['whole_tflops']} TFLOP/s, "
                      f"{row['vs_sdpa']:.2f}x SDPA), chunk of {C} at the end {ms['deep']:.3f} ms "
                      f"({row['deep_tflops']} TFLOP/s), max |err| {error:.3g}", flush=True)
    if args.json:
        run = dict(date=time.strftime("%Y-%m-%d"), commit=args.commit, gpu=torch.cuda.get_device_name(),
                   torch=torch.__version__, triton=triton.__version__, block_size=BLOCK_SIZE, rows=rows)
        args.json.write_text(json.dumps(run, indent=1) + "\n")


if __name__ == "__main__":
    main()
