"""Serving throughput and time to first token under concurrent streaming clients.

    python scripts/bench_serve.py --config 0.6b --concurrency 1 20 64 256 \\
        --json docs/benchmarks/serve-h200.json --plot docs/benchmarks/serve-h200.png

Starts scripts/serve.py on 127.0.0.1 (a free port) with a random-weight checkpoint of the real
Qwen3 architecture (--config; bf16, written to a temporary directory with the shipped tokenizer:
prompts are token ids, so the tokenizer only detokenizes what it can) or with --model DIR, or
measures a server already running at --url. For each concurrency c: c clients, each sending
streaming completions one after another (prompts of random token ids, lengths uniform in
[--prompt-min, --prompt-max]; --output tokens each, ignore_eos) until --requests-per-client
requests each are done, once per sampling setting: --temperature, --top-p, --top-k (the i-th
values together; a single value serves every setting; temperature 0 is greedy), each request
with a seed of its own. total_tok_s = generated tokens (usage) / wall time of the level;
ttft = time from sending a request to its first streamed chunk (its first token's).
Writes {"date", "commit", "gpu", "versions", "results": [{"model", "concurrency", "temperature",
"top_p", "top_k", ("logprobs",) "prompt_tokens", "output_tokens", "total_tok_s", "ttft_ms_p50", "ttft_ms_p99",
"requests", "failed", "server_cores", "engine_cores"}]}. server_cores / engine_cores: CPU time (user +
system, all threads) of serve.py's process and of its engine process over the level, per second
of it: a server_cores near 1 is an event loop that bounds the level (Linux; with a server this
script started).
"""

