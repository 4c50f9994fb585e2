"""Tensor parallelism over torch.distributed: which part of each weight a rank holds, and the
collectives that put the ranks' partial results together.

Megatron's layout over N ranks (rank r), for a dense Qwen3:
- attention: q_proj's rows of query heads [r H/N, (r+1) H/N) and k_proj/v_proj's rows of the
  key/value heads those queries read (column-parallel): K/N heads each where N divides K, else
  one head, replicated over the N/K ranks whose queries share it. q_norm/k_norm whole. o_proj's
  columns of the rank's query heads (row-parallel), its bias on rank 0 only, so that the sum
  adds it once -> all-reduce.
- MLP: gate_proj/up_proj rows [r F/N, (r+1) F/N) (column-parallel), down_proj those columns
  (row-parallel) -> all-reduce.
- embed_tokens: vocabulary rows [r V/N, (r+1) V/N); a rank looks up the ids it holds and gives
  zeros for the others -> all-reduce (each id's row comes from the one rank that holds it).
- lm_head: the same vocabulary rows (tied or not); each rank's logits of its tokens, gathered
  into the full [.., V] on every rank (`gather_vocab`).
- norms: whole on every rank, which holds the whole residual stream [B, T, D].
Every rank runs the same forward on the same tokens and ends with the same full logits, so the
same sampling (same seed) gives the same tokens everywhere. Qwen3-MoE is refused: its experts
would need expert parallelism, which is not implemented yet.

`TensorParallel` is the one object the model's layers take (`tp`, None without parallelism).
"""

import os
import secrets
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import Qwen3Config

# All-reduces up to this size take the symmetric-memory path on CUDA (see symmetric_all_reduce):
# a decode step's hidden states (batch 64 x 4096 bf16 = 512 KiB) and a few rows of logits.
SYMMETRIC_BYTES = 2 * 2**20


def check_splits(config: Qwen3Config, size: int) -> None:
    """ValueError unless the model divides evenly over `size` ranks (naming each count that does not)."""
    H, K, F_, V = (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size,
                   config.vocab_size)
    problems = [f"{name}={n} is not a multiple of {size}"
                for name, n in (("num_attention_heads", H), ("intermediate_size", F_), ("vocab_size", V))
                if n % size]
    if K % size and size % K:
        problems.append(f"num_key_value_heads={K} neither splits evenly over {size} ranks nor divides {size} "
                        "(for replicated key/value heads)")
    if problems:
        raise ValueError(f"cannot split this model over {size} tensor-parallel ranks: " + "; ".join(problems))


