"""Serving scenarios a user recognises: a multi-turn chat over a shared system prompt (prefix
caching on and off), and long prompts arriving among decoding streams (chunked prefill).

    python scripts/bench_scenarios.py --config 0.6b --scenario multi_turn long_prompts --json OUT.json

Starts scripts/serve.py as bench_serve.py does (random weights of the real architecture, bf16,
the shipped tokenizer), once per server setting, and talks to it with streaming completions of
token ids.

multi_turn: --conversations conversations at once, each --turns turns: the prompt of turn t is a
system prompt that every conversation shares (--system-tokens), then each earlier turn's user
message (--user-tokens) and reply, then turn t's message; --output tokens generated a turn. The
reply is resent as the ids it was generated as (return_token_ids: a random model's reply does not
survive a trip through text), as a chat client does whose template keeps the reply as it came
(--stand-in-replies: random ids of the same length instead, as when a template rewrites the reply,
Qwen3's dropping the reasoning). Run with the prefix cache and without (--no-prefix-cache). Row: {"scenario":
"multi_turn", "prefix_cache", "ttft_ms_p50_later_turns", "ttft_ms_p50_first_turn", "total_tok_s",
"hit_rate", ...}.

long_prompts: --streams clients each decoding after a short prompt; after --long-after seconds,
prompts of --long-tokens tokens (one after another, each generating one token) arrive among them,
and the streams leave half a second after the last one's first token (or after --stream-output
tokens: the row counts streams that ended before that, which should be none), so that the long
prompts are prefilled while every stream decodes. The server's batch has room for the streams and
the long prompts. Without long prompts, the streams decode for as long as the long prompts take
alone, plus --long-after and a second. Reported: the streams' inter-token latency (between consecutive streamed
chunks) p50/p99 while long prompts are being prefilled, and in a run without them; each long
prompt's TTFT among the streams and alone on the idle server. Row: {"scenario": "long_prompts",
"itl_ms_p50", "itl_ms_p99", "itl_ms_p50_without_long", "itl_ms_p99_without_long", "long_ttft_ms",
"long_ttft_ms_alone", ...}.
"""

import argparse
import asyncio
import datetime
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import ROOT, SHIPPED, gpu_name, random_checkpoint, start_server, versions  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", choices=["0.6b", "8b"], help="random weights of this Qwen3 architecture")
    src.add_argument("--model", type=Path, help="a checkpoint directory (default: the shipped model)")
    p.add_argument("--scenario", nargs="+", choices=["multi_turn", "long_prompts"], default=["multi_turn"])
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--user-tokens", type=int, default=100)
    p.add_argument("--output", type=int, default=256, help="tokens generated per turn")
    p.add_argument("--stand-in-replies", action="store_true", help="resend random ids for each reply")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--stream-output", type=int, default=8192,
                   help="tokens a stream may generate at most (it leaves once the long prompts are done)")
    p.add_argument("--long-tokens", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--long-after", type=float, default=2.0, help="seconds after the streams start")
    p.add_argument("--server-args", default="", help="more flags for serve.py")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default=None)
    p.add_argument("--server-log", type=Path, default=None)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="a PNG of the results (needs matplotlib)")
    args = p.parse_args(argv)
    args.concurrency, args.prompt_min, args.prompt_max = [max(args.conversations, args.streams)], 0, 0
    return args


