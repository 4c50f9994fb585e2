"""scripts/bench_server_loop.py: the HTTP server over its stub engine answers every request, and the
script reports the server process's CPU per generated token."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_server_loop.py"


def test_the_stub_server_answers_every_request_and_its_cpu_per_token_is_reported():
    run = subprocess.run([sys.executable, str(SCRIPT), "--concurrency", "3", "--output", "5", "--step-ms", "2",
                          "--logprobs", "2"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["failed"] == 0
    # 3 clients x 2 requests x 5 tokens, each token a streamed chunk whose usage the client counts
    assert result["total_tok_s"] > 0 and result["server_cpu_s"] > 0
    assert result["server_cpu_us_per_token"] == round(result["server_cpu_s"] / 30 * 1e6, 1)
