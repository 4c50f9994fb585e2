"""What each rank does in tests/test_tensor_parallel.py's multi-process runs. This module imports
torch and qwen3 only (not transformers), so that a spawned process starts quickly."""

import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwen3 import Qwen3ForCausalLM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, *args, backend: str = "gloo", world: int = 2) -> None:
    """fn(rank, *args) in `world` spawned processes joined in a default process group on 127.0.0.1."""
    mp.spawn(_rank_main, args=(fn, free_port(), world, backend, args), nprocs=world, join=True)


def _rank_main(rank: int, fn, port: int, world: int, backend: str, args) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def cpu_jobs(rank: int, jobs: list[dict], out: Path) -> None:
    """Each job loads its checkpoint split over the ranks and records, in out/rank{rank}.pt:
    the logits of job["ids"], greedy tokens, (job["sample"]) sampled tokens with and without a
    seed, the number of parameters held, or the ValueError's message if loading is refused."""
    results = {}
    for job in jobs:
        try:
            model = Qwen3ForCausalLM.from_pretrained(job["path"], dtype=torch.float32, device="cpu",
                                                     **job["load"], progress=False, tensor_parallel=True)
        except ValueError as err:
            results[job["name"]] = {"error": str(err)}
            continue
        ids = job["ids"]
        with torch.no_grad():
            logits = model(ids)
        result = {
            "logits": logits,
            "greedy": model.generate(ids, max_new_tokens=job["new"], temperature=0.0),
            "params": sum(p.numel() for p in model.parameters()),
        }
        if job.get("sample"):
            result["seeded"] = model.generate(ids, max_new_tokens=job["new"], temperature=1.0, top_k=50, seed=7)
            result["unseeded"] = model.generate(ids, max_new_tokens=job["new"], temperature=1.0)
        results[job["name"]] = result
    torch.save(results, out / f"rank{rank}.pt")


def gpu_greedy(rank: int, path: str, prompts: list[torch.Tensor], new: int, out: Path) -> None:
    """Greedy tokens of each prompt batch in fp32 on the fused path with CUDA graphs: the whole
    model on this rank's GPU (tp=1), then the model split over the ranks (tp=2), its all-reduces
    through symmetric memory where it set up, then through NCCL alone (both inside the graph)."""
    device = torch.device("cuda", rank)
    whole = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, device=device, norm_impl="triton",
                                             progress=False)
    tp1 = [whole.generate(ids.to(device), max_new_tokens=new, temperature=0.0).cpu() for ids in prompts]
    del whole
    split = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, device="cuda", norm_impl="triton",
                                             progress=False, tensor_parallel=True)
    tp2 = [split.generate(ids.to(device), max_new_tokens=new, temperature=0.0, cuda_graph=True).cpu()
           for ids in prompts]
    symmetric = split.tp.symmetric is not None
    split.tp.symmetric = None  # every all-reduce through NCCL
    tp2_nccl = [split.generate(ids.to(device), max_new_tokens=new, temperature=0.0, cuda_graph=True).cpu()
                for ids in prompts]
    torch.save({"tp1": tp1, "tp2": tp2, "tp2_nccl": tp2_nccl, "symmetric": symmetric}, out / f"rank{rank}.pt")
