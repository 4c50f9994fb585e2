"""The grammars' host cost per decode step, without a model: N requests' JSON schemas
(bench_structured's random ones), each step every live matcher's mask written and a token it
allows accepted, the tokens drawn at random among the allowed ones (a fixed seed: the same walk
for every variant). What a constrained step costs the engine's host beside an unconstrained one.

    python scripts/bench_grammar.py --rows 64 --fill-threads 1 2 4 8

One JSON line per variant: runtime/grammar.py's Grammars with xgrammar's batch fill on
`fill_threads` threads; milliseconds per step of the masks (fill) and of the acceptance, the
same per live row, and the host's cores. The
tokenizer is a Qwen3-sized one (bench_structured.qwen3_sized_tokenizer), --shipped the 4,096-token
one of the shipped model.
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))  # bench_structured, also when loaded by a test
from bench_structured import SHIPPED, qwen3_sized_tokenizer, random_schema  # noqa: E402

from runtime.grammar import Grammars, allow, mask_words, structural_tag  # noqa: E402
from runtime.text import load_tokenizer  # noqa: E402
from serve.constraints import json_format  # noqa: E402

VOCAB = 151936  # Qwen3's logits


def walk(grammars: Grammars, schemas: list[dict], steps: int, seed: int) -> dict:
    """Milliseconds per step of fill and accept over a random walk of every schema's grammar."""
    matchers = [grammars.matcher(structural_tag(json_format(schema))) for schema in schemas]
    for m in matchers:
        m.ready(60.0)
        m.start()
    words = torch.empty(len(matchers), mask_words(VOCAB), dtype=torch.int32)
    generator = torch.Generator().manual_seed(seed)
    fill_s = accept_s = 0.0
    walked = row_steps = 0
    for _ in range(steps):
        live = [m for m in matchers if not m.terminated]
        if not live:
            break
        rows = words[:len(live)]
        start = time.perf_counter()
        grammars.fill(live, rows)
        filled = time.perf_counter()
        tokens = allow(torch.rand(len(live), VOCAB, generator=generator), rows).argmax(-1).tolist()
        chosen = time.perf_counter()
        grammars.accept(live, tokens)
        accept_s += time.perf_counter() - chosen
        fill_s += filled - start
        walked += 1
        row_steps += len(live)
    return {"fill_ms": round(1e3 * fill_s / walked, 3), "accept_ms": round(1e3 * accept_s / walked, 3),
            "steps": walked, "live_rows_per_step": round(row_steps / walked, 1),
            "fill_us_per_row": round(1e6 * fill_s / row_steps, 2),
            "accept_us_per_row": round(1e6 * accept_s / row_steps, 2)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--fill-threads", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=1, help="walks per variant, alternating the variants")
    p.add_argument("--shipped", action="store_true", help="the shipped model's tokenizer")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(SHIPPED) if args.shipped else qwen3_sized_tokenizer()
    rng = random.Random(args.seed)
    schemas = [random_schema(rng) for _ in range(args.rows)]
    grammars = {n: Grammars(tokenizer, VOCAB, [tokenizer.eos_token_id], fill_threads=n) for n in args.fill_threads}
    for _ in range(args.repeats):
        for n, g in grammars.items():
            print(json.dumps({"rows": args.rows, "tokenizer": len(tokenizer), "cores": os.cpu_count(),
                              "fill_threads": n, **walk(g, schemas, args.steps, args.seed)}), flush=True)


if __name__ == "__main__":
    main()
