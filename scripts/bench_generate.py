"""Decode speed of ours against transformers on the same random-weight model, in one process.

    python scripts/bench_generate.py --models 0.6b 8b --batches 1 8 32 64 --json docs/benchmarks/decode-h200.json

For each model (the real Qwen3 architectures, transformers' random init, bf16, built on the
device: nothing is downloaded or written to disk) and each batch size: a random prompt of
--prompt tokens per row, --new greedy tokens, no stop token. Engines:
  ours               model.generate as a user calls it (on CUDA: decode steps from a CUDA graph)
  ours_sampled       the same, sampling with the shipped model's settings (SAMPLED: temperature 0.6,
                     top-k 20, top-p 0.95, repetition penalty 1.1) instead of greedily
  ours_eager         the same as ours with cuda_graph=False
  hf_eager           transformers' generate (SDPA attention, dynamic cache)
  hf_static_compile  transformers' generate with cache_implementation="static" (compiled forward)
decode_tok_s = rows x decode steps / time, leaving out the prefill (ours: from the timestamps of
the streamed tokens, leaving out the first two decode steps, where ours captures its graph;
transformers timed the same way through a streamer); prefill_ms = time to the first token. hbm_fraction =
weight bytes read per decode step x decode steps per second / the measured copy bandwidth
(weights only: at large batches the KV cache adds reads this leaves out; of a MoE model's
experts, those that batch x k uniformly routed tokens are expected to hit: step_weight_bytes).
Also times a --long-prompt-token prefill of ours against transformers' (SDPA).
--quantization fp8: ours quantized as from_pretrained(quantization="fp8") quantizes (Qwen's FP8
format, 128 x 128 blocks, the FP8 decode kernels), rows named "qwen3-<model>-fp8", weight_GB the
FP8 model's; the long prefill is then timed in bf16 too (ours_bf16_ms), before quantizing. --json extends an
earlier file (rows of the same model, engine, batch and tp are replaced): each row names the
commit it was measured at.

Tensor parallelism, under torchrun with one process per GPU (NCCL):

    torchrun --standalone --nproc-per-node 2 scripts/bench_generate.py --tp 2 --models 8b 0.6b --batches 1 32 \
        --parity --json decode-tp-h200.json

measures, in the same run, "ours" on one GPU (tp=1, rank 0 alone while the others wait) and
split over the ranks (tp=2), at the same prompts. Every rank builds transformers' random model on
its GPU, rank 0's weights are broadcast so that all hold the same, and each rank copies its own
slices into its part of our model with the loader's slicing rule (qwen3/parallel.py): this
bypasses the safetensors loader (writing 16 GB to disk and reading it back would cost minutes),
which the tests and --parity cover. tp rows report weight_GB and hbm_fraction per GPU (rank 0's
part, against one GPU's copy bandwidth). --parity first checks, through from_pretrained on a small
fp32 checkpoint, that greedy tokens at tp=N (CUDA graphs, Triton path) equal tp=1's.
"""

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))  # bench_models, tp_parity when loaded by path (the tests)
from bench_models import CONFIGS, build, build_hf, ours_from_hf  # noqa: E402
from tp_parity import parity  # noqa: E402

