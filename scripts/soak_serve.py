"""Soak the server: many clients for minutes with a mix of requests, then check that nothing was lost
or leaked.

    python scripts/soak_serve.py --minutes 10 --clients 32

Starts scripts/serve.py (the shipped model unless --model, the CPU unless --device) on a free port,
with a queue bound below the clients' number so that bursts meet 429s, and runs --clients clients
that each send one request after another for --minutes, each of a kind drawn at random:
    stream        a streamed completion, read to its end ([DONE] after a finish reason)
    complete      a completion, not streamed
    same          a completion of one fixed prompt, greedy or sampled with a fixed seed (one of
                  two): every answer must equal that request's first, whatever ran beside it
    leave-stream  a stream its client closes after a few events
    leave         a completion its client gives up on after a fraction of a second
    bad           a request the server must refuse with a 400 (a bad value, a field it does not
                  implement, one not in the API, bad JSON)
Every request must end completed, cancelled by its client, or refused with a status (400, or 429
with Retry-After); anything else (an error, a timeout, a broken stream, a wrong answer) is lost.
At the end /health must show every KV block free and nothing running or waiting; the RSS of the
server and of its engine process, sampled through the run, must not grow after the warm-up (the
first fifth of the run); and SIGTERM must stop the server with status 0 in one line. Prints a JSON
summary; the exit status is 1 if any of that fails.
"""

import argparse
import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SERVING = re.compile(r"^serving \S+ at (http://\S+) on ")
PROMPTS = ["import os", "def fibonacci(n):", "class Stack:", "for i in range(", "# parse the arguments\n",
           "with open(path) as f:", "try:\n    import json\nexcept"]
SAME = [{"prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0},
        {"prompt": "import os\n", "max_tokens": 16, "temperature": 0.8, "top_p": 0.95, "top_k": 40, "seed": 7}]
BAD = [  # bodies the server must refuse with a 400 (raw bytes: not JSON)
    {"prompt": "x", "temperature": -1}, {"prompt": "x", "max_tokens": True}, {"prompt": 42},
    {"prompt": "x", "best_of": 3}, {"prompt": "x", "suffix": "y"}, {"prompt": "x", "temprature": 0.5},
    {"prompt": "x", "max_tokens": 5000}, {"prompt": ""}, b'{"prompt": "x", ',
]
KINDS = {"stream": 30, "complete": 20, "same": 10, "leave-stream": 15, "leave": 15, "bad": 10}  # relative weights
REQUEST_TIMEOUT_S = 120
GROWTH_BYTES, GROWTH_FRACTION = 32 * 2**20, 0.05  # RSS growth after the warm-up still counted as flat


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the clients send (default: 10)")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients (default: 32)")
    p.add_argument("--model", type=Path, default=ROOT / "weights" / "qwen3-stdlib-tiny",
                   help="checkpoint to serve (default: the shipped model)")
    p.add_argument("--device", default="cpu", help="serve.py's --device (default: cpu)")
    p.add_argument("--max-batch", type=int, default=16, help="serve.py's --max-batch (default: 16)")
    p.add_argument("--max-waiting", type=int, default=8, help="serve.py's --max-waiting (default: 8)")
    p.add_argument("--seed", type=int, default=0, help="the clients' random choices (default: 0)")
    p.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "soak-serve.log",
                   help="where serve.py's output goes (default: %(default)s)")
    return p.parse_args(argv)


