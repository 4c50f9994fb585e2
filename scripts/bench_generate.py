"""Decode speed of ours against transformers' generate on the same checkpoint, in one process.

    python scripts/bench_generate.py --config 0.6b --device cpu --dtype float32 --new 64
    python scripts/bench_generate.py --model /tmp/parity/Qwen3-8B --device cuda --dtype bfloat16

Greedy, batch 1, a random prompt; reports prefill ms, decode tokens/s and the weight bytes moved
per second (parameter bytes x decode tokens/s), for both, and checks they chose the same tokens.
On CUDA ours also runs with its decode steps replayed from a CUDA graph ("ours+cuda_graph"; its
rate leaves out the first decode step, which captures the graph).
"""

import argparse
import datetime
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from qwen3 import Qwen3ForCausalLM  # noqa: E402

CONFIGS = {  # the real Qwen3 architectures, with transformers' random init
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                 max_position_embeddings=40960, rope_theta=1_000_000.0),
    "8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
               max_position_embeddings=40960, rope_theta=1_000_000.0),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ours(model, ids, new, device, cuda_graph=False):
    stamps = []
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, temperature=0.0, eos_token_id=[], cuda_graph=cuda_graph,
                         on_token=lambda t: stamps.append(time.perf_counter()))
    first = 2 if cuda_graph else 1  # a graphed run captures its graph during its first decode step
    return out, (stamps[0] - start) * 1e3, (len(stamps) - first) / (stamps[-1] - stamps[first - 1])


def time_hf(model, ids, new, device):
    def run(n):
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(device)
        return out, time.perf_counter() - start

    _, prefill = run(1)
    out, total = run(new)
    return out, prefill * 1e3, (new - 1) / (total - prefill)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="an existing checkpoint directory")
    p.add_argument("--config", choices=list(CONFIGS), help="or build a random-weight checkpoint at this config")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--norm", default="auto")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    path = args.model
    if path is None:
        path = Path(tempfile.mkdtemp()) / f"qwen3-{args.config}-random"
        torch.manual_seed(0)
        with torch.device(device):
            built = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIGS[args.config])).to(dtype)
        built.save_pretrained(path)
        del built
    ours = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype, device=device, norm_impl=args.norm, progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    ids = torch.randint(0, ours.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    with torch.inference_mode():
        time_ours(ours, ids, 4, device), time_hf(hf, ids, 4, device)  # warm up both
        results = {}
        runs = [("ours", time_ours, ours), ("transformers", time_hf, hf)]
        if device.type == "cuda":
            runs.append(("ours+cuda_graph", functools.partial(time_ours, cuda_graph=True), ours))
        for name, timer, model in runs:
            out, prefill_ms, tok_s = timer(model, ids, args.new, device)
            results[name] = dict(prefill_ms=round(prefill_ms, 1), decode_tok_s=round(tok_s, 1),
                                 decode_GBps=round(weight_bytes * tok_s / 1e9, 1), tokens=out[0].tolist())
    tokens = {name: result.pop("tokens") for name, result in results.items()}
    same = tokens["ours"] == tokens["transformers"]
    graph_same = tokens["ours+cuda_graph"] == tokens["ours"] if "ours+cuda_graph" in tokens else None
    summary = dict(date=datetime.date.today().isoformat(), commit=args.commit, model=str(path.name),
                   device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                   dtype=args.dtype, prompt=args.prompt, new=args.new, norm=ours.config.norm_impl,
                   weight_GB=round(weight_bytes / 1e9, 3), same_tokens=same, cuda_graph_same_tokens=graph_same,
                   versions=dict(torch=torch.__version__, transformers=transformers.__version__), **results)
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
