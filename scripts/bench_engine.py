"""The serving engine alone, in one process (no HTTP): where a served level's time goes.

    python scripts/bench_engine.py --config 0.6b --concurrency 20 256 \
        --temperature 0 0.6 1.0 --top-p 1 0.95 0.95 --top-k 0 20 0

Drives serve/engine.py's Engine as the server's engine process does, with the load of
scripts/bench_serve.py: c clients, each sending --requests-per-client requests one after
another (random prompt ids of --prompt-min to --prompt-max tokens, --output tokens each, no stop
token), on one engine of max_batch c. Each sampling setting (--temperature, --top-p, --top-k, the
i-th values together; a single value serves every setting; temperature 0 is greedy) runs every
level, each request with a seed of its own. Prints per level: generated tok/s, time to first token
(from the request's admission to the queue to its first token's output), steps, and the host's
time per step in the engine's phases: admitting and launching prefills, launching the decode
step, and reading back the previous step's tokens, of which waiting for the GPU. A host that
waits most of a step for the GPU is GPU-bound; one that never waits leaves the GPU idle.
--profile N: kernel time by kernel over N steps in the middle of the last level (torch profiler).
"""

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_generate import build, sync  # noqa: E402
from bench_serve import sampling_settings  # noqa: E402

from runtime.sampling import SamplingParams  # noqa: E402
from serve.engine import Engine, Request  # noqa: E402

PHASES = ("_launch_prefills", "_launch_decode", "_accept_step")


def timed_phases(engine: Engine, phases: tuple[str, ...] = PHASES) -> dict[str, float]:
    """Seconds of host time spent in each engine phase, accumulated as the engine steps, and in
    waiting for a step's tokens (`wait`)."""
    spent = defaultdict(float)
    for name in phases:
        method = getattr(engine, name)

        def timed(*args, method=method, name=name):
            start = time.perf_counter()
            result = method(*args)
            spent[name] += time.perf_counter() - start
            return result

        setattr(engine, name, timed)
    engine_events = torch.cuda.Event  # the engine's read-back waits on these: timed through a subclass

    class TimedEvent(engine_events):
        def synchronize(self):
            start = time.perf_counter()
            super().synchronize()
            spent["wait"] += time.perf_counter() - start

    torch.cuda.Event = TimedEvent
    return spent


def level(engine: Engine, concurrency: int, sampling: dict, args, rng: random.Random, profile_steps: int) -> dict:
    vocab = engine.model.config.vocab_size
    jobs = [[[rng.randrange(vocab) for _ in range(rng.randint(args.prompt_min, args.prompt_max))]
             for _ in range(args.requests_per_client)] for _ in range(concurrency)]
    ttft, generated = [], [0]

    def send(client: int) -> None:
        if not jobs[client]:
            return
        sent = time.perf_counter()
        first = []

        def on_output(out):
            if out.token_ids and not first:
                first.append(time.perf_counter())
                ttft.append(first[0] - sent)
            if out.finish_reason is not None:
                generated[0] += out.completion_tokens
                send(client)

        params = SamplingParams(**{k: v for k, v in sampling.items() if k != "logprobs"})
        engine.add(Request(jobs[client].pop(), args.output, params, seed=rng.randrange(2**63), eos_ids=(),
                           logprobs=sampling.get("logprobs")), on_output)

    engine_events = torch.cuda.Event
    spent = timed_phases(engine)
    sync()
    start = time.perf_counter()
    for client in range(concurrency):
        send(client)
    steps, profiler = 0, None
    while engine.has_work():
        if profile_steps and steps == 150:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
            profiled_from = time.perf_counter()
        engine.step()
        steps += 1
        if profiler is not None and steps == 150 + profile_steps:
            sync()
            profiler.__exit__(None, None, None)
            print_kernels(profiler, time.perf_counter() - profiled_from, profile_steps)
            profiler = None
    sync()
    wall = time.perf_counter() - start
    torch.cuda.Event = engine_events
    result = dict(concurrency=concurrency, **sampling, requests=len(ttft), total_tok_s=round(generated[0] / wall),
                  ttft_ms_p50=round(statistics.median(ttft) * 1e3, 1), steps=steps, wall_s=round(wall, 2),
                  **{f"{name.strip('_')}_ms_per_step": round(spent[name] / steps * 1e3, 3)
                     for name in (*PHASES, "wait")})
    print(result, flush=True)
    return result


def print_kernels(profiler, wall_s: float, steps: int) -> None:
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e.name[:80]][0] += 1
        by_name[e.name[:80]][1] += e.device_time
    busy = sum(us for _, us in by_name.values()) / 1e6
    print(f"profile: {steps} steps in {wall_s * 1e3:.1f} ms, kernel time {busy * 1e3:.1f} ms "
          f"({busy / wall_s:.0%} of the wall time, profiler overhead included)")
    for name, (count, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"{us / 1e3:9.2f} ms {count:6d} x  {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="0.6b")
    p.add_argument("--concurrency", type=int, nargs="+", default=[20, 256])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompt-min", type=int, default=128)
    p.add_argument("--prompt-max", type=int, default=1024)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="0: greedy")
    p.add_argument("--top-p", type=float, nargs="+", default=[1.0])
    p.add_argument("--top-k", type=int, nargs="+", default=[0])
    p.add_argument("--logprobs", type=int, default=None, help="every request asks for this many top log-probabilities")
    p.add_argument("--prefill-tokens", type=int, default=None, help="the engine's prefill_tokens (default: its own)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="profile N steps of the last level")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)
    _, model = build(args.config, device, torch.bfloat16, "auto")
    rng = random.Random(args.seed)
    settings = sampling_settings(args)
    for i, concurrency in enumerate(args.concurrency):
        n_blocks = concurrency * -(-(args.prompt_max + args.output) // 16)
        extra = {} if args.prefill_tokens is None else dict(prefill_tokens=args.prefill_tokens)
        engine = Engine(model, max_batch=concurrency, n_blocks=n_blocks, **extra)
        for j, sampling in enumerate(settings):
            last = i == len(args.concurrency) - 1 and j == len(settings) - 1
            # the graphs a setting runs are captured the first time: in a short level of one client first
            level(engine, 1, sampling, argparse.Namespace(**{**vars(args), "output": 8, "requests_per_client": 1}),
                  rng, 0)
            level(engine, concurrency, sampling, args, rng, args.profile if last else 0)
        del engine


if __name__ == "__main__":
    main()