def rss(pid: int) -> int:
    """Resident memory of a process, in bytes (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def engine_pid(server_pid: int) -> int:
    for pid in map(int, Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()):
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise RuntimeError("serve.py has no engine process")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, str(ROOT / "scripts" / "serve.py"), "--model", str(args.model), "--port", "0",
           "--device", args.device, "--max-batch", str(args.max_batch), "--max-waiting", str(args.max_waiting)]
    with open(args.log, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"soak_serve.py: serve.py exited with {proc.returncode}:\n{args.log.read_text()}")
        found = [m.group(1) for line in args.log.read_text().splitlines() if (m := SERVING.match(line))]
        if found:
            try:
                if httpx.get(f"{found[0]}/health", timeout=5).status_code == 200:
                    return proc, found[0]
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    proc.kill()
    sys.exit("soak_serve.py: serve.py did not start within 600 s")


@dataclass
class Outcome:
    what: str  # completed | cancelled | refused 400 | refused 429 | lost
    why: str = ""  # what was wrong, when lost
    retry_after: float = 0.0  # a 429's Retry-After: the client waits that long before its next request


def refusal(r: httpx.Response, expected: int) -> Outcome:
    """The outcome of a response that is not the expected success: a refusal with its status (a 429
    must say when to retry), or lost."""
    if r.status_code == 429 and r.headers.get("retry-after"):
        return Outcome("refused 429", retry_after=float(r.headers["retry-after"]))
    if r.status_code == expected == 400 and "error" in r.json():
        return Outcome("refused 400")
    return Outcome("lost", f"status {r.status_code}: {r.text[:200]}")


class Soak:
    """The clients, and their requests' outcomes."""

    def __init__(self, url: str, http: httpx.AsyncClient, seed: int):
        self.url, self.http, self.rng = url, http, random.Random(seed)
        self.outcomes: Counter = Counter()  # (kind, outcome) -> count
        self.lost: list[str] = []
        self.same: dict[int, str] = {}  # SAME's index -> its first answer

    def body(self, stream: bool) -> dict:
        return {"prompt": self.rng.choice(PROMPTS), "max_tokens": self.rng.randint(1, 64), "stream": stream,
                "temperature": self.rng.choice([0, 0.7]), "seed": self.rng.randrange(1000)}

    async def stream(self, leave_after: int | None) -> Outcome:
        request = self.http.build_request("POST", f"{self.url}/v1/completions", json=self.body(stream=True))
        r = await self.http.send(request, stream=True)
        try:
            if r.status_code != 200:
                await r.aread()
                return refusal(r, 200)
            events = []
            async for line in r.aiter_lines():
                if line:
                    events.append(line.removeprefix("data: "))
                if leave_after is not None and len(events) >= leave_after and events[-1] != "[DONE]":
                    return Outcome("cancelled")
            finish = json.loads(events[-2])["choices"][0]["finish_reason"] if len(events) >= 2 else None
            if events[-1:] == ["[DONE]"] and finish in ("length", "stop"):
                return Outcome("completed")
            return Outcome("lost", f"stream ended with {events[-2:]}")
        finally:
            await r.aclose()

    async def complete(self, body: dict, same: int | None = None, timeout_s: float = REQUEST_TIMEOUT_S) -> Outcome:
        try:
            r = await self.http.post(f"{self.url}/v1/completions", json=body, timeout=timeout_s)
        except httpx.TimeoutException:
            if timeout_s < REQUEST_TIMEOUT_S:  # a client that gave up: it left
                return Outcome("cancelled")
            raise
        if r.status_code != 200:
            return refusal(r, 200)
        choice = r.json()["choices"][0]
        if same is not None:
            self.same.setdefault(same, choice["text"])
        if choice["finish_reason"] not in ("length", "stop"):
            return Outcome("lost", f"finish_reason {choice['finish_reason']}")
        if same is not None and choice["text"] != self.same[same]:
            return Outcome("lost", f"a different answer to the same request {SAME[same]}: {choice['text']!r}")
        return Outcome("completed")

    async def bad(self) -> Outcome:
        body = self.rng.choice(BAD)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await self.http.post(f"{self.url}/v1/completions", content=content,
                                 headers={"Content-Type": "application/json"})
        outcome = refusal(r, 400)
        return outcome if outcome.what != "lost" else Outcome("lost", f"{body!r} got {outcome.why}")

    async def one(self, kind: str) -> Outcome:
        try:
            if kind in ("stream", "leave-stream"):
                return await self.stream(self.rng.randint(1, 5) if kind == "leave-stream" else None)
            if kind == "complete":
                return await self.complete(self.body(stream=False))
            if kind == "same":
                same = self.rng.randrange(len(SAME))
                return await self.complete(SAME[same], same=same)
            if kind == "leave":
                return await self.complete(self.body(stream=False), timeout_s=self.rng.uniform(0.05, 1.0))
            return await self.bad()
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as err:
            return Outcome("lost", f"{type(err).__name__}: {err}")

    async def client(self, until: float) -> None:
        """Requests one after another until `until`; after a 429, the wait its Retry-After asks for."""
        while time.monotonic() < until:
            kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
            outcome = await self.one(kind)
            self.outcomes[kind, outcome.what] += 1
            if outcome.what == "lost" and len(self.lost) < 20:
                self.lost.append(f"{kind}: {outcome.why}")
            await asyncio.sleep(outcome.retry_after)


