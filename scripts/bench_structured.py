"""Structured output's cost: random JSON schemas through the serving engine in one process, each
request constrained to its schema, against the same requests unconstrained, in one run.

    python scripts/bench_structured.py                      # the shipped model on the CPU, 50 schemas
    python scripts/bench_structured.py --config 0.6b --requests 64 --output 256   # a GPU, random weights

Every request is admitted at once (one engine of max_batch --requests), greedy, up to --output
tokens, twice: first with every grammar to compile (`cold`: a request waits for its own), then
again (xgrammar's cache has them: the steady state of an application that sends its schema with
every request); then the same prompts unconstrained, each generating as many tokens as its
constrained run did (no stop token), so that both runs have the same batch at every step.
Prints one JSON line: the tokens and tok/s of each run, the ratios, how many constrained outputs
parse and validate against their schemas (jsonschema) or were cut by --output, and on a GPU the
host's milliseconds per step in the engine's phases (the second run's). The schemas
(`random_schema`, also the tests' source) nest objects and arrays, with enums, required fields,
integers, numbers, booleans and strings of bounded length.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from qwen3 import Qwen3ForCausalLM  # noqa: E402
from runtime.grammar import structural_tag  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402
from runtime.text import load_tokenizer  # noqa: E402
from serve.constraints import json_format  # noqa: E402
from serve.engine import Engine, Request  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "weights" / "qwen3-stdlib-tiny"
# Qwen3's tokenizer holds 151,669 tokens (its 151,936 logits pad the rest). A grammar's costs grow
# with the vocabulary it checks (a mask walks the tokens its state cannot decide beforehand) and
# with the ids it must treat as special (xgrammar checks each accepted token against all of them:
# the shipped 4,096 padded to 151,936 would make 147,840; docs/benchmarks/serve-notes.md), so a
# benchmark at a real config needs a tokenizer of that size: a byte-level BPE trained to it on
# Python source (the standard library's, torch's and transformers': enough distinct text for that
# many tokens).
QWEN3_TOKENS = 151669
WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "north", "south", "yes", "no"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of an object: 1-4 properties, each a scalar, an enum, an array or (above depth
    2, not at all) a nested object; some of them required."""
    def value(depth: int) -> dict:
        kinds = ["integer", "number", "boolean", "string", "enum", "array"] + (["object"] if depth < 2 else [])
        kind = rng.choice(kinds)
        if kind == "string":
            return {"type": "string", "maxLength": rng.randint(1, 12)}
        if kind == "enum":
            return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
        if kind == "array":
            return {"type": "array", "items": value(depth + 1), "maxItems": rng.randint(1, 3)}
        if kind == "object":
            return random_schema(rng, depth + 1)
        return {"type": kind}

    names = rng.sample(WORDS, rng.randint(1, 4))
    properties = {name: value(depth) for name in names}
    required = [name for name in names if rng.random() < 0.6]
    return {"type": "object", "properties": properties, "required": required}


def qwen3_sized_tokenizer():
    """A byte-level BPE of QWEN3_TOKENS tokens, trained on the Python source of the standard
    library, torch and transformers installed here (~30 s) the first time and kept in weights/
    (git ignores it)."""
    import sysconfig

    import transformers

    out = ROOT / "weights" / f"bench-tokenizer-{QWEN3_TOKENS}"
    if not (out / "tokenizer.json").exists():
        from train_tiny import EOT, read, train_tokenizer  # scripts/ is on a script's path

        roots = [Path(sysconfig.get_paths()["stdlib"]), Path(torch.__file__).parent, Path(transformers.__file__).parent]
        files = sorted(f for root in roots for f in root.rglob("*.py")
                       if "site-packages" not in f.relative_to(root).parts)
        wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(read(files), QWEN3_TOKENS),
                                                       eos_token=EOT)
        if len(wrapped) != QWEN3_TOKENS:
            raise RuntimeError(f"the corpus gives {len(wrapped)} tokens, not {QWEN3_TOKENS}")
        wrapped.save_pretrained(out)
    return load_tokenizer(out)


