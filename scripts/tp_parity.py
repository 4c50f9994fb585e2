"""bench_generate.py --tp N --parity: before the timings, whether greedy tokens at tp=N equal tp=1's,
on a small fp32 checkpoint that rank 0 writes and every rank loads through from_pretrained, whole
and split (the safetensors loader and its slicing rule, which the timings' models bypass).
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from qwen3 import Qwen3ForCausalLM  # noqa: E402

# --parity: a small model, fp32, split 4 + 1 heads per rank at tp=2 (GQA), untied vocabulary shards.
PARITY_CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
                     max_position_embeddings=1024, rope_theta=1_000_000.0, attention_bias=True)


def parity(device, tp_size: int, cpu_group) -> dict:
    """Greedy tokens of a small fp32 checkpoint, loaded by from_pretrained whole (tp=1) and split
    (tp=tp_size), on the fused Triton path with CUDA graphs, at batch 1 and 4; the same on every rank.
    (On the CPU, a dry run: the torch path, eagerly.)"""
    norm = "triton" if device.type == "cuda" else "torch"
    rank = dist.get_rank()
    directory = [tempfile.mkdtemp(prefix="tp-parity-") if rank == 0 else None]
    dist.broadcast_object_list(directory, src=0, group=cpu_group)
    if rank == 0:
        torch.manual_seed(0)
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**PARITY_CONFIG))
        with torch.no_grad():  # weights large enough that every layer moves the logits
            for name, param in hf.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1 + 0.2 * torch.randn_like(param))
                else:
                    param.normal_(0, 0.05)
        hf.save_pretrained(directory[0])
    dist.barrier(group=cpu_group)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, PARITY_CONFIG["vocab_size"], (b, 16), generator=gen).to(device) for b in (1, 4)]
    whole = Qwen3ForCausalLM.from_pretrained(directory[0], dtype=torch.float32, device=device, norm_impl=norm,
                                             progress=False)
    with torch.no_grad():
        whole_logits = whole(prompts[1])
    tp1 = [whole.generate(ids, max_new_tokens=32, temperature=0.0) for ids in prompts]
    del whole
    split = Qwen3ForCausalLM.from_pretrained(directory[0], dtype=torch.float32, device=device, norm_impl=norm,
                                             progress=False, tensor_parallel=True)
    with torch.no_grad():
        split_logits = split(prompts[1])
    tp2 = [split.generate(ids, max_new_tokens=32, temperature=0.0) for ids in prompts]
    symmetric = split.tp.symmetric is not None
    split.tp.symmetric = None  # again with every all-reduce through NCCL
    tp2_nccl = [split.generate(ids, max_new_tokens=32, temperature=0.0) for ids in prompts]
    dist.barrier(group=cpu_group)
    if rank == 0:
        shutil.rmtree(directory[0])
    mine = torch.cat([t.flatten() for t in tp2])
    everyone = [torch.empty_like(mine) for _ in range(tp_size)]
    dist.all_gather(everyone, mine)
    path = f"{norm}, {'CUDA graphs' if device.type == 'cuda' else 'eager'}"
    return dict(parity=f"greedy tp={tp_size} vs tp=1, fp32, {path}", batches=[1, 4],
                tokens_equal=all(torch.equal(a, b) for a, b in zip(tp1, tp2)),
                tokens_equal_nccl_only=all(torch.equal(a, b) for a, b in zip(tp1, tp2_nccl)),
                ranks_agree=all(torch.equal(everyone[0], t) for t in everyone),
                prefill_logits_max_abs_diff=float((split_logits - whole_logits).abs().max()),
                allreduce=("symmetric memory (small) + " if symmetric else "") + dist.get_backend())
