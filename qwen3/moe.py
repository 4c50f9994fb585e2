"""Qwen3-MoE's sparse MLP block: a router picks k of E experts per token; each is a SwiGLU MLP.

Shapes: N tokens (B * T), D hidden_size, E num_experts, k num_experts_per_tok,
I moe_intermediate_size.

The experts are held stacked, as transformers 5 holds them in memory: gate_up_proj [E, 2I, D]
(each expert's gate rows, then its up rows) and down_proj [E, D, I], the layout the fused kernel
reads. Checkpoints store one tensor per expert and projection (`experts.E.gate_proj.weight`,
[I, D]); `checkpoint_views` maps each such key to its slice of the stacked parameters, so the
loader copies straight into them.

Routing follows transformers' Qwen3MoeTopKRouter: logits in the activations' dtype, softmax in
fp32, top-k, optional renormalization to sum 1 (norm_topk_prob), weights cast back; where the
fused-MoE kernel runs, the steps after the logits are one Triton kernel (ops/moe/moe_route.py).
"""

import torch
from torch import nn

from ops.linear.gemv import gemv
from ops.moe.fused_moe import fused_moe, fused_moe_reference
from ops.moe.moe_route import moe_route

from .config import Qwen3Config
from .fp8 import dequantize
from .layers import fp8_scales

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # a checkpoint's tensors of one expert


def is_sparse_layer(config: Qwen3Config, layer_idx: int) -> bool:
    """Whether layer layer_idx's MLP is the sparse block (transformers' Qwen3MoeDecoderLayer rule)."""
    return (
        config.num_experts > 0
        and layer_idx not in config.mlp_only_layers
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


class Experts(nn.Module):
    """E SwiGLU MLPs, stacked. Parameter names and layouts are transformers 5's in-memory ones, so
    a transformers block's state_dict loads as is; a checkpoint's per-expert keys go through
    `checkpoint_views` (the loader) or the load_state_dict pre-hook (`stack_experts`)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        E, D, I = config.num_experts, config.hidden_size, config.moe_intermediate_size  # noqa: E741
        self.num_experts, self.intermediate_size = E, I
        # nn.Linear's default init, per expert (kaiming-uniform bound 1/sqrt(fan_in)).
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D).uniform_(-(D**-0.5), D**-0.5))
        self.down_proj = nn.Parameter(torch.empty(E, D, I).uniform_(-(I**-0.5), I**-0.5))
        self.register_load_state_dict_pre_hook(stack_experts)

    def checkpoint_views(self, name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """{checkpoint key relative to this module ("3.up_proj.weight"): its slice of param}
        for param = getattr(self, name): a weight, or an FP8 weight's block scales (name
        "gate_up_proj_scale_inv", key "3.up_proj.weight_scale_inv"; qwen3/quantized.py)."""
        projection, scales, _ = name.partition("_scale_inv")
        kind = "weight_scale_inv" if scales else "weight"
        if projection == "down_proj":
            return {f"{e}.down_proj.{kind}": param[e] for e in range(self.num_experts)}
        half = param.shape[1] // 2  # I rows of the gate, then I of up (of scales: a row per block)
        views = {}
        for e in range(self.num_experts):
            views[f"{e}.gate_proj.{kind}"] = param[e, :half]
            views[f"{e}.up_proj.{kind}"] = param[e, half:]
        return views

    def fp8_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[int, int] | None]:
        """(gate_up scales, down scales, block) of experts held in FP8; (None, None, None) otherwise."""
        s13, block = fp8_scales(self, "gate_up_proj")
        s2, _ = fp8_scales(self, "down_proj")
        return s13, s2, block

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj, down_proj) in dtype, the activations': FP8 ones dequantized (torch ops)."""
        s13, s2, block = self.fp8_scales()
        if block is None:
            return self.gate_up_proj, self.down_proj
        return (torch.stack([dequantize(q, s, block, dtype) for q, s in zip(self.gate_up_proj, s13)]),
                torch.stack([dequantize(q, s, block, dtype) for q, s in zip(self.down_proj, s2)]))


def stack_experts(module: Experts, state_dict: dict, prefix: str, *args) -> None:
    """A load_state_dict pre-hook: per-expert tensors (a checkpoint's layout) stacked into
    gate_up_proj and down_proj, so that a hub-layout state dict loads too."""
    for kind, suffix in (("weight", ""), ("weight_scale_inv", "_scale_inv")):  # an FP8 checkpoint's scales too
        keys = {p: [f"{prefix}{e}.{p}.{kind}" for e in range(module.num_experts)] for p in PROJECTIONS}
        if all(key in state_dict for p in PROJECTIONS for key in keys[p]):
            gate = [state_dict.pop(key) for key in keys["gate_proj"]]
            up = [state_dict.pop(key) for key in keys["up_proj"]]
            state_dict[f"{prefix}gate_up_proj{suffix}"] = torch.stack([torch.cat(pair) for pair in zip(gate, up)])
            state_dict[f"{prefix}down_proj{suffix}"] = torch.stack([state_dict.pop(key) for key in keys["down_proj"]])


class SparseMoeBlock(nn.Module):
    """Router (`gate`, checkpoint key mlp.gate.weight) + experts: sum over a token's top-k experts of
    routing weight x expert(x). Called like MLP: (x [N, D], fused, residual, norm) -> ([N, D], residual)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config)

    def route(self, x: torch.Tensor, kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] in x's dtype, expert ids [N, k]) for x [N, D]. Device-side ops only (topk
        has a fixed output shape): no host sync. kernel: the top-k in one Triton kernel
        (ops/moe/moe_route.py), and one token's logits from the GEMV kernel."""
        if not kernel:
            logits = self.gate(x)  # [N, E] in x's dtype
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights.to(logits.dtype), ids
        logits = gemv(x, self.gate.weight) if x.shape[0] == 1 else self.gate(x)
        return moe_route(logits, self.top_k, self.norm_topk_prob)

    def forward(self, x: torch.Tensor, fused: bool = False, residual: torch.Tensor | None = None,
                norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the block's output for norm(x + residual) [N, D], x + residual), as MLP's forward; the
        router and the experts read the normalized tokens. The Triton kernel (ops/moe/fused_moe.py)
        on the fused path, and on CUDA whenever no gradient is needed, whatever the kernels' choice:
        the reference loop asks the host which experts were hit, which a CUDA graph cannot capture.
        Otherwise transformers' loop over the experts that received tokens (differentiable)."""
        if norm is not None:
            x, residual = norm(x, residual) if residual is not None else (norm(x), x)
        else:
            residual = x
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
        kernel = fused or (x.is_cuda and not needs_grad)
        weights, ids = self.route(x, kernel)
        if kernel:
            s13, s2, block = self.experts.fp8_scales()
            out = fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, s13, s2, block)
        else:
            out = fused_moe_reference(x, *self.experts.dequantized(x.dtype), weights, ids)
        return out, residual