from qwen3 import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from qwen3.parallel import TensorParallel  # noqa: E402
from qwen3.quantized import BLOCK, quantize_weights  # noqa: E402
from runtime import metadata  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth_GBps(device) -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (median of 20)."""
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(2**29, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * x.numel() * 2 / sorted(times[5:])[len(times[5:]) // 2] / 1e9


def step_weight_bytes(model: Qwen3ForCausalLM, batch: int) -> float:
    """Weight bytes one decode step reads: all of a dense model's but an untied input embedding's
    (a step reads only its tokens' rows; a tied one is the LM head's); of a MoE layer's experts, the
    expected share that batch x k uniformly routed tokens hit, 1 - (1 - k/E)^batch (the random
    router of these benchmarks spreads tokens about evenly)."""
    experts = {id(p) for name, p in model.named_parameters() if ".experts." in name}
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.model.embed_tokens.weight
    if embedding is not model.lm_head.weight:  # untied: a step reads only its tokens' rows of it
        total -= embedding.numel() * embedding.element_size()
    expert_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) in experts)
    if not expert_bytes:
        return total
    hit = 1 - (1 - model.config.num_experts_per_tok / model.config.num_experts) ** batch
    return total - expert_bytes * (1 - hit)


GREEDY = dict(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
SAMPLED = dict(temperature=0.6, top_k=20, top_p=0.95, repetition_penalty=1.1)  # the shipped generation_config's


def time_ours(model, ids, new, cuda_graph, sampling=GREEDY):
    """(prefill ms, decode steps per second) of one generate call (greedy, or with `sampling`)."""
    stamps = []
    sync()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=new, eos_token_id=[], cuda_graph=cuda_graph, seed=0, **sampling,
                   on_token=lambda t: (t.tolist(), stamps.append(time.perf_counter())))
    first = 2  # the first decode step captures the graph (or, eagerly, warms up): leave it out
    return (stamps[0] - start) * 1e3, (len(stamps) - 1 - first) / (stamps[-1] - stamps[first])


class Stamps:
    """A transformers streamer that only notes when each new token arrives."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if self.prompt_seen:  # the first put is the prompt
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def time_hf(model, ids, new, **kwargs):
    """(prefill ms, decode steps per second) of one greedy generate call, timed as ours is."""
    stamps = Stamps()
    sync()
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                   do_sample=False, pad_token_id=0, streamer=stamps, **kwargs)
    first = 2
    t = stamps.times
    return (t[0] - start) * 1e3, (len(t) - 1 - first) / (t[-1] - t[first])


def time_long_prefill(ours, tokens: int, device) -> float:
    """ms of ours' prefill of one random prompt of `tokens` tokens (logits of the last only)."""
    ids = torch.randint(0, ours.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1)).to(device)
    last_token = metadata.plain(1, tokens, device, last_only=True)
    positions = torch.arange(tokens, device=device)
    time_prefill(lambda: ours(ids, positions, last_token), repeats=2)  # warm up
    return time_prefill(lambda: ours(ids, positions, last_token))


def time_prefill(fn, repeats=5) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def model_name(name: str, args) -> str:
    return f"qwen3-{name}" + (f"-{args.quantization}" if getattr(args, "quantization", None) else "")


def decode_row(name, engine, batch, args, tp, prefill_ms, steps, ours, copy) -> dict:
    """One result row (docs/benchmarks/decode-h200.json's schema); weights as resident on this process,
    and the copy bandwidth of this run, which hbm_fraction divides by (an extended file keeps rows of
    other runs)."""
    weight_bytes = sum(t.numel() * t.element_size() for t in ours.parameters())
    sampling = SAMPLED if engine == "ours_sampled" else GREEDY
    return dict(model=model_name(name, args), engine=engine, batch=batch, prompt=args.prompt, new=args.new, tp=tp,
                **sampling, commit=args.commit, decode_tok_s=round(steps * batch, 1), prefill_ms=round(prefill_ms, 2),
                weight_GB=round(weight_bytes / 1e9, 3), copy_GBps=round(copy, 1),
                hbm_fraction=round(step_weight_bytes(ours, batch) * steps / 1e9 / copy, 3))


def write_json(path: Path, args, device, copy, results, prefills) -> None:
    """Write (or extend, replacing rows of the same model, engine, batch and tp) a result file."""
    summary = dict(date=datetime.date.today().isoformat(), commit=args.commit,
                   gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                   copy_GBps=round(copy, 1),
                   versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                                 triton=getattr(sys.modules.get("triton"), "__version__", None)),
                   results=results, prefill=prefills)
    if path.exists():  # keep rows of other models/engines from an earlier run
        old = json.loads(path.read_text())
        key = lambda r: (r["model"], r["engine"], r["batch"], r.get("tp", 1))  # noqa: E731
        fresh = {key(r) for r in results}
        summary["results"] = [r for r in old.get("results", []) if key(r) not in fresh] + results
        fresh_prefill = {r["model"] for r in prefills}
        summary["prefill"] = [r for r in old.get("prefill", []) if r["model"] not in fresh_prefill] + prefills
    path.write_text(json.dumps(summary, indent=1) + "\n")


def init_tp(args) -> tuple[torch.device, dist.ProcessGroup]:
    """Join torchrun's processes: NCCL on this rank's GPU, or gloo on CPU processes (fp32: a dry run
    of this script, not a measurement). Returns the device and a gloo group, for waits that need no
    GPU. Exits, saying why, unless --tp matches the processes and --engines are ours."""
    if int(os.environ.get("WORLD_SIZE", 1)) != args.tp:
        sys.exit(f"--tp {args.tp} runs under torchrun with as many processes: "
                 f"torchrun --standalone --nproc-per-node {args.tp} scripts/bench_generate.py --tp {args.tp} ...")
    if not set(args.engines) <= {"ours", "ours_eager"}:
        sys.exit("--tp measures our engines only: --engines ours [ours_eager]")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=30))
    else:  # CPU processes (gloo, fp32): a dry run of this script, not a measurement
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    return device, dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=30))  # waits without a GPU


