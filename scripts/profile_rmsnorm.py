"""Where the time of a Triton RMSNorm call goes, on a GPU: host microseconds per piece, a Python
profile of the forward, and a timeline of forward + backward steps.

    python scripts/profile_rmsnorm.py [--trace out/fwd-bwd-trace.json]

Host pieces are timed on a small shape (512 x 1024 bf16, GPU work ~2 us) as wall-clock per call
over many calls: the public op, its validation, the C++ launcher, our Python cached launch,
Triton's C launcher and its full kernel[grid] launch, a bare torch.empty_like and F.rms_norm for
scale; then forward + backward steps, ours (through the C++ autograd node and through the custom
op's Python autograd) against F.rms_norm's, and their parts, and the same steps again with the
backward run on the calling thread instead of autograd's device thread. The large fwd+bwd step is
profiled with torch.profiler.
"""

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rmsnorm import wall_us_per_call as per_call_us  # noqa: E402

import ops  # noqa: E402
from ops import rmsnorm_triton as tri  # noqa: E402


def grad_step(norm, x, w, dy):
    def step():
        x.grad = w.grad = None
        norm(x, w).backward(dy)

    return step


class NoOpFunction(torch.autograd.Function):
    """A Python-defined op that launches nothing: its fwd+bwd step is the autograd engine's fixed
    cost for any autograd.Function, the floor under ours."""

    @staticmethod
    def forward(ctx, x, w):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def host_pieces() -> None:
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    y = torch.empty_like(x)
    block_d, block_rows, warps = tri.forward_config(1024, 2, False)
    tensors, scalars = (x, x, w, y, x, y), (512, 1024, 1e-6, 512, 0, 1024, 512, 0, 1024)
    consts, programs = (block_rows, block_d, False, False, True, True), 512 // block_rows
    key = ("profile",)
    tri._launch(tri._forward_one_pass, key, programs, tensors, scalars, consts, warps)
    (compiled, plan), = [entry for k, entry in tri._compiled.items() if k[-1] == key]
    stream, pointers = torch.cuda.current_stream().cuda_stream, [t.data_ptr() for t in tensors]
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    dy = torch.randn_like(x)
    rstd = tri.forward(x, w, 1e-6, store_rstd=True)[2]
    steps = {
        "ours": grad_step(lambda a, b: ops.rms_norm(a, b, 1e-6, impl="triton"), xg, wg, dy),
        "ours through the custom op": grad_step(lambda a, b: tri.rms_norm_op(a, b, 1e-6)[0], xg, wg, dy),
        "NoOpFunction": grad_step(NoOpFunction.apply, xg, wg, dy),
        "F.rms_norm": grad_step(lambda a, b: F.rms_norm(a, (1024,), b, 1e-6), xg, wg, dy),
    }
    rows = [
        ("ops.rms_norm(impl='triton')", lambda: ops.rms_norm(x, w, 1e-6, impl="triton")),
        ("  ops._check", lambda: ops._check(x, w, 1e-6, "triton")),
        ("  rmsnorm_triton.forward", lambda: tri.forward(x, w, 1e-6)),
        ("  the C++ launcher's forward", lambda: tri._cpp_forward(x, None, w, 1e-6, False)),
        (f"  _launch, cached ({'torch static' if plan else 'Triton C'} launcher)",
         lambda: tri._launch(tri._forward_one_pass, key, programs, tensors, scalars, consts, warps)),
        ("  Triton's C launcher (compiled.run)",
         lambda: compiled.run(programs, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                              *pointers, *scalars, *consts)),
        ("  Triton's kernel[grid](...)", lambda: tri._forward_one_pass[(programs,)](*tensors, *scalars, *consts,
                                                                                   num_warps=warps)),
        ("  torch.empty_like", lambda: torch.empty_like(x)),
        ("ops.rms_norm(impl='cuda')", lambda: ops.rms_norm(x, w, 1e-6, impl="cuda")),
        ("F.rms_norm", lambda: F.rms_norm(x, (1024,), w, 1e-6)),
        ("ops.fused_add_rms_norm(impl='triton')", lambda: ops.fused_add_rms_norm(x, r, w, 1e-6, impl="triton")),
        ("x + r, then F.rms_norm", lambda: F.rms_norm(x + r, (1024,), w, 1e-6)),
        ("fwd+bwd step, ours", steps["ours"]),
        ("  forward with grad (the C++ autograd node)", lambda: ops.rms_norm(xg, wg, 1e-6, impl="triton")),
        ("fwd+bwd step, ours through the custom op (Python)", steps["ours through the custom op"]),
        ("    the custom op with grad", lambda: tri.rms_norm_op(xg, wg, 1e-6)),
        ("    rmsnorm_triton.forward(store_rstd=True)", lambda: tri.forward(x, w, 1e-6, store_rstd=True)),
        ("    NoOpFunction.apply", lambda: NoOpFunction.apply(xg, wg)),
        ("  rmsnorm_triton.backward alone", lambda: tri.backward(dy, x, w, rstd)),
        ("fwd+bwd step, NoOpFunction (the engine's floor)", steps["NoOpFunction"]),
        ("fwd+bwd step, F.rms_norm", steps["F.rms_norm"]),
        ("  forward with grad", lambda: F.rms_norm(xg, (1024,), wg, 1e-6)),
    ]
    print("host us per call, 512 x 1024 bf16")
    for name, fn in rows:
        print(f"  {per_call_us(fn, 400):7.1f}  {name}")
    # A CUDA backward normally runs on the engine's device thread, and .backward() waits for it:
    # a fixed cost per backward call (once per training step), paid by every op alike.
    print("fwd+bwd steps with the backward on the calling thread (autograd.set_multithreading_enabled(False))")
    with torch.autograd.set_multithreading_enabled(False):
        for name, fn in steps.items():
            print(f"  {per_call_us(fn, 400):7.1f}  {name}")

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(3000):
        ops.rms_norm(x, w, 1e-6, impl="triton")
    profile.disable()
    torch.cuda.synchronize()
    print("cProfile of 3000 ops.rms_norm calls (tottime: time inside the function itself)")
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)


def fwd_bwd_timeline(trace: Path | None) -> None:
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    ours = grad_step(lambda a, b: ops.rms_norm(a, b, 1e-6, impl="triton"), x, w, dy)
    theirs = grad_step(lambda a, b: F.rms_norm(a, (4096,), b, 1e-6), x, w, dy)
    for _ in range(5):
        ours()
        theirs()
    torch.cuda.synchronize()
    print(f"fwd+bwd 16384 x 4096 bf16, wall per step: ours {per_call_us(ours, 50):.0f} us, "
          f"F.rms_norm {per_call_us(theirs, 50):.0f} us")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            ours()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=50))
    if trace:
        prof.export_chrome_trace(str(trace))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, help="write the fwd+bwd timeline here (chrome://tracing JSON)")
    args = p.parse_args()
    host_pieces()
    fwd_bwd_timeline(args.trace)


if __name__ == "__main__":
    main()
