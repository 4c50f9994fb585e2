"""Prefill + decode loop with a KV cache: padded batches, per-row stopping, streaming.

Prompts of different lengths come left-padded with an attention mask (1 = token, 0 = padding).
Each row's rotary positions count its own tokens only, so a row generates what it would alone.
On CUDA, `cuda_graph=True` captures the decode step once (after the prefill) and replays it for
every later token: one graph launch instead of a thousand kernel launches from Python.
"""

from collections.abc import Callable

import torch

from .cache import KVCache
from .sampling import SamplingParams, next_token

# What `model.generate` uses when neither the caller nor the checkpoint's generation_config says.
LIBRARY_DEFAULTS = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0)


def sampling_params(generation_config: dict, **overrides) -> SamplingParams:
    """Caller's values over the checkpoint's generation_config.json over the library defaults.
    A generation_config with do_sample false means greedy, as in transformers."""
    values = dict(LIBRARY_DEFAULTS)
    values.update({k: generation_config[k] for k in LIBRARY_DEFAULTS if generation_config.get(k) is not None})
    if generation_config.get("do_sample") is False:
        values["temperature"] = 0.0
    values.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(**values)


def warm_up_on_a_side_stream(fn: Callable[[], object], times: int = 2) -> None:
    """Run fn on a side stream so that every kernel it launches (Triton's included) is compiled
    and loaded before a CUDA graph captures it, as torch.cuda.graph asks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)


class GraphedDecodeStep:
    """The model's one-token decode step, captured in a CUDA graph on first use and replayed after.
    The step has static shapes: its inputs are copied into fixed buffers, and the KV cache writes
    at the device-side slot `cache.slot` and attends over every slot through a mask (unwritten
    slots are zeroed once, so masked ones hold no NaN to leak through a zero weight)."""

    def __init__(self, model, cache: KVCache, key_valid: torch.Tensor):
        self.model, self.cache, self.key_valid = model, cache, key_valid
        batch, device = key_valid.shape[0], key_valid.device
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        cache.k[:, :, :, cache.length :].zero_()
        cache.v[:, :, :, cache.length :].zero_()

    def _step(self) -> torch.Tensor:
        logits = self.model(self.ids, self.positions, cache=self.cache, attention_mask=self.key_valid, last_only=True)
        return logits[:, -1]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the next token after ids [B, 1] at positions [B, 1], written at slot
        cache.length. The returned tensor is overwritten by the next call."""
        if self.cache.length >= self.cache.max_len:
            raise ValueError(f"KV cache is full: its {self.cache.max_len} slots are all written")
        with torch.cuda.device(self.slot.device):  # streams and the capture belong to the model's GPU
            return self._replay(ids, positions)

    def _replay(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.slot.fill_(self.cache.length)
        self.cache.slot = self.slot
        try:
            if self.graph is None:
                warm_up_on_a_side_stream(self._step)  # writes the same slot as the capture will
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.logits = self._step()
            self.graph.replay()
        finally:
            self.cache.slot = None
        self.cache.advance(1)
        return self.logits


@torch.inference_mode()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int = 32,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    seed: int | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
    cuda_graph: bool = False,
    **sampling,
) -> torch.Tensor:
    """Token ids [B, T + n]: the prompt followed by n <= max_new_tokens generated tokens.

    sampling: temperature (0 = greedy), top_k, top_p, min_p, repetition_penalty, presence_penalty;
    unset ones come from the checkpoint's generation_config.json. A row stops at its first eos
    (ids from the argument, else the generation config, else the model config) and is padded
    with pad_token_id (default: its eos) until every row has stopped. on_token(ids [B]) is
    called after every step, for streaming. cuda_graph: replay decode steps from a CUDA graph
    (CUDA only; the prefill runs eagerly).
    """
    config = model.config
    gen_config = getattr(model, "generation_config", {}) or {}
    params = sampling_params(gen_config, **sampling)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2:
        raise TypeError("input_ids must be a LongTensor of shape [batch, prompt_len]")
    B, T = input_ids.shape
    if T == 0:
        raise ValueError("the prompt is empty: generation needs at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if T + max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
            f"{config.max_position_embeddings} tokens (max_position_embeddings)"
        )
    if input_ids.min().item() < 0 or input_ids.max().item() >= config.vocab_size:
        raise ValueError(f"input_ids must be token ids in [0, {config.vocab_size})")
    device = model.lm_head.weight.device
    if cuda_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs the model on a CUDA device, it is on {device}")
    input_ids = input_ids.to(device)

    eos = eos_token_id if eos_token_id is not None else gen_config.get("eos_token_id", config.eos_token_id)
    eos_ids = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), dtype=torch.long, device=device)
    pad = pad_token_id if pad_token_id is not None else (int(eos_ids[0]) if len(eos_ids) else 0)
    if not 0 <= pad < config.vocab_size:
        raise ValueError(f"pad_token_id must be a token id in [0, {config.vocab_size}), got {pad}")
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None

    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}")
    key_valid = torch.ones(B, T + max_new_tokens, dtype=torch.bool, device=device)
    key_valid[:, :T] = attention_mask.to(device).bool()
    positions = (key_valid[:, :T].long().cumsum(-1) - 1).clamp(min=0)
    seen = torch.zeros(B, config.vocab_size, dtype=torch.bool, device=device)
    seen.scatter_(1, input_ids.masked_fill(~key_valid[:, :T], 0), key_valid[:, :T])

    cache = KVCache.for_model(model, B, T + max_new_tokens)
    padded = not bool(key_valid[:, :T].all())
    tokens = [input_ids]
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    rows = torch.arange(B, device=device)
    ids = input_ids
    graphed = None
    for _ in range(max_new_tokens):
        if cuda_graph and ids.shape[1] == 1:  # a decode step: from the graph, captured on the first
            if graphed is None:
                graphed = GraphedDecodeStep(model, cache, key_valid)
            logits = graphed(ids, positions)
        else:
            mask = key_valid[:, : cache.length + ids.shape[1]] if padded else None
            logits = model(ids, positions, cache=cache, attention_mask=mask, last_only=True)[:, -1]
        new = next_token(logits, seen, params, generator)
        new = torch.where(finished, torch.full_like(new, pad), new)
        seen[rows, new] |= ~finished
        tokens.append(new[:, None])
        if on_token is not None:
            on_token(new)
        finished |= torch.isin(new, eos_ids)
        if bool(finished.all()):
            break
        ids = new[:, None]
        positions = positions[:, -1:] + 1
    return torch.cat(tokens, dim=1)