async def stream(http: httpx.AsyncClient, url: str, model: str, prompt: list[int], output: int,
                 until: Callable[[], bool] | None = None) -> dict:
    """One streamed completion: {"ttft", "gaps" (s between consecutive chunks), "tokens", "ids",
    "cut"}; until: read until it holds, then leave (the server cancels the request; "cut" True)."""
    body = {"model": model, "prompt": prompt, "max_tokens": output, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    start = last = time.perf_counter()
    ttft, gaps, tokens, ids, cut = None, [], 0, [], False
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if until is not None and until():
                cut = True
                break
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                continue
            ids += chunk["choices"][0].get("token_ids", [])
            now = time.perf_counter()
            if ttft is None:
                ttft = now - start
            else:
                gaps.append(now - last)
            last = now
    return {"ttft": ttft, "gaps": gaps, "tokens": tokens, "ids": ids, "cut": cut}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(1e3 * values[min(len(values) - 1, int(q * len(values)))], 2) if values else float("nan")


def client(timeout: float, n: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


async def multi_turn(url: str, model: str, args, vocab: int) -> dict:
    rng = random.Random(args.seed)
    ids = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    system = ids(args.system_tokens)
    messages = [[ids(args.user_tokens) for _ in range(args.turns)] for _ in range(args.conversations)]
    replies = [[ids(args.output) for _ in range(args.turns)] for _ in range(args.conversations)]
    first, later, tokens = [], [], 0

    async def conversation(http, c: int):
        nonlocal tokens
        history = list(system)
        for t in range(args.turns):
            history += messages[c][t]
            result = await stream(http, url, model, history, args.output)
            (first if t == 0 else later).append(result["ttft"])
            tokens += result["tokens"]
            history += replies[c][t] if args.stand_in_replies else result["ids"]

    async with client(args.timeout, args.conversations) as http:
        for n in (args.user_tokens, args.system_tokens):  # compiles and captures; ids nobody else sends
            await stream(http, url, model, [rng.randrange(1, vocab) for _ in range(n)], 4)
        before = (await http.get(f"{url}/health")).json().get("prefix_cache", {})
        start = time.perf_counter()
        await asyncio.gather(*(conversation(http, c) for c in range(args.conversations)))
        wall = time.perf_counter() - start
        after = (await http.get(f"{url}/health")).json().get("prefix_cache", {})
    prompt = after.get("prompt_tokens", 0) - before.get("prompt_tokens", 0)
    hits = after.get("hit_tokens", 0) - before.get("hit_tokens", 0)
    return {"scenario": "multi_turn", "prefix_cache": after.get("enabled", False),
            "conversations": args.conversations, "turns": args.turns, "system_tokens": args.system_tokens,
            "user_tokens": args.user_tokens, "output_tokens": args.output,
            "replies": "stand-in" if args.stand_in_replies else "as generated",
            "ttft_ms_p50_first_turn": pct(first, 0.5), "ttft_ms_p50_later_turns": pct(later, 0.5),
            "ttft_ms_p99_later_turns": pct(later, 0.99), "total_tok_s": round(tokens / wall, 1),
            "hit_rate": round(hits / prompt, 4) if prompt else 0.0, "wall_s": round(wall, 2)}


async def long_prompts(url: str, model: str, args, vocab: int) -> dict:
    rng = random.Random(args.seed + 1)
    ids = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    longs = [ids(n) for n in args.long_tokens]
    async with client(args.timeout, args.streams + 1) as http:
        for n in args.long_tokens:  # compiles what a prompt of that length runs; fresh ids: no cached prefix
            await stream(http, url, model, ids(n), 1)
        alone = [(await stream(http, url, model, ids(n), 1))["ttft"] for n in args.long_tokens]

        # The streams decode until the long prompts have had their first tokens (and half a second
        # more), then leave; without long prompts, for as long as the long prompts take alone.
        without_s = args.long_after + sum(alone) + 1.0

        async def streams(with_long: bool):
            prompts = [ids(128) for _ in range(args.streams)]
            window: list[float] = []
            long_ttft: list[float] = []
            marks = {}
            began = time.perf_counter()
            done = {"early": 0}

            def over() -> bool:
                now = time.perf_counter()
                if with_long:
                    return "end" in marks and now > marks["end"] + 0.5
                return now > began + without_s

            async def longs_arrive():
                await asyncio.sleep(args.long_after)
                marks["start"] = time.perf_counter()
                for p in longs:
                    long_ttft.append((await stream(http, url, model, p, 1))["ttft"])
                marks["end"] = time.perf_counter()

            async def one(p):
                body_start = time.perf_counter()
                result = await stream(http, url, model, p, args.stream_output, until=over)
                done["early"] += not result["cut"]  # reached stream_output before the window closed
                # keep the gaps that end inside the window the long prompts were prefilled in
                t = body_start + result["ttft"]
                for gap in result["gaps"]:
                    t += gap
                    if not with_long or marks.get("start", 1e18) <= t <= marks.get("end", 1e18) + 0.5:
                        window.append(gap)

            tasks = [one(p) for p in prompts] + ([longs_arrive()] if with_long else [])
            await asyncio.gather(*tasks)
            return window, long_ttft, done["early"]

        without, _, _ = await streams(False)
        within, long_ttft, early = await streams(True)
    return {"scenario": "long_prompts", "streams": args.streams, "stream_output": args.stream_output,
            "long_tokens": args.long_tokens, "itl_ms_p50": pct(within, 0.5), "itl_ms_p99": pct(within, 0.99),
            "itl_ms_p50_without_long": pct(without, 0.5), "itl_ms_p99_without_long": pct(without, 0.99),
            "long_ttft_ms": [round(1e3 * t, 1) for t in long_ttft],
            "long_ttft_ms_alone": [round(1e3 * t, 1) for t in alone],
            "streams_done_before_the_long_prompts": early}


def plot(results: list[dict], path: Path) -> None:
    """Bars: the multi-turn chat's TTFT of later turns and tok/s, prefix cache on and off; the
    streams' p99 inter-token latency without and with long prompts, and each long prompt's TTFT
    alone and among the streams."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multi = [r for r in results if r["scenario"] == "multi_turn"]
    longs = [r for r in results if r["scenario"] == "long_prompts"]
    panels = 2 * bool(multi) + bool(longs)
    fig, axes = plt.subplots(1, panels, figsize=(4.4 * panels, 3.8), squeeze=False)
    axes = list(axes[0])
    if multi:
        models = len({r["model"] for r in multi}) > 1  # then each bar names its model
        names = [(r["model"].removeprefix("qwen3-") + "\n" if models else "") +
                 ("cache on" if r["prefix_cache"] else "cache off") for r in multi]
        colors = ["C0" if r["prefix_cache"] else "C7" for r in multi]
        axes[0].bar(names, [r["ttft_ms_p50_later_turns"] for r in multi], color=colors)
        axes[0].set(ylabel="ms", yscale="log" if models else "linear",
                    title=f"multi-turn: TTFT p50 of turns 2-{multi[0]['turns']}")
        axes[1].bar(names, [r["total_tok_s"] for r in multi], color=colors)
        axes[1].set(ylabel="generated tok/s", title=f"multi-turn: {multi[0]['conversations']} conversations")
    if longs:
        r = longs[-1]
        labels = ["ITL p99\nstreams alone", "ITL p99\nwith long"] + [
            f"TTFT {n // 1024}k\n{how}" for n in r["long_tokens"] for how in ("alone", "among streams")]
        values = [r["itl_ms_p99_without_long"], r["itl_ms_p99"]] + [
            v for pair in zip(r["long_ttft_ms_alone"], r["long_ttft_ms"]) for v in pair]
        axes[-1].bar(labels, values, color=["C7", "C0"] + ["C7", "C0"] * len(r["long_tokens"]))
        axes[-1].set(yscale="log", ylabel="ms", title=f"long prompts among {r['streams']} streams")
        axes[-1].tick_params(axis="x", labelsize=7)
    fig.suptitle(", ".join(sorted({r["model"] for r in results})))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-scenarios-"))
    results = []
    try:
        model_dir = random_checkpoint(args.config, tmp / f"qwen3-{args.config}") if args.config else \
            (args.model or SHIPPED)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        name = f"qwen3-{args.config}" if args.config else model_dir.name
        runs = []
        if "multi_turn" in args.scenario:
            runs += [("multi_turn", ""), ("multi_turn", "--no-prefix-cache")]
        if "long_prompts" in args.scenario:
            runs += [("long_prompts", "")]
        base = args.server_args
        for scenario, flags in runs:
            args.server_args = f"{base} {flags}"
            log = args.server_log or tmp / "server.log"
            # Long prompts: room in the batch beside every stream, so that they are admitted at once.
            batch = args.streams + len(args.long_tokens) if scenario == "long_prompts" else args.concurrency[0]
            proc, url = start_server(model_dir, args, batch, log)
            try:
                model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
                run = multi_turn if scenario == "multi_turn" else long_prompts
                row = {"model": name, **asyncio.run(run(url, model, args, vocab)),
                       "server_args": args.server_args.strip()}
                print(json.dumps(row), flush=True)
                results.append(row)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           cwd=ROOT).stdout.strip()
    if args.json:
        doc = {"date": datetime.date.today().isoformat(), "commit": commit, "gpu": gpu_name(),
               "versions": versions(), "results": results}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
