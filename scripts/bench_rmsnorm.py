"""RMSNorm benchmark on a GPU, side by side in one process (triton.testing.perf_report).

    python scripts/bench_rmsnorm.py --out docs/benchmarks

(a) the blog's shape 2 x 256 x D (D = 128, 1024, 4096, 8192; every dtype): microseconds per call
    on the host's wall clock, the Python wrapper included. These calls move under 10 MB, so they
    measure host cost per call, ours beside F.rms_norm's;
(b) 16384 x D, D = 1024..8192, every dtype; (c) the q/k-norm shape 131072 x 128, every dtype;
(d) fused residual add + norm on (b) and (c) in bf16. (b)-(d) are GPU time per call: each line's
    calls replayed from a CUDA graph, in turn on input sets that together exceed the L2 cache
    several times (each call reads from HBM, as after a flush). Timed eagerly, a call shorter
    than its host cost measures the host: the host cost per call is (a)'s figure;
(e) forward + backward in bf16, eager (do_bench, the L2 flushed before each call) and, for ours
    and F.rms_norm, replayed from a CUDA graph (GPU time without the host's launch cost).
Lines: ours (triton, cuda), F.rms_norm, HF eager, torch.compile(HF), Liger when importable, and
the device-to-device copy of the same bytes (the roofline). At each point every line is timed
in interleaved rounds, on the same inputs. Writes rmsnorm-h200.json (after every part, so that a
run cut short keeps what it measured) and PNGs.

Takes about 4-5 minutes on one H200, most of it compiling (torch.compile per shape, Triton, Liger,
and the CUDA op where this machine has not built it yet); each part prints its seconds.
"""

import argparse
import datetime
import functools
import importlib.metadata
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing as tt

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import ops  # noqa: E402
from ops.norm.rmsnorm_torch import fused_add_rms_norm_torch, rms_norm_torch  # noqa: E402

try:
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
except ImportError:
    LigerRMSNormFunction = LigerFusedAddRMSNormFunction = None

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EPS = 1e-6
RESULTS: list[dict] = []
compiled_norm = torch.compile(rms_norm_torch, dynamic=False)
compiled_fused = torch.compile(fused_add_rms_norm_torch, dynamic=False)
torch._dynamo.config.cache_size_limit = 256


def liger_norm(x, w, eps):  # Liger's "llama" casting mode is HF's cast order
    return LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", True)


def liger_fused(x, r, w, eps):
    return LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama", False)


FORWARD = {
    "triton": lambda x, w: ops.rms_norm(x, w, EPS, impl="triton"),
    "cuda": lambda x, w: ops.rms_norm(x, w, EPS, impl="cuda"),
    "F.rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS),
    "hf_eager": lambda x, w: rms_norm_torch(x, w, EPS),
    "compiled_hf": lambda x, w: compiled_norm(x, w, EPS),
    "liger": lambda x, w: liger_norm(x, w, EPS),
    "copy": lambda x, w: x.clone(),
}
FUSED = {
    "triton": lambda x, r, w: ops.fused_add_rms_norm(x, r, w, EPS, impl="triton"),
    "cuda": lambda x, r, w: ops.fused_add_rms_norm(x, r, w, EPS, impl="cuda"),
    "hf_eager": lambda x, r, w: fused_add_rms_norm_torch(x, r, w, EPS),
    "compiled_hf": lambda x, r, w: compiled_fused(x, r, w, EPS),
    "liger": lambda x, r, w: liger_fused(x, r, w, EPS),
    "copy": lambda x, r, w: (x.clone(), r.clone()),
}


def available(names):
    return [n for n in names if n != "liger" or LigerRMSNormFunction is not None]