class TensorParallel:
    """This process's place in the default process group, which the model is split over: its
    rank, the group's size, and, on CUDA, the buffer of the symmetric-memory all-reduce."""

    def __init__(self, rank: int, size: int, device: torch.device):
        self.rank, self.size = rank, size
        self.device = device  # where the collectives' tensors live: the model's device
        # The default group, by name: collectives below pass no group. No reference to the group
        # object is kept, so that destroy_process_group() frees it (one freed later, at exit, can abort).
        self.group_name = dist.group.WORLD.group_name
        self.symmetric: SymmetricBuffer | None = None  # set by use_symmetric_memory where it works

    @classmethod
    def from_default_group(cls, config: Qwen3Config, device: torch.device) -> "TensorParallel":
        """Refuses a model that cannot be split, a missing process group, or a backend that
        cannot reach `device` (NCCL for CUDA, gloo for the CPU)."""
        if config.num_experts:
            raise ValueError("tensor_parallel=True: this is a Qwen3-MoE checkpoint (num_experts="
                             f"{config.num_experts}), whose experts need expert parallelism, which is not "
                             "supported yet; load it on one device")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("tensor_parallel=True needs an initialized torch.distributed default process group: "
                             "launch with torchrun and call torch.distributed.init_process_group() first "
                             "('nccl' for CUDA devices, 'gloo' for the CPU)")
        size = dist.get_world_size()
        check_splits(config, size)
        backend = dist.get_backend()
        if (device.type == "cuda" and "nccl" not in backend) or (device.type == "cpu" and "gloo" not in backend):
            raise ValueError(f"tensor_parallel=True on {device} needs the "
                             f"{'nccl' if device.type == 'cuda' else 'gloo'} backend; the process group uses {backend}")
        return cls(dist.get_rank(), size, device)

    def __repr__(self) -> str:
        path = ""
        if self.symmetric is not None:
            path = f"symmetric memory ({'one kernel' if self.symmetric.copy_in_kernel else 'copy + kernel'}) + "
        return f"TensorParallel(rank={self.rank}, size={self.size}, all-reduce: {path}{dist.get_backend()})"

    # ------------------------------------------------------------------ what this rank holds

    def heads(self, config: Qwen3Config) -> tuple[int, int]:
        """(query heads, key/value heads) held by this rank."""
        return config.num_attention_heads // self.size, max(config.num_key_value_heads // self.size, 1)

    def shard(self, what: str, config: Qwen3Config) -> slice:
        """This rank's rows of a column-parallel weight (its columns of a row-parallel one) along
        the split dimension: what = "q_heads" | "kv_heads" | "ffn" | "vocab"."""
        hd = config.head_dim
        if what == "q_heads":
            n = config.num_attention_heads // self.size * hd
            return slice(self.rank * n, (self.rank + 1) * n)
        if what == "kv_heads":
            K = config.num_key_value_heads
            count = max(K // self.size, 1)
            first = self.rank * K // self.size  # replicated (K < size): head rank // (size / K)
            return slice(first * hd, (first + count) * hd)
        n = {"ffn": config.intermediate_size, "vocab": config.vocab_size}[what] // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def checkpoint_index(self, key: str, config: Qwen3Config) -> tuple[slice, ...] | None:
        """The index of this rank's part of checkpoint tensor `key` (for safetensors'
        `get_slice(key)[index]`), or None where the rank holds none of it (o_proj's bias off rank 0)."""
        module, kind = key.split(".")[-2:]
        if module == "o_proj" and kind == "bias":
            return (slice(None),) if self.rank == 0 else None
        split = SPLITS.get(module)
        if split is None:  # norms: whole
            return (slice(None),)
        dim, what = split
        if kind == "bias" or dim == 0:
            return (self.shard(what, config),)
        return (slice(None), self.shard(what, config))

    # ------------------------------------------------------------------ collectives

    def use_symmetric_memory(self, dtype: torch.dtype) -> None:
        """Set up the symmetric-memory all-reduce for activations of `dtype` on CUDA, if every
        rank can; otherwise (CPU, fp16, an older torch, no P2P) all-reduces stay on NCCL/gloo.
        A collective: every rank calls it, after the model is on its device."""
        if self.size == 1 or self.device.type != "cuda" or dtype not in (torch.float32, torch.bfloat16):
            return
        self.symmetric = symmetric_buffer(self, dtype)

    def shared_seed(self) -> int:
        """A seed drawn on rank 0 and given to every rank: unseeded sampling then draws the same
        tokens on all ranks (each samples from the same logits with the same generator)."""
        seed = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0], device=self.device)
        dist.broadcast(seed, src=0)
        return int(seed.item())


# Which dimension of each checkpoint tensor is split, and by what (tensors not named: whole).
SPLITS = {
    "q_proj": (0, "q_heads"), "k_proj": (0, "kv_heads"), "v_proj": (0, "kv_heads"), "o_proj": (1, "q_heads"),
    "gate_proj": (0, "ffn"), "up_proj": (0, "ffn"), "down_proj": (1, "ffn"),
    "embed_tokens": (0, "vocab"), "lm_head": (0, "vocab"),
}


