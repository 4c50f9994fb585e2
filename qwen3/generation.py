"""Prefill + decode loop over a KV cache: padded batches, per-row stopping, streaming.

Prompts of different lengths come padded (left or right) with an attention mask (1 = token,
0 = padding). Each row's positions count its own tokens only, and its cache row holds only
them, so a row generates what it would alone.

On CUDA the decode step is captured once in a CUDA graph and replayed for every later token:
one launch for the whole model instead of a few hundred. The host never waits for the GPU
inside the loop, except to hand tokens to `on_token` (one step behind, while the GPU computes
the next) and to check every few steps whether all rows have stopped.

Under tensor parallelism every rank runs this same loop: the forward ends with the full logits
on every rank, and each samples from them with the same seed (drawn on rank 0 when the caller
gives none), so all ranks choose the same tokens, stop at the same step and stay in step for
the next collective. The captured decode step holds the all-reduces.
"""

from collections.abc import Callable

import torch

from .cache import KVCache
from .model import check_input_ids
from .sampling import SamplingParams, next_token

# What `model.generate` uses when neither the caller nor the checkpoint's generation_config says.
LIBRARY_DEFAULTS = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0)
STOP_CHECK_EVERY = 8  # decode steps between checks (each a host-device sync) that every row has stopped


def sampling_params(generation_config: dict, **overrides) -> SamplingParams:
    """Caller's values over the checkpoint's generation_config.json over the library defaults.
    A generation_config with do_sample false means greedy, as in transformers."""
    values = dict(LIBRARY_DEFAULTS)
    values.update({k: generation_config[k] for k in LIBRARY_DEFAULTS if generation_config.get(k) is not None})
    if generation_config.get("do_sample") is False:
        values["temperature"] = 0.0
    values.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(**values)


def resolve_eos(eos_token_id: int | list[int] | None, generation_config: dict, config) -> list[int]:
    """Stop ids: the caller's, else generation_config.json's, else config.json's (maybe none)."""
    eos = eos_token_id
    if eos is None:
        eos = generation_config.get("eos_token_id", config.eos_token_id)
    return [eos] if isinstance(eos, int) else list(eos or [])


def resolve_cuda_graph(cuda_graph: bool | None, device: torch.device) -> bool:
    """Whether decode steps replay from CUDA graphs: the caller's choice, by default on CUDA."""
    if cuda_graph is None:
        return device.type == "cuda"
    if cuda_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs the model on a CUDA device, it is on {device}")
    return cuda_graph