def wall_us(fn, calls: int) -> float:
    """Host wall-clock per call over `calls` calls, GPU work overlapped (launch-bound shapes)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def lines_of(op: str, rows: int, D: int, dtype: str, seed: int = 0) -> dict:
    """Every available line of `op` ("rms_norm", "fused_add_rms_norm" or "fwd_bwd") as a call
    without arguments, all on the same fresh inputs (drawn from `seed`)."""
    x, w = inputs(rows, D, DTYPES[dtype], seed)
    if op == "rms_norm":
        return {name: functools.partial(FORWARD[name], x, w) for name in available(list(FORWARD))}
    if op == "fused_add_rms_norm":
        r = torch.randn_like(x)
        return {name: functools.partial(FUSED[name], x, r, w) for name in available(list(FUSED))}
    x.requires_grad_(True)
    w.requires_grad_(True)
    dy = torch.randn_like(x)
    return {name: fwd_bwd_step(BACKWARD[name], x, w, dy) for name in available(list(BACKWARD))}


def in_rounds(lines: dict, rounds: int, time_line) -> dict[str, list]:
    """Each line's time_line(name, fn) in every round, a round timing every line once: the host's
    drift over seconds moves all lines of a round alike, so it does not decide which line leads
    where they are within a few percent."""
    times = {name: [] for name in lines}
    for _ in range(rounds):
        for name, fn in lines.items():
            times[name].append(time_line(name, fn))
    return times


@functools.cache
def interleaved_wall_us(rows: int, D: int, dtype: str, calls: int = 200, rounds: int = 7) -> dict[str, list]:
    """Microseconds per call of every forward line, `calls` calls per round, in interleaved rounds."""
    lines = lines_of("rms_norm", rows, D, dtype)
    for fn in lines.values():
        for _ in range(20):
            fn()
    return in_rounds(lines, rounds, lambda name, fn: wall_us(fn, calls))


def copy_bandwidth() -> float:
    """The roofline: GB/s of a device-to-device clone of 512 MiB of bf16, bytes read + written."""
    src = torch.randn(2**28, device="cuda", dtype=torch.bfloat16)
    return 2 * src.numel() * src.element_size() / (tt.do_bench(src.clone, return_mode="median") * 1e-3) / 1e9


def record(op, impl, dtype, rows, D, nbytes, rounds: list[float]) -> tuple[float, float]:
    """Adds a result: the median round's microseconds and GB/s, and every round's microseconds
    (`us_rounds`), so that a reader can see how far apart two lines' rounds lie. Returns (us, GB/s)."""
    us = statistics.median(rounds)
    gbps = nbytes / (us * 1e-6) / 1e9
    RESULTS.append(dict(op=op, impl=impl, dtype=dtype, rows=rows, D=D, us=round(us, 3), GBps=round(gbps, 1),
                        us_rounds=[round(t, 3) for t in rounds]))
    return us, gbps


def inputs(rows, D, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, D, device="cuda", dtype=dtype, generator=gen)
    return x, torch.randn(D, device="cuda", dtype=dtype, generator=gen)


def forward_benchmark(name, rows, x_vals, dtypes, lines, wall=False):
    return [tt.Benchmark(x_names=["D"], x_vals=x_vals, line_arg="impl", line_vals=lines, line_names=lines,
                         ylabel="us per call" if wall else "GB/s", plot_name=f"{name}-{dt}",
                         args=dict(rows=rows, dtype=dt, wall=wall)) for dt in dtypes]


def bench_forward(D, impl, rows, dtype, wall):
    x_bytes = rows * D * DTYPES[dtype].itemsize
    nbytes = 2 * x_bytes + D * DTYPES[dtype].itemsize
    rounds = interleaved_wall_us(rows, D, dtype) if wall else interleaved_graph_us("rms_norm", rows, D, dtype)
    us, gbps = record("rms_norm", impl, dtype, rows, D, nbytes, rounds[impl])
    return us if wall else gbps


def bench_fused(D, impl, rows, dtype, wall):
    nbytes = 4 * rows * D * DTYPES[dtype].itemsize + D * DTYPES[dtype].itemsize
    rounds = interleaved_graph_us("fused_add_rms_norm", rows, D, dtype)[impl]
    return record("fused_add_rms_norm", impl, dtype, rows, D, nbytes, rounds)[1]


# Input sets a graph cycles through hold at least this many times the L2 cache's bytes, so that a
# set's tensors have left the L2 by its next turn.
L2_MULTIPLE = 4
GRAPH_CALLS = 24


def graph_us(calls: list, n: int = GRAPH_CALLS):
    """A timer of the calls `calls` made in turn, n in all (at least one each), from one CUDA graph:
    each use replays the graph and returns microseconds per call (GPU time alone, without the
    host's launch cost)."""
    n = max(n, len(calls))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles, autotunes and warms the allocator outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            calls[i % len(calls)]()

    def replay() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / n
    return replay


