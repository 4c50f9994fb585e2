"""Launch-config sweep for the Triton RMSNorm kernels on a GPU: rows per program x warps for the
one-pass forward, chunk width x warps for the looped one, and the backward's configs.

Its output is what the heuristics in ops/rmsnorm_triton.py (forward_config, backward_config)
are read from; docs/benchmarks/rmsnorm-notes.md records the runs. Prints a table, writes JSON.
Kernels are timed inside a CUDA graph (do_bench_cudagraph), so the numbers are GPU time alone,
free of the host's launch cost.

    python scripts/sweep_rmsnorm.py --out sweep.json [--quick | --shapes 16384x4096,... [--dtype float32]]
                                    [--general-layout]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ops import rmsnorm_triton as tri  # noqa: E402

FORWARD_SHAPES = [(16384, 1024), (16384, 2048), (16384, 4096), (16384, 8192), (131072, 128),
                  (512, 128), (512, 1024), (512, 4096), (512, 8192)]
QUICK_SHAPES = [(16384, 1024), (16384, 2048), (131072, 128)]
BACKWARD_SHAPES = [(16384, 4096), (4096, 4096), (16384, 8192), (131072, 128)]


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def sweep_forward(dtype, rows, D, residual: bool, contiguous: bool = True):
    x = torch.randn(rows, D, device="cuda", dtype=dtype)
    r = torch.randn_like(x) if residual else x
    w = torch.randn(D, device="cuda", dtype=dtype)
    y, s = torch.empty_like(x), torch.empty_like(x)
    nbytes = x.numel() * x.element_size() * (4 if residual else 2)
    block_d = triton.next_power_of_2(D)
    results = []
    for block_rows in (1, 2, 4, 8, 16, 32, 64, 128):
        tile = block_rows * block_d  # elements per program: keep it in 1K..16K (or a single row)
        if block_rows > rows or tile > 16384 or (tile < 1024 and block_rows > 1 and block_rows < 64):
            continue
        for warps in (1, 2, 4, 8, 16):
            if warps * 32 * 4 > tile:  # fewer than 4 elements per thread
                continue
            grid = (triton.cdiv(rows, block_rows),)

            def launch():
                tri._launch(tri._forward_one_pass, ("sweep", dtype), grid[0], (x, r, w, y, s, y),
                            (rows, D, 1e-6, rows, 0, D, rows, 0, D),
                            (block_rows, block_d, residual, False, contiguous, D == block_d), warps)

            ms = do_bench_cudagraph(launch, rep=20, return_mode="median")
            results.append(dict(block_rows=block_rows, warps=warps, us=ms * 1e3, GBps=gbps(nbytes, ms)))
    # The looped two-pass kernel (second pass re-reads the row from L2), block_rows 0 in the results.
    for looped_d in (1024, 2048, 4096):
        if looped_d > block_d:  # a chunk wider than the row is the one-pass kernel's job
            continue
        for warps in (4, 8, 16):

            def launch():
                tri._launch(tri._forward_looped, ("sweep", dtype), rows, (x, r, w, y, s, y),
                            (rows, 1e-6, rows, 0, D, rows, 0, D), (D, looped_d, residual, False), warps)

            ms = do_bench_cudagraph(launch, rep=20, return_mode="median")
            results.append(dict(block_rows=0, looped_block_d=looped_d, warps=warps, us=ms * 1e3,
                                GBps=gbps(nbytes, ms)))
    return sorted(results, key=lambda r: -r["GBps"])


def sweep_backward(dtype, rows, D):
    x = torch.randn(rows, D, device="cuda", dtype=dtype)
    w = torch.randn(D, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    rstd = torch.rand(rows, device="cuda")
    block_d = triton.next_power_of_2(D)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nbytes = x.numel() * x.element_size() * 4  # x read twice (fwd+bwd), dy read, dx written
    results = []
    for block_rows in (1, 2, 4, 8, 16, 32):
        if block_rows * block_d > 16384 or (block_rows * block_d < 2048 and block_rows < 32):
            continue
        for warps in (4, 8, 16):
            for per_sm in (1, 2, 4):
                programs = min(per_sm * sms, triton.cdiv(rows, block_rows))
                rpp = triton.cdiv(triton.cdiv(rows, programs), block_rows) * block_rows
                programs = triton.cdiv(rows, rpp)
                partial = torch.empty(programs, D, device="cuda")

                def launch():
                    tri._launch(tri._backward, ("sweep",), programs, (dy, x, w, rstd, dy, dx, partial),
                                (rows, D, rpp, rows, 0, D), (block_rows, block_d, False, True), warps)
                    tri._launch(tri._sum_partials, ("sweep",), triton.cdiv(D, tri.SUM_BLOCK_D), (partial, dw),
                                (programs, D), (tri.SUM_BLOCK_ROWS, tri.SUM_BLOCK_D), 4)

                ms = do_bench_cudagraph(launch, rep=20, return_mode="median")
                results.append(dict(block_rows=block_rows, warps=warps, per_sm=per_sm, us=ms * 1e3,
                                    GBps=gbps(nbytes, ms)))
    return sorted(results, key=lambda r: -r["GBps"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="bf16 only, the shapes where configs still matter")
    p.add_argument("--shapes", help="the forward only, on these ROWSxD shapes (comma-separated)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="the dtype of --shapes")
    p.add_argument("--general-layout", action="store_true",
                   help="address rows through the strided-layout path (CONTIGUOUS=False), to compare the two")
    args = p.parse_args()
    if args.shapes:
        forward_shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    else:
        forward_shapes = QUICK_SHAPES if args.quick else FORWARD_SHAPES
    contiguous = not args.general_layout
    src = torch.empty(2**28, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy = gbps(2 * src.numel() * 2, do_bench(lambda: dst.copy_(src), return_mode="median"))
    out = {"copy_GBps": copy, "forward": [], "backward": []}
    print(f"copy {copy:.0f} GB/s")
    for residual in (False, True):
        dtypes = (getattr(torch, args.dtype),) if args.shapes else (torch.bfloat16,) if args.quick else \
            (torch.bfloat16, torch.float32)
        for dtype in dtypes:
            for rows, D in forward_shapes:
                if dtype == torch.float32 and not args.shapes and (rows == 512 or residual or D < 4096):
                    continue
                res = sweep_forward(dtype, rows, D, residual, contiguous)
                best = res[0]
                table_d, table_rows, table_warps = tri.forward_config(D, torch.finfo(dtype).bits // 8, residual)
                table = next((r for r in res if (r["block_rows"], r["warps"]) == (table_rows, table_warps)
                              and r.get("looped_block_d", table_d) == table_d), None)
                out["forward"].append(dict(dtype=str(dtype), rows=rows, D=D, residual=residual, contiguous=contiguous,
                                           top=res[:5]))
                kernel = f"looped BLOCK_D={best['looped_block_d']}" if "looped_block_d" in best else \
                    f"rows={best['block_rows']}"
                print(f"fwd{'+add' if residual else ''} {str(dtype)[6:]:9} {rows}x{D}: best {kernel}"
                      f" warps={best['warps']} {best['GBps']:.0f} GB/s {best['us']:.1f} us;"
                      f" table's rows={table_rows} warps={table_warps} {table['us'] if table else float('nan'):.1f} us")
    for rows, D in [] if args.shapes else BACKWARD_SHAPES[::3] if args.quick else BACKWARD_SHAPES:
        res = sweep_backward(torch.bfloat16, rows, D)
        best = res[0]
        out["backward"].append(dict(dtype="bfloat16", rows=rows, D=D, top=res[:5]))
        print(f"bwd {rows}x{D}: best rows={best['block_rows']} warps={best['warps']} per_sm={best['per_sm']}"
              f" {best['us']:.1f} us")
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