def pad_left(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists of different lengths as one batch, padded on the left with `pad`:
    (input_ids [B, T], attention_mask [B, T], 1 = token)."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], dtype=torch.long)
    return ids, mask


def warm_up_on_a_side_stream(fn: Callable[[], object], times: int = 2) -> None:
    """Run fn on a side stream so that every kernel it launches (Triton's included) is compiled
    and loaded before a CUDA graph captures it, as torch.cuda.graph asks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)


class DecodeStep:
    """One token per row through the model: ids [B, 1] at positions [B, 1] -> logits [B, V],
    keys and values written to the cache at those positions. With `graph`, the step is captured
    in a CUDA graph on its first call and replayed after, its inputs copied into fixed buffers
    (the returned logits are overwritten by the next call)."""

    def __init__(self, model, cache: KVCache, graph: bool):
        self.model, self.cache = model, cache
        self.graph: torch.cuda.CUDAGraph | None = None
        self.use_graph = graph
        batch, device = cache.batch, model.lm_head.weight.device
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None

    def _step(self) -> torch.Tensor:
        return self.model(self.ids, self.positions, cache=self.cache, last_only=True)[:, -1]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.use_graph:
            return self.model(ids, positions, cache=self.cache, last_only=True)[:, -1]
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        if self.graph is None:
            with torch.cuda.device(self.ids.device):  # streams and the capture belong to the model's GPU
                warm_up_on_a_side_stream(self._step)  # writes the slots the first replay writes again
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.logits = self._step()
        self.graph.replay()
        return self.logits


def check_padding(attention_mask: torch.Tensor) -> None:
    """Each row must be its tokens with padding on one side: 0..0 1..1 or 1..1 0..0, never empty."""
    ones = attention_mask.sum(1)
    if bool((ones == 0).any()):
        raise ValueError(f"row {int((ones == 0).nonzero()[0])} of attention_mask is all padding: nothing to continue")
    T = attention_mask.shape[1]
    cols = torch.arange(T, device=attention_mask.device)
    first = (cols * attention_mask).argmax(1) - ones + 1  # first token's column if the tokens are contiguous
    contiguous = (attention_mask == ((cols >= first[:, None]) & (cols < (first + ones)[:, None])).long()).all(1)
    if not bool(contiguous.all()):
        row = int((~contiguous).nonzero()[0])
        raise ValueError(f"row {row} of attention_mask has padding between its tokens; pad on the left or the right")


@torch.inference_mode()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int = 32,
    *,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    seed: int | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
    cuda_graph: bool | None = None,
    **sampling,
) -> torch.Tensor:
    """Token ids [B, T + n]: the prompt followed by n <= max_new_tokens generated tokens.
    See Qwen3ForCausalLM.generate for the arguments."""
    config = model.config
    gen_config = getattr(model, "generation_config", {}) or {}
    params = sampling_params(gen_config, **sampling)
    check_input_ids(input_ids)
    B, T = input_ids.shape
    if T == 0:
        raise ValueError("the prompt is empty: generation needs at least one token")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if T + max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
            f"{config.max_position_embeddings} tokens (max_position_embeddings)"
        )
    check_input_ids(input_ids, config.vocab_size)
    device = model.lm_head.weight.device
    cuda_graph = resolve_cuda_graph(cuda_graph, device)
    input_ids = input_ids.to(device)

    eos_ids = resolve_eos(eos_token_id, gen_config, config)
    pad = pad_token_id if pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    if not 0 <= pad < config.vocab_size:
        raise ValueError(f"pad_token_id must be a token id in [0, {config.vocab_size}), got {pad}")
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    tp = getattr(model, "tp", None)
    if seed is None and not params.greedy and tp is not None:
        seed = tp.shared_seed()  # tensor-parallel ranks sample alike: the same logits, the same seed
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None

    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}")
        attention_mask = attention_mask.to(device).long()
        check_padding(attention_mask)
        if bool(attention_mask.all()):
            attention_mask = None  # no padding: the prefill takes the plain causal path
    if max_new_tokens == 0:
        return input_ids
    valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)  # [B, T]: each row counts its own tokens
    next_positions = valid.sum(1, keepdim=True)  # [B, 1]
    penalized = params.penalized
    seen = None
    if penalized:  # [B, V]: tokens in the prompt or generated so far
        seen = torch.zeros(B, config.vocab_size, dtype=torch.bool, device=device)
        seen.scatter_(1, input_ids.masked_fill(~valid, 0), valid)

    cache = KVCache.for_model(model, B, int(next_positions.max()) + max_new_tokens)
    logits = model(input_ids, positions, cache=cache, attention_mask=attention_mask, last_only=True)[:, -1]
    step = DecodeStep(model, cache, graph=cuda_graph)
    never = torch.iinfo(torch.long).max
    finished_at = torch.full((B,), never, dtype=torch.long, device=device)  # step at which each row stopped
    tokens: list[torch.Tensor] = []

    def choose(logits: torch.Tensor, i: int) -> torch.Tensor:
        new = next_token(logits, seen, params, generator)
        new = torch.where(finished_at < i, pad, new)  # rows already stopped are padded
        if penalized:
            seen[torch.arange(B, device=device), new] |= finished_at >= i
        finished_at.masked_fill_((finished_at == never) & torch.isin(new, eos), i)
        tokens.append(new)
        return new

    new = choose(logits, 0)
    if on_token is not None:  # the first token as soon as the prefill gives it, before any graph capture
        on_token(tokens[0])
    for i in range(1, max_new_tokens + 1):
        if i < max_new_tokens:  # queue step i on the GPU before looking at step i - 1's token
            new = choose(step(new[:, None], next_positions), i)
            next_positions = next_positions + 1
        if on_token is not None and i > 1:
            on_token(tokens[i - 1])
        if (on_token is not None or i % STOP_CHECK_EVERY == 0) and bool((finished_at <= i - 1).all()):
            break
    n = len(tokens)
    if bool((finished_at != never).all()):  # all stopped: the steps after the last stop are padding
        n = int(finished_at.max()) + 1
    return torch.cat([input_ids, torch.stack(tokens[:n], dim=1)], dim=1)