def decode_rows_tp(name, ours, tp, args, device, copy, say) -> list[dict]:
    """Rows of our engines at each batch size, with tp ranks; the prompts are seeded by the batch
    size, so that tp=1 and tp=N decode the same ones."""
    rows = []
    for batch in args.batches:
        gen = torch.Generator().manual_seed(batch)  # the same prompts at tp=1 and tp=N
        ids = torch.randint(0, ours.config.vocab_size, (batch, args.prompt), generator=gen).to(device)
        for engine in args.engines:
            graph = engine == "ours" and device.type == "cuda"
            with torch.inference_mode():
                time_ours(ours, ids, 8, graph)  # warm up: Triton compiles, cuBLAS picks its kernels
                prefill_ms, steps = time_ours(ours, ids, args.new, graph)
            row = decode_row(name, engine, batch, args, tp, prefill_ms, steps, ours, copy)
            rows.append(row)
            say(json.dumps(row), flush=True)
    return rows


def bench_model_tp(name, args, device, dtype, copy, cpu_group, say) -> list[dict]:
    """Rows of model `name`: ours on rank 0's GPU alone (tp=1, the other ranks waiting), then split
    over every rank (tp=N), from the same random weights on every rank."""
    hf = build_hf(name, device, dtype)
    with torch.no_grad():  # rank 0's random weights on every rank, whatever each GPU's init drew
        for tensor in hf.state_dict().values():
            dist.broadcast(tensor, src=0)
    rows = []
    if dist.get_rank() == 0:
        ours = ours_from_hf(hf, args.norm)
        rows += decode_rows_tp(name, ours, 1, args, device, copy, say)
        ours = None
        torch.cuda.empty_cache()
    dist.barrier(group=cpu_group)
    tp = TensorParallel.from_default_group(Qwen3Config.from_dict(hf.config.to_dict()), device)
    ours = ours_from_hf(hf, args.norm, tp)
    hf = None
    torch.cuda.empty_cache()
    say(f"qwen3-{name}: {tp}", flush=True)
    return rows + decode_rows_tp(name, ours, args.tp, args, device, copy, say)


