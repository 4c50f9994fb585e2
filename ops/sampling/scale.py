"""The first pass of sampling over each row's logits: its penalties on the tokens it has seen and
its temperature, as transformers applies them, into float32, with what the later steps need of
the whole row summed up per chunk in the same pass.

    x, chunks = scaled_logits(logits, rows, params, seeds, steps, seen)

logits [B, V] (any float dtype) belong to sampler rows `rows` [B] of the per-row tables
(ops/sampling/__init__.py): params [R, len(PARAMS)], seeds and steps [R], seen [R, V] bool (None:
no penalties). A seen token's logit is divided by the repetition penalty when positive and
multiplied when negative (transformers' RepetitionPenaltyLogitsProcessor), then the presence
penalty is subtracted; every logit is then divided by the temperature (a greedy row's, 0, by 1).

A program per chunk of BLOCK tokens of a row (a batch of one row still fills the GPU) writes its
x and, in `chunks` ([B, C] each): the chunk's maximum, its sum of exp(x - maximum), its argmax
(the first on ties, as torch's), and the winner of the exponential race over its tokens (x_i -
log E_i, the clocks of ops/sampling/noise.py; sampled rows only). ops/sampling/candidates.py
combines them into the row's log-sum-exp, argmax and race winner over the whole vocabulary.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .noise import row_key_kernel, uniform_kernel
from .params import PARAMS

BLOCK = 4096
T, REPETITION, PRESENCE = (PARAMS.index(name) for name in ("temperature", "repetition_penalty", "presence_penalty"))


@dataclass
class Chunks:
    """Each chunk's summary of scaled rows: [B, C] tensors, C = cdiv(V, BLOCK) chunks per row."""

    max: torch.Tensor  # float32
    sum_exp: torch.Tensor  # float32: sum of exp(x - max) over the chunk
    argmax: torch.Tensor  # int64 token id
    race: torch.Tensor  # float32: the race's best value in the chunk (-inf for a greedy row)
    winner: torch.Tensor  # int64 token id of that value


@triton.jit
def _scale_kernel(LOGITS, stride_l, ROWS, PARAMS, n_params, SEEDS, STEPS, SEEN, X, MAX, SUM, ARGMAX, RACE, WINNER,
                  V, C, HAS_SEEN: tl.constexpr, T: tl.constexpr, REPETITION: tl.constexpr,
                  PRESENCE: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    row = tl.load(ROWS + b)
    temperature = tl.load(PARAMS + row * n_params + T)
    v = c * BLOCK + tl.arange(0, BLOCK)
    ok = v < V
    x = tl.load(LOGITS + b * stride_l + v, mask=ok, other=float("-inf")).to(tl.float32)
    if HAS_SEEN:
        repetition = tl.load(PARAMS + row * n_params + REPETITION)
        presence = tl.load(PARAMS + row * n_params + PRESENCE)
        seen = tl.load(SEEN + row * V + v, mask=ok, other=0) != 0
        x = tl.where(seen, tl.where(x < 0, x * repetition, x / repetition) - presence, x)
    x = x / tl.where(temperature > 0, temperature, 1.0)
    tl.store(X + b * V + v, x, mask=ok)
    m = tl.max(x, axis=0)
    out = b * C + c
    tl.store(MAX + out, m)
    tl.store(SUM + out, tl.where(m > float("-inf"), tl.sum(tl.exp(x - m), axis=0), 0.0))  # all -inf: nothing
    tl.store(ARGMAX + out, c * BLOCK + tl.argmax(x, axis=0))
    race_best = tl.full((), float("-inf"), tl.float32)
    race_winner = tl.full((), 0, tl.int32) + c * BLOCK
    if temperature > 0:
        key = row_key_kernel(tl.load(SEEDS + row), tl.load(STEPS + row))
        race = tl.where(ok, x - tl.log(-tl.log(uniform_kernel(key, v))), float("-inf"))
        race_best = tl.max(race, axis=0)
        race_winner = c * BLOCK + tl.argmax(race, axis=0)
    tl.store(RACE + out, race_best)
    tl.store(WINNER + out, race_winner)


@torch.library.custom_op("qwen3_ops::scaled_logits", mutates_args=("x", "chunk_max", "chunk_sum", "chunk_argmax",
                                                                   "chunk_race", "chunk_winner"))
def _scaled_logits_op(logits: torch.Tensor, rows: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor,
                      steps: torch.Tensor, seen: torch.Tensor | None, x: torch.Tensor, chunk_max: torch.Tensor,
                      chunk_sum: torch.Tensor, chunk_argmax: torch.Tensor, chunk_race: torch.Tensor,
                      chunk_winner: torch.Tensor) -> None:
    B, V = logits.shape
    C = chunk_max.shape[1]
    if B:
        _scale_kernel[(B, C)](logits, logits.stride(0), rows, params, params.shape[1], seeds, steps,
                              seen if seen is not None else rows, x, chunk_max, chunk_sum, chunk_argmax, chunk_race,
                              chunk_winner, V, C, HAS_SEEN=seen is not None, T=T, REPETITION=REPETITION,
                              PRESENCE=PRESENCE, BLOCK=BLOCK, num_warps=8)


@_scaled_logits_op.register_fake
def _(logits, rows, params, seeds, steps, seen, x, chunk_max, chunk_sum, chunk_argmax, chunk_race, chunk_winner):
    return None


def scaled_logits(logits: torch.Tensor, rows: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor,
                  steps: torch.Tensor, seen: torch.Tensor | None) -> tuple[torch.Tensor, Chunks]:
    """(x [B, V] float32, its Chunks): see the module. Device-side only: a CUDA graph captures it."""
    B, V = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must have unit stride along the vocabulary")
    C = triton.cdiv(V, BLOCK)
    x = torch.empty(B, V, dtype=torch.float32, device=logits.device)
    chunks = Chunks(*(torch.empty(B, C, dtype=dtype, device=logits.device)
                      for dtype in (torch.float32, torch.float32, torch.long, torch.float32, torch.long)))
    _scaled_logits_op(logits, rows, params, seeds, steps, seen, x, chunks.max, chunks.sum_exp, chunks.argmax,
                      chunks.race, chunks.winner)
    return x, chunks


def scaled_logits_reference(logits: torch.Tensor, rows: torch.Tensor, params: torch.Tensor,
                            seen: torch.Tensor | None) -> torch.Tensor:
    """x [B, V] float32 of scaled_logits, in torch operations."""
    x = logits.float()
    p = params[rows]
    if seen is not None:
        seen = seen[rows]
        repetition, presence = p[:, REPETITION, None], p[:, PRESENCE, None]
        x = torch.where(seen, torch.where(x < 0, x * repetition, x / repetition) - presence, x)
    temperature = p[:, T, None]
    return x / torch.where(temperature > 0, temperature, 1.0)