import argparse
import asyncio
import datetime
import itertools
import json
import multiprocessing
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "weights" / "qwen3-stdlib-tiny"
CLIENT_START_S = 5.0  # with --client-processes: the clients start this long after the level begins
sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", choices=["0.6b", "8b"], help="random weights of this Qwen3 architecture")
    src.add_argument("--model", type=Path, help="a checkpoint directory (default: the shipped model)")
    src.add_argument("--url", help="an already running server (e.g. http://127.0.0.1:8000)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 20, 64, 256])
    p.add_argument("--prompt-min", type=int, default=128)
    p.add_argument("--prompt-max", type=int, default=1024)
    p.add_argument("--output", type=int, default=256, help="generated tokens per request")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="0: greedy")
    p.add_argument("--top-p", type=float, nargs="+", default=[1.0])
    p.add_argument("--top-k", type=int, nargs="+", default=[0])
    p.add_argument("--logprobs", type=int, default=None,
                   help="every request asks for its tokens' log-probabilities and this many top ones")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--vocab", type=int, default=None, help="prompt token ids drawn below this (default: the model's)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--server-args", default="", help="more flags for serve.py, e.g. '--num-blocks 20000'")
    p.add_argument("--client-processes", type=int, default=1,
                   help="processes the clients are spread over (each with its own event loop)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a level may take at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default=None, help="the commit to record (default: git's HEAD, where there is one)")
    p.add_argument("--server-log", type=Path, default=None,
                   help="where the server's output goes (default: a temp file)")
    p.add_argument("--py-spy", type=Path, default=None, metavar="DIR",
                   help="at each level, py-spy records the server's and the engine's processes for 3 s into "
                        "DIR/{server,engine}-cN-SETTING.txt (flame-graph lines; py-spy installed, ptrace allowed)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="a PNG of tok/s and TTFT against concurrency (needs matplotlib)")
    return p.parse_args(argv)


def sampling_settings(args) -> list[dict]:
    """The settings --temperature, --top-p and --top-k list, the i-th values together (a single
    value serves every setting): [{"temperature", "top_p", "top_k"}]."""
    columns = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    n = max(len(values) for values in columns.values())
    if any(len(values) not in (1, n) for values in columns.values()):
        sys.exit(f"--temperature, --top-p and --top-k take one value or {n} each")
    extra = {"logprobs": args.logprobs} if args.logprobs is not None else {}
    return [{**{name: values[i if len(values) > 1 else 0] for name, values in columns.items()}, **extra}
            for i in range(n)]


def random_checkpoint(name: str, directory: Path) -> Path:
    """The real architecture with transformers' random init in bf16, and the shipped tokenizer."""
    import torch
    import transformers
    from bench_generate import CONFIGS

    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIGS[name])).to(torch.bfloat16)
    model.save_pretrained(directory)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED / f, directory / f)
    return directory


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, all its threads (Linux's /proc; 0 where unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The child processes of a process (Linux's /proc)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class CpuMeter:
    """Cores busy in the server's process and in its engine process (its children) over a level's
    own span: a thread reads their CPU times every 50 ms, and `window` takes the readings around
    the span's start and end (the clients' processes start some seconds into a level)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.readings: list[tuple[float, float, float]] = []  # (time.time(), server's, engine's CPU seconds)
        self.done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while not self.done.wait(0.05):
            self.readings.append((time.time(), cpu_seconds(self.pid),
                                  sum(cpu_seconds(c) for c in children(self.pid))))

    def window(self, start: float, end: float) -> dict:
        inside = [r for r in list(self.readings) if start <= r[0] <= end]
        if len(inside) < 2:
            return {}
        (t0, s0, e0), (t1, s1, e1) = inside[0], inside[-1]
        return {"server_cores": round((s1 - s0) / (t1 - t0), 2), "engine_cores": round((e1 - e0) / (t1 - t0), 2)}

    def stop(self) -> None:
        self.done.set()


def py_spy(server_pid: int, directory: Path, label: str, delay_s: float) -> None:
    """py-spy records the server's process and its engine process (its busiest child) for 3 s from
    delay_s on, into DIR/{server,engine}-LABEL.txt (--py-spy); started by a timer thread, so that
    the level goes on meanwhile."""
    directory.mkdir(parents=True, exist_ok=True)
    engine = max(children(server_pid), key=cpu_seconds, default=None)

    def record(name: str, pid: int) -> None:
        with open(directory / f"{name}-{label}.err", "w") as err:
            subprocess.run(["py-spy", "record", "-p", str(pid), "-d", "3", "-r", "250", "-f", "raw", "--nonblocking",
                            "-o", str(directory / f"{name}-{label}.txt")], stdout=subprocess.DEVNULL, stderr=err)

    for name, pid in (("server", server_pid), ("engine", engine)):
        if pid is not None:
            timer = threading.Timer(delay_s, record, (name, pid))
            timer.daemon = True
            timer.start()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, args, max_batch: int, log: Path):
    port = free_port()
    cmd = [sys.executable, str(ROOT / "scripts" / "serve.py"), "--model", str(model_dir), "--port", str(port),
           "--max-batch", str(max_batch), "--max-waiting", str(4 * max_batch), *args.server_args.split()]
    if args.device:
        cmd += ["--device", args.device]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # loading, and capturing a graph per batch bucket
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"serve.py exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(1)
    proc.kill()
    sys.exit(f"serve.py did not start:\n{log.read_text()}")


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: list[int], output: int,
                      sampling: dict, seed: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output, **sampling, "seed": seed, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"ok": False, "error": f"{r.status_code}: {r.text[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ok": ttft is not None, "ttft": ttft, "tokens": tokens}


async def clients(url: str, model: str, concurrency: int, prompts: list[list[int]], output: int, sampling: dict,
                  timeout: float, start_at: float) -> tuple[list[dict], float, float]:
    """(one result per prompt, start, end) of `concurrency` clients taking the prompts one after
    another from wall-clock time start_at on (time.time(): comparable across processes)."""
    await asyncio.sleep(max(0.0, start_at - time.time()))  # every process starts together
    todo = list(range(len(prompts)))
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:

        async def client():
            while todo:
                i = todo.pop()
                try:
                    results.append(await one_request(http, url, model, prompts[i], output, sampling, seed=i))
                except httpx.HTTPError as err:
                    results.append({"ok": False, "error": repr(err)})

        start = time.time()
        await asyncio.wait_for(asyncio.gather(*(client() for _ in range(concurrency))), timeout)
        return results, start, time.time()


def client_process(job: tuple) -> tuple[list[dict], float, float]:
    return asyncio.run(clients(*job))


def level(url: str, model: str, concurrency: int, sampling: dict, args, rng: random.Random, vocab: int,
          meter: CpuMeter | None = None) -> dict:
    """One concurrency level. The clients are spread over --client-processes processes: one Python
    process parsing every streamed chunk of hundreds of streams would measure itself, not the server.
    With a meter: the cores the server's and the engine's processes kept busy over the level's span."""
    n = concurrency * args.requests_per_client
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(args.prompt_min, args.prompt_max))]
               for _ in range(n)]
    procs = max(1, min(args.client_processes, concurrency))
    start_at = time.time() + (CLIENT_START_S if procs > 1 else 0.0)  # after the processes' imports
    # Each process gets requests_per_client prompts for each of its clients, so that no process's
    # clients have more requests each to send than another's, and none ends the level alone.
    clients_in = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    bounds = list(itertools.accumulate((c * args.requests_per_client for c in clients_in), initial=0))
    jobs = [(url, model, clients_in[i], prompts[bounds[i] : bounds[i + 1]], args.output, sampling, args.timeout,
             start_at) for i in range(procs)]
    if procs == 1:
        parts = [client_process(jobs[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(procs) as pool:
            parts = pool.map(client_process, jobs)
    results = [r for part in parts for r in part[0]]
    start, end = min(part[1] for part in parts), max(part[2] for part in parts)
    wall = end - start
    ok = [r for r in results if r["ok"]]
    ttfts = sorted(r["ttft"] * 1e3 for r in ok)

    def pct(q: float) -> float:
        return round(ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))], 2) if ttfts else float("nan")

    failed = [r for r in results if not r["ok"]]
    if failed:
        print(f"  {len(failed)} failed, e.g. {failed[0]['error']}", file=sys.stderr)
    return {"concurrency": concurrency, **sampling, "prompt_tokens": f"{args.prompt_min}-{args.prompt_max}",
            "prompt_tokens_mean": round(sum(map(len, prompts)) / n, 1), "output_tokens": args.output,
            "total_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1), "ttft_ms_p50": pct(0.5),
            "ttft_ms_p99": pct(0.99), "requests": n, "failed": len(failed), "client_processes": procs,
            **(meter.window(start, end) if meter is not None else {})}


