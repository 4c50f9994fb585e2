"""The HTTP server's own cost per streamed token, without a model: the server of scripts/serve.py
(serve/server.py's app on uvicorn) over a stub engine, on any machine.

    python scripts/bench_server_loop.py --concurrency 64 --output 256 [--logprobs 5]

At hundreds of streams the server's process, one event loop, is what bounds a served level on the
GPU (docs/benchmarks/serve-notes.md); this measures that process alone. The stub engine stands in
for serve/engine_process.py's EngineProcess: every --step-ms it hands each open request one token
("ab", with --logprobs k top log-probabilities), on a thread of its own, as the pipe's receiving
thread does. Clients as scripts/bench_serve.py's (streaming, --client-processes processes, two
requests each). Prints one JSON line: tokens/s, and the server process's CPU time per streamed
token (user + system, from /proc: Linux), the number to compare between two versions of the
server on one machine. Tokens/s is bounded by the stub's pace: concurrency / step.
"""

import argparse
import itertools
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "scripts"))  # after the packages: scripts/serve.py is not the serve package


class StubEngine:
    """The calls of EngineProcess that the server makes, answered without a model: each open
    request gets a token every step_s until its max_tokens."""

    def __init__(self, step_s: float, vocab_size: int = 151936):
        from serve.request import Limits

        self.step_s = step_s
        self.max_batch, self.max_waiting = 1024, 4096
        self.limits = Limits(vocab_size, 40960, 1 << 20, 16)
        self.max_len = self.limits.max_len
        self.generation_config: dict = {}
        self.death = None
        self.open: dict[int, list] = {}  # id -> [request, on_output, tokens made]
        self.lock = threading.Lock()
        self.ids = itertools.count()

    def check(self, request) -> None:
        from serve.request import check_request

        check_request(request, self.limits)

    def submit(self, request, on_output, **_) -> int:
        self.check(request)
        seq_id = next(self.ids)
        with self.lock:
            self.open[seq_id] = [request, on_output, 0]
        return seq_id

    def cancel(self, seq_id: int) -> None:
        with self.lock:
            self.open.pop(seq_id, None)

    def start(self, on_death=None) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        from serve.request import Output

        while True:
            time.sleep(self.step_s)
            with self.lock:
                running = list(self.open.items())
            for seq_id, state in running:
                request, on_output, n = state
                state[2] = n = n + 1
                done = n >= request.max_tokens
                k = request.logprobs
                logprobs = None if k is None else [(-0.5, [(n + j) % 1000 + 100 for j in range(k)],
                                                    [-0.5 - j for j in range(k)])]
                on_output(Output("ab", [100 + n % 1000], "length" if done else None, len(request.prompt_ids), n,
                                 logprobs))
                if done:
                    self.cancel(seq_id)

    async def stats(self, timeout_s: float = 10.0) -> dict:
        with self.lock:
            running = len(self.open)
        return {"free_blocks": 1, "total_blocks": 1, "block_size": 16, "running": running, "waiting": 0}

    def stop(self) -> None:
        pass

    def kill(self) -> None:
        pass


def serve(port: int, step_s: float) -> None:
    """The server process: the app over a stub engine, with the shipped tokenizer."""
    import uvicorn

    from runtime.text import load_tokenizer
    from serve.app import create_app
    from serve.http_server import KEEP_ALIVE_S

    app = create_app(StubEngine(step_s), load_tokenizer(ROOT / "weights" / "qwen3-stdlib-tiny"), "stub")
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--output", type=int, default=256, help="tokens per request")
    p.add_argument("--step-ms", type=float, default=6.6, help="the stub engine's step (H200, 0.6B, 256 rows: 6.6)")
    p.add_argument("--logprobs", type=int, default=None, help="every request asks for this many top log-probabilities")
    p.add_argument("--client-processes", type=int, default=1)
    p.add_argument("--serve", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)  # the server process
    args = p.parse_args()
    if args.serve is not None:
        serve(args.serve, args.step_ms / 1e3)
        return
    import httpx
    from bench_serve import cpu_seconds, free_port, level

    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--step-ms", str(args.step_ms)],
                              cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if server.poll() is not None:
                sys.exit(f"bench_server_loop.py: the stub server exited with {server.returncode}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        load = argparse.Namespace(requests_per_client=2, prompt_min=128, prompt_max=1024, output=args.output,
                                  client_processes=args.client_processes, timeout=600)
        sampling = {"temperature": 0.0, **({"logprobs": args.logprobs} if args.logprobs is not None else {})}
        before = cpu_seconds(server.pid)
        result = level(url, "stub", args.concurrency, sampling, load, random.Random(0), 151936)
        cpu = cpu_seconds(server.pid) - before
    finally:
        server.terminate()
        server.wait(timeout=30)
    tokens = (result["requests"] - result["failed"]) * args.output
    if not tokens:
        sys.exit(f"bench_server_loop.py: every request failed ({result['failed']})")
    print(json.dumps({"concurrency": args.concurrency, "output": args.output, "step_ms": args.step_ms,
                      "logprobs": args.logprobs, "total_tok_s": result["total_tok_s"], "failed": result["failed"],
                      "server_cpu_s": round(cpu, 3), "server_cpu_us_per_token": round(cpu / tokens * 1e6, 1)}))


if __name__ == "__main__":
    main()
