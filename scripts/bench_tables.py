"""Markdown tables from a bench_rmsnorm.py result, for docs/benchmarks/README.md and README.md.

    python scripts/bench_tables.py docs/benchmarks/rmsnorm-h200.json             # docs/benchmarks' tables
    python scripts/bench_tables.py --headline docs/benchmarks/rmsnorm-h200.json  # README's headline table

Percentages are of the copy roofline two ways: the copy of the same bytes in the same run
("copy" line), and the peak copy bandwidth of a 512 MiB clone (copy_GBps).
"""

import argparse
import json
from pathlib import Path

SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
FORWARD_LINES = ["triton", "cuda", "F.rms_norm", "hf_eager", "compiled_hf", "liger", "copy"]
FWD_BWD_LINES = ["triton", "triton+graph", "F.rms_norm", "F.rms_norm+graph", "hf_eager", "compiled_hf", "liger"]


def row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def header(names) -> str:
    return row(names) + "\n" + row(["---"] * len(names))


def points(results, op, keep_rows=lambda rows: True):
    """{(dtype, rows, D): {impl: record}} for one op and the row counts kept, in the order measured."""
    table: dict[tuple, dict] = {}
    for r in results:
        if r["op"] == op and keep_rows(r["rows"]):
            table.setdefault((r["dtype"], r["rows"], r["D"]), {})[r["impl"]] = r
    return table


def gbps_tables(data) -> str:
    peak = data["copy_GBps"]
    lines = [header(["op", "dtype", "rows x D", *FORWARD_LINES, "ours % of copy", f"ours % of {peak:.0f}"])]
    for op in ("rms_norm", "fused_add_rms_norm"):
        for (dtype, rows, D), by_impl in points(data["results"], op, lambda n: n > 512).items():
            ours, copy = by_impl["triton"]["GBps"], by_impl["copy"]["GBps"]
            cells = [f"{by_impl[i]['GBps']:.0f}" if i in by_impl else "-" for i in FORWARD_LINES]
            name = "fused add + norm" if op != "rms_norm" else "q/k-norm" if D == 128 else "rms_norm"
            lines.append(row([name, SHORT[dtype], f"{rows} x {D}", *cells, f"{ours / copy:.1%}", f"{ours / peak:.0%}"]))
    return "\n".join(lines)


def per_call_table(data) -> str:
    lines = [header(["dtype", "D", *FORWARD_LINES])]
    for (dtype, _, D), by_impl in points(data["results"], "rms_norm", lambda n: n == 512).items():
        lines.append(row([SHORT[dtype], D, *(f"{by_impl[i]['us']:.1f}" if i in by_impl else "-"
                                            for i in FORWARD_LINES)]))
    return "\n".join(lines)


def fwd_bwd_table(data) -> str:
    peak = data["copy_GBps"]
    lines = [header(["rows x D", *FWD_BWD_LINES, "roofline", "ours % (eager / graph)"])]
    for (dtype, rows, D), by_impl in points(data["results"], "fwd_bwd").items():
        floor = 5 * rows * D * BYTES[dtype] / peak / 1e3  # 5 passes at the peak copy bandwidth, us
        eager, graph = by_impl["triton"]["us"], by_impl["triton+graph"]["us"]
        cells = [f"{by_impl[i]['us']:.0f}" if i in by_impl else "-" for i in FWD_BWD_LINES]
        lines.append(row([f"{rows} x {D}", *cells, f"{floor:.0f}", f"{floor / eager:.0%} / {floor / graph:.0%}"]))
    return "\n".join(lines)


HEADLINE_LINES = ["triton", "F.rms_norm", "compiled_hf", "liger", "hf_eager"]


def headline_table(data) -> str:
    """bf16 only: GB/s with ours' share of the same-bytes copy, 512-row us per call, fwd+bwd us."""
    lines = [header(["shape", "ours (triton)", "F.rms_norm", "torch.compile(HF)", "Liger", "HF eager"])]
    results = data["results"]
    for op, name, shapes in (("rms_norm", "", [(16384, 1024), (16384, 4096), (16384, 8192), (131072, 128)]),
                             ("fused_add_rms_norm", "fused add + norm, ", [(16384, 4096), (16384, 8192)])):
        table = points(results, op)
        for rows, D in shapes:
            by_impl = table.get(("bfloat16", rows, D))
            if by_impl:
                share = by_impl["triton"]["GBps"] / by_impl["copy"]["GBps"]
                cells = [f"{by_impl[i]['GBps']:.0f}" if i in by_impl else "-" for i in HEADLINE_LINES]
                cells[0] += f" ({share:.1%})"
                lines.append(row([f"{name}{rows} x {D}", *cells]))
    by_impl = points(results, "rms_norm").get(("bfloat16", 512, 1024))
    if by_impl:
        lines.append(row(["512 x 1024, us per call", *(f"{by_impl[i]['us']:.1f}" if i in by_impl else "-"
                                                      for i in HEADLINE_LINES)]))
    for (_, rows, D), by_impl in points(results, "fwd_bwd").items():
        cells = [f"{by_impl[i]['us']:.0f}" if i in by_impl else "-" for i in HEADLINE_LINES]
        for i, impl in enumerate(HEADLINE_LINES[:2]):
            if f"{impl}+graph" in by_impl:
                cells[i] += f" / {by_impl[impl + '+graph']['us']:.0f}"
        lines.append(row([f"fwd+bwd {rows} x {D}, us: eager / CUDA graph", *cells]))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", type=Path)
    p.add_argument("--headline", action="store_true", help="only README's headline table")
    args = p.parse_args()
    data = json.loads(args.json.read_text())
    print(f"commit {data['commit']}, {data['date']}, copy {data['copy_GBps']} GB/s, {data['versions']}\n")
    if args.headline:
        print(headline_table(data))
        return
    print("GB/s\n\n" + gbps_tables(data) + "\n\nus per call, 512 rows\n\n" + per_call_table(data))
    print("\nfwd+bwd, us per step\n\n" + fwd_bwd_table(data))


if __name__ == "__main__":
    main()
