"""scripts/bench_tables.py: the docs' tables are computed from the benchmark JSON, not typed."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def record(impl, op, rows, D, gbps, us, dtype="bfloat16"):
    return dict(impl=impl, op=op, dtype=dtype, rows=rows, D=D, GBps=gbps, us=us)


def test_tables_report_ours_against_both_copy_rooflines(tmp_path):
    results = [
        record("triton", "rms_norm", 16384, 4096, 3600.0, 74.6),
        record("copy", "rms_norm", 16384, 4096, 3800.0, 70.6),
        record("triton", "rms_norm", 512, 1024, 40.0, 26.2, dtype="float16"),
        record("F.rms_norm", "rms_norm", 512, 1024, 70.0, 15.0, dtype="float16"),
        record("triton", "fwd_bwd", 16384, 4096, 2000.0, 322.0),
        record("triton+graph", "fwd_bwd", 16384, 4096, 3000.0, 175.0),
    ]
    data = dict(copy_GBps=4000.0, date="2026-01-01", commit="abc1234", versions={}, results=results)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_tables.py"), str(path)],
                         capture_output=True, text=True, check=True).stdout
    # 3600 GB/s is 94.7% of the same-bytes copy (3800): one decimal, so that a miss of the 95%
    # target is not rounded up to it. And 90% of the peak (4000).
    assert "| rms_norm | bf16 | 16384 x 4096 | 3600 | - | - | - | - | - | 3800 | 94.7% | 90% |" in out
    assert "| fp16 | 1024 | 26.2 | - | 15.0 |" in out
    # Roofline: 5 bf16 passes over 16384 x 4096 at 4000 GB/s = 168 us; ours 322 eager, 175 graph.
    assert "| 16384 x 4096 | 322 | 175 |" in out and out.rstrip().endswith("| 168 | 52% / 96% |")


def test_headline_puts_ours_share_of_the_copy_beside_the_anchors(tmp_path):
    results = [
        record("triton", "rms_norm", 16384, 4096, 3600.0, 74.6),
        record("copy", "rms_norm", 16384, 4096, 3800.0, 70.6),
        record("F.rms_norm", "rms_norm", 16384, 4096, 3100.0, 86.6),
        record("triton", "rms_norm", 512, 1024, 40.0, 26.2),
        record("F.rms_norm", "rms_norm", 512, 1024, 70.0, 15.0),
        record("triton", "fwd_bwd", 16384, 4096, 2000.0, 322.0),
        record("triton+graph", "fwd_bwd", 16384, 4096, 3000.0, 175.0),
    ]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(dict(copy_GBps=4000.0, date="2026-01-01", commit="abc1234", versions={},
                                    results=results)))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_tables.py"), "--headline", str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert "| 16384 x 4096 | 3600 (94.7%) | 3100 | - | - | - |" in out
    assert "| 512 x 1024, us per call | 26.2 | 15.0 | - | - | - |" in out
    assert "| fwd+bwd 16384 x 4096, us: eager / CUDA graph | 322 / 175 | - | - | - | - |" in out