def run(engine: Engine, requests: list[Request]) -> tuple[list[str], list[str], list[int], float]:
    """Each request's text, finish reason and tokens generated; the seconds."""
    outputs = [[] for _ in requests]
    for request, out in zip(requests, outputs):
        engine.add(request, out.append)
    start = time.perf_counter()
    engine.run()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    texts = ["".join(o.text for o in out) for out in outputs]
    return texts, [out[-1].finish_reason for out in outputs], [out[-1].completion_tokens for out in outputs], seconds


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=["0.6b", "8b"], help="random weights of this Qwen3 architecture "
                   "(default: the shipped model)")
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--output", type=int, default=200, help="tokens per request at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def load(config: str | None, device: torch.device) -> Qwen3ForCausalLM:
    """Random bf16 weights of architecture `config` (bench_generate.py's), or the shipped model in fp32."""
    if config:
        from bench_models import build  # scripts/ is on the path of a script run

        _, model = build(config, device, torch.bfloat16, "auto")
        return model
    return Qwen3ForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32, device=device, progress=False)


def run_with_phases(engine: Engine, requests: list[Request]) -> tuple[tuple, dict]:
    """run(engine, requests), and on a GPU where a constrained step's host time goes: milliseconds
    per step in each of its phases (the launches, the grammars' matching and token masks, the
    acceptance), with the steps and seconds ({} on the CPU)."""
    if engine.device.type != "cuda":
        return run(engine, requests), {}
    from bench_engine import timed_phases

    spent = timed_phases(engine, ("_launch_prefills", "_launch_decode", "_match", "_allow", "_accept_step"))
    step, steps = engine.step, [0]

    def counted():
        steps[0] += 1
        step()

    engine.step = counted
    outputs = run(engine, requests)
    engine.step = step
    phases = {f"{name.strip('_')}_ms_per_step": round(1e3 * t / steps[0], 3) for name, t in spent.items()}
    return outputs, phases | {"steps": steps[0], "seconds": round(outputs[3], 3)}


def main(argv=None) -> None:
    args = parse_args(argv)
    import jsonschema

    device = torch.device(args.device)
    tokenizer = qwen3_sized_tokenizer() if args.config else load_tokenizer(SHIPPED)
    model = load(args.config, device)
    rng = random.Random(args.seed)
    schemas = [random_schema(rng) for _ in range(args.requests)]
    prompt = tokenizer("Reply with a JSON object:\n", add_special_tokens=False)["input_ids"]
    greedy = SamplingParams(temperature=0.0)
    engine = Engine(model, tokenizer, max_batch=args.requests,
                    n_blocks=args.requests * -(-(len(prompt) + args.output + 1) // 16) + 16)
    warm = [Request(prompt, 4, greedy, grammar=structural_tag(json_format(schemas[0])))]
    run(engine, warm + [Request(prompt, 4, greedy)])  # compile kernels, capture graphs
    constrained = [Request(prompt, args.output, greedy, grammar=structural_tag(json_format(s))) for s in schemas]
    _, _, _, cold_s = run(engine, constrained)
    (texts, reasons, lengths, seconds), phases = run_with_phases(engine, constrained)
    _, _, free_lengths, free_s = run(engine, [Request(prompt, n, greedy, eos_ids=()) for n in lengths])
    tokens, free_tokens = sum(lengths), sum(free_lengths)
    valid = 0
    for text, schema in zip(texts, schemas):
        try:
            jsonschema.validate(json.loads(text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    print(json.dumps({
        "model": args.config or SHIPPED.name, "device": str(device), "requests": args.requests,
        "free_tokens": free_tokens, "free_tok_s": round(free_tokens / free_s, 1),
        "constrained_tokens": tokens, "constrained_tok_s": round(tokens / seconds, 1),
        "ratio": round((tokens / seconds) / (free_tokens / free_s), 3),
        "constrained_cold_tok_s": round(tokens / cold_s, 1),
        "ratio_cold": round((tokens / cold_s) / (free_tokens / free_s), 3),
        "valid": valid, "cut_by_output": reasons.count("length"), **phases,
    }))


if __name__ == "__main__":
    main()
