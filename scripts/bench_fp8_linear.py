"""The FP8 kernels alone, at Qwen3-8B's projection shapes, against bf16, in one process:

    python scripts/bench_fp8_linear.py [--rows 1 16 64 2048]

Per shape and number of rows, the product as the model's fused path computes it (qwen3/layers.py's
linear): bf16 weights through our GEMV at one row and cuBLAS beyond; FP8 weights (Qwen's
block-scaled format) through the GEMV that dequantizes in registers at one row, the w8a8 skinny
GEMM at 2-64 (activations quantized per 128 columns), and dequantize-then-cuBLAS beyond. Each
line: microseconds per product (median over CUDA-graph replays of 8 products on different
weights, so that none is read from L2 and no launch gap counts), GB/s of weight bytes, that as a
fraction of the measured copy bandwidth, and the FP8 result's relative error against F.linear of
the dequantized weight in fp32 (the w8a8 path's includes the activations' rounding). At one row
also `w8a8`: the skinny GEMM with FP8 activations, as 2-64 rows run (a candidate for one row).
At every number of rows also `cublas`: torch's public F.scaled_mm with the checkpoint's scales as
they are (activations in blocks of 1 x 128, quantized by our kernel, weights 128 x 128: cuBLAS's
DeepSeek-style block-scaled FP8 GEMM, CUDA 12.9+ on Hopper), a candidate for 2-64 rows and the
prefill; a line saying why where this torch or GPU cannot run it.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_generate import copy_bandwidth_GBps

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ops.linear.fp8 import quantize_groups  # noqa: E402
from ops.linear.skinny_gemm import skinny_linear  # noqa: E402
from qwen3.fp8 import dequantize, quantize  # noqa: E402
from qwen3.layers import linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
BLOCK = (128, 128)
COPIES = 8  # weights cycled through: more bytes than the L2 holds


def graph_us(fn) -> float:
    """Microseconds per call of fn(i), i cycling over the COPIES weights, from a CUDA graph of COPIES calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn(0)  # compiles, picks cuBLAS's kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(COPIES):
            fn(i)
    times = []
    for _ in range(21):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / COPIES)
    return sorted(times[1:])[len(times[1:]) // 2]


def block_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 times FP8 weight [N, K] (scales [N / 128, K / 128]) through cuBLAS's block-scaled
    GEMM: x quantized in groups of 128 columns, the product of the blocks accumulated in fp32."""
    q, q_scale = quantize_groups(x, BLOCK[1])
    # cuBLAS takes the activations' scales outer-dimension major: [M, K / 128] with stride (1, M)
    return F.scaled_mm(q, weight.t(), q_scale.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                       scale.t(), F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)


def layer_of(weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.nn.Linear:
    """An nn.Linear holding weight as the model does (an FP8 one with its scales: qwen3/quantized.py)."""
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    if scale is not None:
        layer.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
        layer.weight_block = BLOCK
    return layer


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 2048])
    args = p.parse_args()
    device = torch.device("cuda")
    copy = copy_bandwidth_GBps(device)
    print(f"copy bandwidth {copy:.0f} GB/s")
    for name, (N, K) in SHAPES.items():
        bf16 = [layer_of(torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02) for _ in range(COPIES)]
        fp8 = [layer_of(*quantize(layer.weight, BLOCK)) for layer in bf16]
        for rows in args.rows:
            x = torch.randn(rows, K, device=device, dtype=torch.bfloat16)
            exact = F.linear(x.float(), dequantize(fp8[0].weight, fp8[0].weight_scale_inv, BLOCK, torch.float32))
            error = ((linear(fp8[0], x, True).float() - exact).norm() / exact.norm()).item()

            def w8a8(i):
                return skinny_linear(x, fp8[i].weight, scale=fp8[i].weight_scale_inv, block=BLOCK,
                                     fp8_activations=True)

            variants = [("bf16", lambda i: linear(bf16[i], x, True), 2 * N * K, None),
                        ("fp8", lambda i: linear(fp8[i], x, True), N * K, error)]
            if rows == 1:
                variants.append(("w8a8", w8a8, N * K, ((w8a8(0).float() - exact).norm() / exact.norm()).item()))

            def cublas(i):
                return block_scaled_mm(x, fp8[i].weight, fp8[i].weight_scale_inv)

            try:
                variants.append(("cublas", cublas, N * K, ((cublas(0).float() - exact).norm() / exact.norm()).item()))
            except (RuntimeError, AttributeError, TypeError) as err:  # an older torch, cuBLAS or GPU
                print(f"{name:8} {N:5}x{K:<5} rows {rows:4} cublas: cannot run: {' '.join(str(err).split())[:200]}")
            for label, fn, nbytes, err in variants:
                us = graph_us(fn)
                gbps = nbytes / us / 1e3
                note = f"  rel.err {err:.1e}" if err is not None else ""
                print(f"{name:8} {N:5}x{K:<5} rows {rows:4} {label:5} {us:8.1f} us {gbps:6.0f} GB/s "
                      f"{gbps / copy:5.2f} of copy{note}", flush=True)


if __name__ == "__main__":
    main()
