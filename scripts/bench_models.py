"""The benchmarks' models: the real Qwen3 architectures (CONFIGS) as transformers builds them with
its random init, on the device (nothing is downloaded or written to disk), and ours with the same
weights. The copy takes the place of from_pretrained, which would need a checkpoint on disk; it
follows the loader's keys and, with tensor parallelism, its slicing rule (qwen3/parallel.py).

bench_generate.py measures these; bench_engine.py, bench_serve.py, bench_structured.py and
profile_decode.py take them through it (`from bench_generate import build, CONFIGS`).
"""

import re
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from qwen3 import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from qwen3.loader import empty_model  # noqa: E402
from qwen3.parallel import TensorParallel  # noqa: E402

CONFIGS = {  # the real Qwen3 architectures
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                 max_position_embeddings=40960, rope_theta=1_000_000.0),
    "8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
               max_position_embeddings=40960, rope_theta=1_000_000.0),
    "30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                    max_position_embeddings=40960, rope_theta=1_000_000.0, num_experts=128,
                    num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
}


def hf_tensor(weights: dict, key: str) -> torch.Tensor:
    """The tensor of checkpoint key `key` in a transformers model's state dict. transformers 5 holds
    a Qwen3-MoE layer's experts stacked (experts.gate_up_proj [E, 2I, D], experts.down_proj
    [E, D, I]) and writes one tensor per expert only when saving: slice those out."""
    if key in weights:
        return weights[key]
    stem, expert, proj = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", key).groups()
    if proj == "down":
        return weights[f"{stem}.down_proj"][int(expert)]
    gate_up = weights[f"{stem}.gate_up_proj"][int(expert)]
    return gate_up.chunk(2)[proj == "up"]


def build_hf(name: str, device, dtype):
    """transformers' model at CONFIGS[name] with its random init (seed 0) on the device. Built in
    `dtype` directly (no fp32 copy first: 30B-A3B's would not fit beside the bf16 one)."""
    torch.manual_seed(0)
    moe = "num_experts" in CONFIGS[name]
    hf_config = (transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config)(**CONFIGS[name])
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = (transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM)(hf_config)
    finally:
        torch.set_default_dtype(default_dtype)
    return hf.to(dtype).eval()


def ours_from_hf(hf, norm: str, tp: TensorParallel | None = None) -> Qwen3ForCausalLM:
    """Ours with hf's weights on hf's device; with tp, this rank's part (its slices, by the
    loader's rule). The copy takes the place of from_pretrained, which would need a checkpoint on disk."""
    weight = hf.get_output_embeddings().weight
    config = Qwen3Config.from_dict(hf.config.to_dict(), norm_impl=norm)
    ours = empty_model(Qwen3ForCausalLM, config, weight.dtype, weight.device, tp)
    weights = hf.state_dict()
    with torch.no_grad():
        for key, tensor in ours.checkpoint_tensors().items():
            index = tp.checkpoint_index(key, config) if tp else (slice(None),)
            tensor.copy_(hf_tensor(weights, key)[index])
    if tp is not None:  # as from_pretrained(tensor_parallel=True) leaves it
        ours.requires_grad_(False)
        tp.use_symmetric_memory(weight.dtype)
    return ours.eval()


def build(name: str, device, dtype, norm: str):
    """(transformers model, ours) with the same random weights, both on the device."""
    hf = build_hf(name, device, dtype)
    return hf, ours_from_hf(hf, norm)
