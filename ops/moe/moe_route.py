"""A mixture-of-experts router's top-k in one kernel, as transformers' Qwen3-MoE router computes it:

    weights, ids = moe_route(logits, top_k, norm_topk_prob)
    # logits [N, E] (the router's output, in the activations' dtype) -> weights [N, k] in that
    # dtype, ids [N, k] int64

softmax over the E logits in fp32, the k largest probabilities, divided by their sum when
norm_topk_prob, rounded to the logits' dtype. Among equal probabilities (bf16 logits tie often)
this kernel takes the highest expert id first; torch.topk promises no order for ties (on the CPU
it mostly takes the highest too), so where they tie another expert of the same weight may win. In torch
ops that is four to six kernels per layer (softmax, topk's two, the sum, the division, the
cast); here it is one.
"""

import torch
import triton
import triton.language as tl

from ..triton_helpers import use_pdl, wait_for_prior_kernels

__all__ = ["moe_route"]


@triton.jit
def _route_kernel(LOGITS, WEIGHTS, IDS, E, TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_E: tl.constexpr,
                  NORM: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior_kernels(PDL)
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(LOGITS + n * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < E, p, -1.0)  # lanes past E: below every probability (one that underflows to 0 too)
    j = tl.arange(0, K_POW2)
    top_p = tl.zeros([K_POW2], tl.float32)
    top_id = tl.zeros([K_POW2], tl.int64)
    for r in tl.static_range(TOP_K):  # k rounds of: the largest left, the highest id among equals
        best = tl.max(p, axis=0)
        pick = tl.max(tl.where(p == best, e, -1), axis=0)
        top_p = tl.where(j == r, best, top_p)
        top_id = tl.where(j == r, pick.to(tl.int64), top_id)
        p = tl.where(e == pick, -1.0, p)  # probabilities are >= 0: never picked again
    if NORM:
        top_p = top_p / tl.sum(top_p, axis=0)  # rounds past TOP_K hold 0
    tl.store(WEIGHTS + n * TOP_K + j, top_p.to(WEIGHTS.dtype.element_ty), mask=j < TOP_K)
    tl.store(IDS + n * TOP_K + j, top_id, mask=j < TOP_K)


@torch.library.custom_op("qwen3_ops::moe_route", mutates_args=())
def _moe_route_op(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    N, E = logits.shape
    weights = logits.new_empty(N, top_k)
    ids = torch.empty(N, top_k, dtype=torch.long, device=logits.device)
    if N:
        pdl = use_pdl(logits.device)
        _route_kernel[(N,)](logits, weights, ids, E, TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k),
                            BLOCK_E=triton.next_power_of_2(E), NORM=norm_topk_prob, PDL=pdl, num_warps=4,
                            launch_pdl=pdl)
    return weights, ids


@_moe_route_op.register_fake
def _(logits, top_k, norm_topk_prob):
    N = logits.shape[0]
    return logits.new_empty(N, top_k), logits.new_empty(N, top_k, dtype=torch.long)


def moe_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] in logits' dtype, expert ids [N, k]) of router logits [N, E] (see the module)."""
    if logits.dim() != 2 or not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"moe_route takes logits [N, E] and 1 <= top_k <= E, got {tuple(logits.shape)}, {top_k}")
    return _moe_route_op(logits.contiguous(), top_k, norm_topk_prob)