def versions() -> dict:
    import fastapi
    import torch
    import triton
    import uvicorn

    found = {"python": sys.version.split()[0], "torch": torch.__version__, "triton": triton.__version__,
             "fastapi": fastapi.__version__, "uvicorn": uvicorn.__version__}
    try:  # uvicorn's event loop when installed (pyproject's dependency on Linux), else asyncio's
        import uvloop

        found["uvloop"] = uvloop.__version__
    except ImportError:
        found["uvloop"] = None
    return found


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    settings = []
    for r in results:
        setting = (r.get("temperature", 0), r.get("top_p", 1), r.get("top_k", 0))
        if setting not in settings:
            settings.append(setting)
    for t, p, k in settings:
        rows = [r for r in results if (r.get("temperature", 0), r.get("top_p", 1), r.get("top_k", 0)) == (t, p, k)]
        c = [r["concurrency"] for r in rows]
        name = "greedy" if t == 0 else f"T {t:g}" + (f", top-p {p:g}" if p < 1 else "") + (f", top-k {k}" if k else "")
        a.plot(c, [r["total_tok_s"] for r in rows], "o-", label=name)
        b.plot(c, [r["ttft_ms_p50"] for r in rows], "o-", label=f"p50, {name}")
        b.plot(c, [r["ttft_ms_p99"] for r in rows], "s--", label=f"p99, {name}")
    a.set(xscale="log", xlabel="concurrent streaming clients", ylabel="generated tok/s (all clients)", title=title)
    a.legend()
    b.set(xscale="log", yscale="log", xlabel="concurrent streaming clients", ylabel="time to first token (ms)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    proc, tmp, meter = None, None, None
    try:
        if args.url:
            url = args.url.rstrip("/")
        else:
            if args.config:
                tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
                model_dir = random_checkpoint(args.config, tmp / f"qwen3-{args.config}")
            else:
                model_dir = args.model or SHIPPED
            log = args.server_log or Path(tempfile.gettempdir()) / f"bench-serve-{os.getpid()}.log"
            proc, url = start_server(model_dir, args, max(args.concurrency), log)
            print(f"server log: {log}", file=sys.stderr)
        info = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        model = info["id"]
        vocab = args.vocab
        if vocab is None:
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(model_dir).vocab_size if not args.url else 1000
        name = f"qwen3-{args.config}" if args.config else model
        settings = sampling_settings(args)
        warm_up = argparse.Namespace(**{**vars(args), "requests_per_client": 1})
        for sampling in settings:  # the first requests of each kind compile and capture what they run
            level(url, model, 1, sampling, warm_up, rng, vocab)
        results = []
        meter = CpuMeter(proc.pid) if proc is not None else None
        for sampling in settings:
            for c in args.concurrency:
                if args.py_spy and proc is not None:  # a second into the level's clients
                    label = f"c{c}-" + "-".join(f"{k}{v}" for k, v in sampling.items())
                    py_spy(proc.pid, args.py_spy, label, 1 + (CLIENT_START_S if args.client_processes > 1 else 0))
                r = {"model": name, **level(url, model, c, sampling, args, rng, vocab, meter)}
                print(json.dumps(r), flush=True)
                results.append(r)
    finally:
        if meter is not None:
            meter.stop()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           cwd=ROOT).stdout.strip()
    doc = {"date": datetime.date.today().isoformat(), "commit": commit, "gpu": gpu_name(),
           "versions": versions(), "results": results}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot:
        plot(results, args.plot, name)


if __name__ == "__main__":
    main()