async def sample(url: str, pids: dict[str, int], until: float, samples: list) -> None:
    """Every 5 s: the time, /health, and each process's RSS."""
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as http:
        while time.monotonic() < until:
            h = (await http.get(f"{url}/health")).json()
            samples.append({"t": round(time.monotonic() - start, 1), "running": h["running"], "waiting": h["waiting"],
                            "free_blocks": h["free_blocks"], **{f"rss_{k}": rss(pid) for k, pid in pids.items()}})
            await asyncio.sleep(5)


async def soak(url: str, pids: dict[str, int], args: argparse.Namespace) -> tuple[Soak, list]:
    until = time.monotonic() + args.minutes * 60
    limits = httpx.Limits(max_connections=2 * args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
        run = Soak(url, http, args.seed)
        samples: list = []
        await asyncio.gather(sample(url, pids, until, samples), *(run.client(until) for _ in range(args.clients)))
    return run, samples


def flat(samples: list, key: str) -> tuple[int, int, bool]:
    """RSS at the end of the warm-up (the first fifth of the run) and at the end, and whether it stayed flat."""
    warm, last = samples[len(samples) // 5][key], samples[-1][key]
    return warm, last, last <= warm * (1 + GROWTH_FRACTION) + GROWTH_BYTES


def stop_server(proc: subprocess.Popen, log: Path) -> tuple[int | None, list[str]]:
    proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        status = None
    lines = log.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if SERVING.match(line))
    return status, lines[start + 1 :]


def main(argv=None) -> int:
    args = parse_args(argv)
    proc, url = start_server(args)
    try:
        pids = {"server": proc.pid, "engine": engine_pid(proc.pid)}
        run, samples = asyncio.run(soak(url, pids, args))
        deadline = time.monotonic() + 30
        while not (h := httpx.get(f"{url}/health", timeout=30).json())["running"] == h["waiting"] == 0 \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        rss_end = {k: rss(pid) for k, pid in pids.items()}
    finally:
        status, said = stop_server(proc, args.log)
    outcomes = Counter()
    for (_, outcome), n in run.outcomes.items():
        outcomes[outcome] += n
    memory = {k: flat(samples, f"rss_{k}") for k in pids}
    leaked = h["total_blocks"] - h["free_blocks"]
    summary = {
        "minutes": args.minutes, "clients": args.clients, "requests": sum(outcomes.values()),
        "outcomes": dict(outcomes), "by_kind": {f"{k} {o}": n for (k, o), n in sorted(run.outcomes.items())},
        "lost": run.lost, "health_at_end": h, "blocks_leaked": leaked,
        "rss_mib": {k: {"first": round(samples[0][f"rss_{k}"] / 2**20, 1), "after_warm_up": round(w / 2**20, 1),
                        "end": round(rss_end[k] / 2**20, 1), "flat": ok} for k, (w, _, ok) in memory.items()},
        "stop": {"status": status, "said": said},
    }
    print(json.dumps(summary, indent=2))
    good = (not outcomes["lost"] and not leaked and h["running"] == h["waiting"] == 0
            and all(ok for _, _, ok in memory.values()) and status == 0 and len(said) == 1)
    print(f"soak_serve.py: {'passed' if good else 'FAILED'}: {sum(outcomes.values())} requests, "
          + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())) + f"; {leaked} blocks leaked", file=sys.stderr)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