def main_tp(args) -> None:
    """--tp N under torchrun: tp=1 on rank 0's GPU, then tp=N over all, in one run (module docstring)."""
    device, cpu_group = init_tp(args)
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    copy = copy_bandwidth_GBps(device)
    say(f"copy bandwidth {copy:.0f} GB/s; tensor parallel over {args.tp} GPUs", flush=True)
    if args.parity:
        try:
            say(json.dumps(parity(device, args.tp, cpu_group)), flush=True)
        except Exception as err:  # the same on every rank, as the code is: report it and measure still
            say(json.dumps(dict(parity="failed", error=f"{type(err).__name__}: {err}")), flush=True)
            dist.barrier(group=cpu_group)
    results = []
    for name in args.models:
        results += bench_model_tp(name, args, device, dtype, copy, cpu_group, say)
        torch.cuda.empty_cache()  # this model's part gone, before the next is built
    if rank == 0 and args.json:
        write_json(args.json, args, device, copy, results, [])
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["0.6b"], choices=list(CONFIGS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--engines", nargs="+", default=None,
                   help="default: ours ours_sampled ours_eager hf_eager hf_static_compile; with --tp: ours")
    p.add_argument("--hf-batches", nargs="+", type=int, default=None,
                   help="batch sizes at which transformers runs (default: all; its compile takes ~1 min each)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--long-prompt", type=int, default=2048, help="prefill-only comparison (0: skip)")
    p.add_argument("--norm", default="auto")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--json", type=Path, help="write (or extend, replacing rows of the same key) this file")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks, under torchrun with as many processes (see above); default 1")
    p.add_argument("--parity", action="store_true", help="with --tp: first check greedy tokens tp=N == tp=1 (fp32)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="ours with FP8 projections (see above); transformers stays bf16")
    return p.parse_args()


def quantize_ours(name, ours, args, device) -> float | None:
    """--quantization fp8: ours' projections quantized in place, as from_pretrained(quantization="fp8")
    quantizes them. Returns the long prefill's ms timed in bf16 first, for the comparison (None
    without --long-prompt)."""
    bf16_prefill_ms = None
    if args.long_prompt:  # bf16 first, for the comparison
        with torch.inference_mode():
            bf16_prefill_ms = time_long_prefill(ours, args.long_prompt, device)
    quantize_weights(ours, BLOCK, hold=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        ours_gb = sum(t.numel() * t.element_size() for t in ours.parameters()) / 1e9
        print(f"{model_name(name, args)}: {torch.cuda.memory_allocated(device) / 1e9:.2f} GB allocated with "
              f"transformers' bf16 model, {ours_gb:.2f} GB of it ours", flush=True)
    return bf16_prefill_ms


def time_engine(engine, hf, ours, ids, new, device) -> tuple[float, float]:
    """(prefill ms, decode steps per second) of one engine (module docstring) on prompts `ids`,
    after a warm-up call."""
    with torch.inference_mode():
        if engine.startswith("ours"):
            graph = engine != "ours_eager" and device.type == "cuda"
            sampling = SAMPLED if engine == "ours_sampled" else GREEDY
            time_ours(ours, ids, 8, graph, sampling)  # warm up: Triton compiles, cuBLAS picks kernels
            return time_ours(ours, ids, new, graph, sampling)
        kwargs = {"cache_implementation": "static"} if engine == "hf_static_compile" else {}
        time_hf(hf, ids, new, **kwargs)  # warm up: compiles the static-cache forward
        return time_hf(hf, ids, new, **kwargs)


def decode_rows(name, hf, ours, args, device, copy, gen) -> list[dict]:
    """Rows of every engine at each batch size (transformers' and ours_eager only at --hf-batches,
    where given), on random prompts drawn from `gen`."""
    rows = []
    for batch in args.batches:
        ids = torch.randint(0, ours.config.vocab_size, (batch, args.prompt), generator=gen).to(device)
        for engine in args.engines:
            if engine.startswith("hf") and args.hf_batches and batch not in args.hf_batches:
                continue
            if engine == "ours_eager" and batch not in (args.hf_batches or args.batches):
                continue
            prefill_ms, steps = time_engine(engine, hf, ours, ids, args.new, device)
            row = decode_row(name, engine, batch, args, 1, prefill_ms, steps, ours, copy)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def long_prefill_row(name, hf, ours, args, device, gen, bf16_prefill_ms) -> dict:
    """The prefill row: ms of ours' and transformers' (SDPA) prefill of one random --long-prompt
    prompt drawn from `gen`, each computing the logits of the last token only."""
    ids = torch.randint(0, ours.config.vocab_size, (1, args.long_prompt), generator=gen).to(device)
    positions = torch.arange(args.long_prompt, device=device)
    last_token = metadata.plain(1, args.long_prompt, device, last_only=True)  # its logits only, as HF's
    with torch.inference_mode():
        mask = torch.ones_like(ids)
        row = dict(model=model_name(name, args), prompt=args.long_prompt, commit=args.commit,
                   ours_ms=round(time_prefill(lambda: ours(ids[0], positions, last_token)), 2),
                   hf_sdpa_ms=round(time_prefill(lambda: hf(ids, attention_mask=mask, logits_to_keep=1)), 2))
        if bf16_prefill_ms is not None:
            row["ours_bf16_ms"] = round(bf16_prefill_ms, 2)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    args = parse_args()
    if args.tp > 1:
        args.engines = args.engines or ["ours"]
        main_tp(args)
        return
    args.engines = args.engines or ["ours", "ours_sampled", "ours_eager", "hf_eager", "hf_static_compile"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    copy = copy_bandwidth_GBps(device)
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    results, prefills = [], []
    for name in args.models:
        hf, ours = build(name, device, dtype, args.norm)
        gen = torch.Generator().manual_seed(0)  # the decode prompts, then the long one
        bf16_prefill_ms = quantize_ours(name, ours, args, device) if args.quantization else None
        results += decode_rows(name, hf, ours, args, device, copy, gen)
        if args.long_prompt:
            prefills.append(long_prefill_row(name, hf, ours, args, device, gen, bf16_prefill_ms))
        hf = ours = None  # free this model's memory before the next is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, args, device, copy, results, prefills)


if __name__ == "__main__":
    main()
