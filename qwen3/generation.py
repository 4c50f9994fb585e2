"""Prefill + decode loop with a KV cache: padded batches, per-row stopping, streaming.

Prompts of different lengths come left-padded with an attention mask (1 = token, 0 = padding).
Each row's rotary positions count its own tokens only, so a row generates what it would alone.
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
    **sampling,
) -> torch.Tensor:
    """Token ids [B, T + n]: the prompt followed by n <= max_new_tokens generated tokens.

    sampling: temperature (0 = greedy), top_k, top_p, min_p, repetition_penalty, presence_penalty;
    unset ones come from the checkpoint's generation_config.json. A row stops at its first eos
    (ids from the argument, else the generation config, else the model config) and is padded
    with pad_token_id (default: its eos) until every row has stopped. on_token(ids [B]) is
    called after every step, for streaming.
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
    for _ in range(max_new_tokens):
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