@functools.cache
def interleaved_graph_us(op: str, rows: int, D: int, dtype: str, rounds: int = 5) -> dict[str, list]:
    """GPU microseconds per call of every line of `op` (graph_us), on enough input sets that they
    exceed the L2 cache L2_MULTIPLE times, in interleaved rounds of 5 replays per line."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 * 2**20)
    set_bytes = (2 if op == "fused_add_rms_norm" else 1) * rows * D * DTYPES[dtype].itemsize
    sets = [lines_of(op, rows, D, dtype, seed) for seed in range(max(2, -(-L2_MULTIPLE * l2 // set_bytes)))]
    timers = {name: graph_us([lines[name] for lines in sets]) for name in sets[0]}
    return in_rounds(timers, rounds, lambda name, timer: statistics.median(timer() for _ in range(5)))


BACKWARD = {
    "triton": lambda x, w: ops.rms_norm(x, w, EPS, impl="triton"),
    "F.rms_norm": FORWARD["F.rms_norm"],
    "hf_eager": FORWARD["hf_eager"],
    "compiled_hf": FORWARD["compiled_hf"],
    "liger": FORWARD["liger"],
    # The same steps replayed from a CUDA graph: GPU time alone, without the host's launch cost.
    "triton+graph": lambda x, w: ops.rms_norm(x, w, EPS, impl="triton"),
    "F.rms_norm+graph": FORWARD["F.rms_norm"],
}


def fwd_bwd_step(fn, x, w, dy):
    def step():
        x.grad = w.grad = None
        fn(x, w).backward(dy)
    return step


def do_bench_us(name: str, fn) -> float:
    """Median microseconds of 20 ms of calls: do_bench (L2 flushed before each call), or for a
    "+graph" line do_bench_cudagraph (the calls replayed from a CUDA graph)."""
    if name.endswith("+graph"):
        return tt.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3
    return tt.do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3


@functools.cache
def interleaved_do_bench(op: str, rows: int, D: int, dtype: str, rounds: int = 5) -> dict[str, list]:
    """do_bench medians of every line of `op` on the same inputs, in interleaved rounds of 20 ms
    per line, as for the 512-row lines; returns each line's rounds."""
    return in_rounds(lines_of(op, rows, D, dtype), rounds, do_bench_us)


def bench_fwd_bwd(D, impl, rows, dtype, wall):
    rounds = interleaved_do_bench("fwd_bwd", rows, D, dtype)[impl]
    nbytes = 5 * rows * D * DTYPES[dtype].itemsize  # x twice, y, dy, dx (the roofline count)
    return record("fwd_bwd", impl, dtype, rows, D, nbytes, rounds)[1]


def run(benchmarks, fn, out: Path):
    report = tt.perf_report(benchmarks)(fn)
    report.run(save_path=str(out), print_data=True)


def write_json(out: Path, copy_gbps: float, commit: str) -> None:
    import transformers

    versions = dict(torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
                    python=sys.version.split()[0], gpu=torch.cuda.get_device_name())
    if LigerRMSNormFunction is not None:
        versions["liger_kernel"] = importlib.metadata.version("liger-kernel")
    (out / "rmsnorm-h200.json").write_text(json.dumps(dict(
        copy_GBps=round(copy_gbps, 1), date=datetime.date.today().isoformat(),
        commit=commit, versions=versions, results=RESULTS), indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--skip", nargs="*", default=[], help="parts to skip: a b c d e")
    p.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True, cwd=ROOT).stdout.strip() or "unknown"
    start = time.perf_counter()
    copy_gbps = copy_bandwidth()
    print(f"copy: {copy_gbps:.0f} GB/s")
    fwd_lines = available(["triton", "cuda", "F.rms_norm", "hf_eager", "compiled_hf", "liger", "copy"])
    fused_lines = available(["triton", "cuda", "hf_eager", "compiled_hf", "liger", "copy"])
    bwd_lines = available(list(BACKWARD))

    def part_a():
        run(forward_benchmark("blog-2x256xD-us", 512, [128, 1024, 4096, 8192], list(DTYPES), fwd_lines, wall=True),
            bench_forward, args.out)

    def part_b():
        run(forward_benchmark("rows16384", 16384, [1024, 2048, 4096, 8192], list(DTYPES), fwd_lines),
            bench_forward, args.out)

    def part_c():
        run(forward_benchmark("qknorm-131072", 131072, [128], list(DTYPES), fwd_lines), bench_forward, args.out)

    def part_d():
        for rows, Ds in ((16384, [1024, 2048, 4096, 8192]), (131072, [128])):
            run([tt.Benchmark(x_names=["D"], x_vals=Ds, line_arg="impl", line_vals=fused_lines,
                              line_names=fused_lines, ylabel="GB/s", plot_name=f"fused-add-rows{rows}-bfloat16",
                              args=dict(rows=rows, dtype="bfloat16", wall=False))], bench_fused, args.out)

    def part_e():
        for rows, Ds in ((4096, [4096]), (16384, [4096, 8192]), (131072, [128])):
            run([tt.Benchmark(x_names=["D"], x_vals=Ds, line_arg="impl", line_vals=bwd_lines,
                              line_names=bwd_lines, ylabel="GB/s (5 passes)", plot_name=f"fwd-bwd-rows{rows}-bfloat16",
                              args=dict(rows=rows, dtype="bfloat16", wall=False))], bench_fwd_bwd, args.out)

    for name, part in dict(a=part_a, b=part_b, c=part_c, d=part_d, e=part_e).items():
        if name not in args.skip:
            part_start = time.perf_counter()
            part()
            write_json(args.out, copy_gbps, commit)
            print(f"part {name}: {time.perf_counter() - part_start:.0f} s")
    print(f"total: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