def all_reduce(x: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    """The sum of x over the ranks (x itself without tensor parallelism); every rank gets the same
    values. Small CUDA tensors take the symmetric-memory one-shot kernel where it was set up, the
    rest dist.all_reduce (NCCL on CUDA, gloo on the CPU). Both are captured by a CUDA graph. The
    choice depends only on the size, so all ranks take the same path."""
    if tp is None or tp.size == 1:
        return x
    symmetric = tp.symmetric
    if (symmetric is not None and x.dtype == symmetric.buffer.dtype and x.numel() <= symmetric.buffer.numel()
            and x.numel() * x.element_size() % 4 == 0):  # the kernel moves 4-byte words at least
        return symmetric_all_reduce(x, symmetric, tp.group_name)
    x = x.contiguous()
    dist.all_reduce(x)
    return x


def gather_vocab(logits: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    """Full logits [..., V] on every rank from each rank's vocabulary shard [..., V/N], in rank
    order. Written as an all-reduce of the shard placed among zeros (exact: every other term is
    zero) rather than an all-gather, so that a decode step's logits take the same fast path as
    its other collectives; it moves N times the bytes of an all-gather, which at a decode step's
    few rows costs less than NCCL's latency."""
    if tp is None or tp.size == 1:
        return logits
    n = logits.shape[-1]
    full = logits.new_zeros(*logits.shape[:-1], n * tp.size)
    full[..., tp.rank * n : (tp.rank + 1) * n] = logits
    return all_reduce(full, tp)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [start, start + V/N) of the embedding matrix. Ids outside them look up
    zeros, and the all-reduce adds the one rank's row that holds each id."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel):
        super().__init__(vocab_size // tp.size, dim)
        self.tp = tp
        self.start = tp.rank * (vocab_size // tp.size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        held = (local >= 0) & (local < self.num_embeddings)
        h = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)  # [B, T, D]
        return all_reduce(h.masked_fill(~held[..., None], 0), self.tp)


def resolve_parallel_device(device: torch.device) -> torch.device:
    """Under torchrun, "cuda" without an index means this process's GPU, cuda:LOCAL_RANK (else the
    current one); it becomes the current device, where Triton and symmetric-memory kernels launch."""
    if device.type != "cuda":
        return device
    if device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    if device.index >= torch.cuda.device_count():
        raise ValueError(f"tensor parallel: this process's device {device} is not available: this machine has "
                         f"{torch.cuda.device_count()} CUDA GPU(s); run at most that many processes per node")
    torch.cuda.set_device(device)
    return device


# ------------------------------------------------------------------ symmetric memory
# PyTorch's symmetric-memory one-shot all-reduce: each rank copies its tensor into a buffer that
# every peer maps, and one kernel per rank reads all peers' buffers over NVLink (P2P loads) and
# adds them in rank order, between two barriers on signal pads. On two H200s an all-reduce of one
# token's hidden state (8 KiB) takes 7.5 us this way against NCCL's 20 us inside a CUDA graph, and
# a Qwen3-8B decode step has 74 of them. `torch.distributed._symmetric_memory` is underscore-
# prefixed (private, it may change between releases); the issue asks for it, so it is used in these
# two functions only, with dist.all_reduce as the fallback. NVLink multicast is switched off on our
# machines (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1): the
# multimem/multicast ops are never called.


@dataclass
class SymmetricBuffer:
    buffer: torch.Tensor  # SYMMETRIC_BYTES, rendezvoused: every peer maps it
    copy_in_kernel: bool  # one_shot_all_reduce_copy works here: the copy into the buffer is the kernel's first step


def symmetric_buffer(tp: TensorParallel, dtype: torch.dtype) -> SymmetricBuffer | None:
    """The rendezvoused buffer, checked by an all-reduce against the known sum; None, with a note
    on stderr, if any rank fails at any step (then every rank uses dist.all_reduce). The ranks
    agree after each step, so that none enters a collective step that another skipped."""
    problem, buffer, symm_mem = None, None, None

    def attempt(step) -> bool:  # step() on every rank; whether it succeeded on all of them
        nonlocal problem
        problem = None
        try:
            step()
        except Exception as err:  # an older torch, a build without it, no P2P: each fails its own way
            problem = str(err) or type(err).__name__  # not the exception: its traceback would pin the frames
        flag = torch.tensor([int(problem is None)], device=tp.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def allocate() -> None:
        nonlocal buffer, symm_mem
        from torch.distributed import _symmetric_memory as symm_mem

        name = tp.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group") and not symm_mem.is_symm_mem_enabled_for_group(name):
            with warnings.catch_warnings():  # needed by older releases, a deprecated no-op need in newer ones
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(name)
        buffer = symm_mem.empty(SYMMETRIC_BYTES // dtype.itemsize, dtype=dtype, device=tp.device)

    def probe(symmetric: SymmetricBuffer) -> None:
        x = torch.full((4096,), float(tp.rank + 1), dtype=dtype, device=tp.device)
        if not bool((symmetric_all_reduce(x, symmetric, tp.group_name) == tp.size * (tp.size + 1) / 2).all()):
            raise RuntimeError("a probe all-reduce gave a wrong sum")

    if attempt(allocate) and attempt(lambda: symm_mem.rendezvous(buffer, tp.group_name)):
        for copy_in_kernel in (True, False):  # one kernel where this torch has it, else a copy and the kernel
            symmetric = SymmetricBuffer(buffer, copy_in_kernel)
            if attempt(lambda: probe(symmetric)):
                return symmetric
    if tp.rank == 0:
        print(f"tensor parallel: the symmetric-memory all-reduce is unavailable ({problem or 'on another rank'}); "
              f"using {dist.get_backend()}", file=sys.stderr)
    return None


def symmetric_all_reduce(x: torch.Tensor, symmetric: SymmetricBuffer, group_name: str) -> torch.Tensor:
    """x summed over the ranks through the rendezvoused buffer (x.numel() <= its size)."""
    staged = symmetric.buffer[: x.numel()].view(x.shape)
    if symmetric.copy_in_kernel and x.is_contiguous() and x.storage_offset() == 0:  # aligned as the buffer
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x, "sum", group_name)
    staged.copy_(x)
    return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", group_name)
