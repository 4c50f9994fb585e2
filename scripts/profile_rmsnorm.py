"""Where the time of one Triton RMSNorm call goes, on a GPU: host microseconds per piece, and the
kernels of a forward + backward step.

    python scripts/profile_rmsnorm.py

Host pieces are timed with the GPU kept busy-free (small shape, synchronize at the end), each as
wall-clock per call over many calls: the public op, the launcher alone, Triton's own launch, a
bare torch.empty and F.rms_norm for scale. The fwd+bwd step is profiled with torch.profiler.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rmsnorm import wall_us_per_call as per_call_us  # noqa: E402

import ops  # noqa: E402
from ops import rmsnorm_triton as tri  # noqa: E402


def main() -> None:
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    block_d, block_rows, warps = tri.forward_config(1024, 2)
    args = (x, x, w, y, x, y, 512, 1024, 1e-6, 512, 0, 1024, 512, 0, 1024)
    consts = (block_rows, block_d, False, False)
    programs = 512 // block_rows
    tri._launch(tri._forward_one_pass, programs, args, consts, warps)
    compiled = next(v for k, v in tri._compiled.items() if k[0] is tri._forward_one_pass)
    rows = [
        ("ops.rms_norm(impl='triton')", lambda: ops.rms_norm(x, w, 1e-6, impl="triton")),
        ("rmsnorm_triton.forward", lambda: tri.forward(x, w, 1e-6)),
        ("_launch (cached key + CompiledKernel)", lambda: tri._launch(tri._forward_one_pass, programs, args, consts,
                                                                     warps)),
        ("CompiledKernel[grid](*args) alone", lambda: compiled[(programs, 1, 1)](*args, *consts)),
        ("JITFunction kernel[grid](...)", lambda: tri._forward_one_pass[(programs,)](*args, *consts,
                                                                                    num_warps=warps)),
        ("ops.rms_norm(impl='cuda')", lambda: ops.rms_norm(x, w, 1e-6, impl="cuda")),
        ("torch.empty_like", lambda: torch.empty_like(x)),
        ("F.rms_norm", lambda: F.rms_norm(x, (1024,), w, 1e-6)),
    ]
    print("host us per call, 512 x 1024 bf16")
    for name, fn in rows:
        print(f"  {per_call_us(fn):7.1f}  {name}")

    xb = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wb = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(xb)

    def step():
        xb.grad = wb.grad = None
        ops.rms_norm(xb, wb, 1e-6, impl="triton").backward(dy)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print("fwd+bwd 16384 x 4096 bf16, 10 steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))
    print(f"wall per step: {per_call_us(step, 50):.0f} us")


if __name__ == "__main__":
    main()
