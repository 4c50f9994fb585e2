"""Prefill + decode loop over the paged KV cache: padded batches, per-row stopping, streaming.

Prompts of different lengths come padded (left or right) with an attention mask (1 = token,
0 = padding). The prefill packs each row's real tokens back to back (the padding is never
computed), each row's positions count its own tokens only, and its cache row (one block table
per row, its blocks in order) holds only them, so a row generates what it would alone (but with
FP8 weights: a batch of 2-64 rows rounds its activations to FP8, qwen3/layers.py's linear).

On CUDA the decode step is captured once in a CUDA graph (runtime/graphs.py) and replayed for
every later token:
one launch for the model and the choice of the next token (penalties, filters and the draw, or
the argmax) instead of a few hundred. Each step writes its tokens where the next step reads its
input, so the host only replays the graph and copies the tokens out. The host stays one step
ahead of the GPU: each step's tokens and stop flags are copied to the host behind it, and the
host waits for that copy only (an event), while the GPU computes the next step, to call
`on_token` and to see whether every row has stopped. Reading a device tensor directly would
wait for everything queued, the next step too, and leave the GPU idle while the host queues the
one after.

Each row samples from a stream of its own (runtime/sampler.py): with a seed, every row's is that
seed's, so a row samples what its prompt samples alone; without one, each row gets a seed of its
own. Under tensor parallelism every rank runs this same loop: the forward ends with the full
logits on every rank, and each samples from them with the same seeds (rank 0's when the caller
gives none), so all ranks choose the same tokens, stop at the same step and stay in step for the
next collective. The captured decode step holds the all-reduces.
"""

from collections.abc import Callable

import torch

from ops import resolve_kernels

from . import metadata
from .cache import PagedKVCache
from .checks import check_in_vocab, check_input_ids, check_request, token_id
from .graphs import GraphRunner, resolve_cuda_graph
from .sampler import Sampler, random_seed
from .sampling import SamplingParams, plain, sampling_params

# Tokens per block of generate's cache: a row's blocks are its own and in order, so a large block
# keeps each key step of the decode kernel inside one block (contiguous reads), one table entry
# per 256 keys. A constant, so that every call compiles the same kernels.
BLOCK_SIZE = 256


def resolve_eos(eos_token_id: int | list[int] | None, generation_config: dict, config) -> list[int]:
    """Stop ids: the caller's, else generation_config.json's, else config.json's (maybe none). An id
    may be any integer (a Python, numpy or 0-d tensor one), a list of them or a 1-d integer tensor;
    TypeError for anything else (a float, a bool)."""
    eos = eos_token_id
    if eos is None:
        eos = generation_config.get("eos_token_id", config.eos_token_id)
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist() if not eos.is_floating_point() and eos.dim() <= 1 else [eos]
    ids = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    return [token_id(t, "eos_token_id") for t in ids]


def stop_ids(model, tokenizer) -> set[int]:
    """The tokens that end a text: the checkpoint's (generation_config.json, else config.json) and the
    tokenizer's end of text."""
    return {tokenizer.eos_token_id, *resolve_eos(None, model.generation_config, model.config)} - {None}


def pad_left(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists of different lengths as one batch, padded on the left with `pad`:
    (input_ids [B, T], attention_mask [B, T], 1 = token)."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], dtype=torch.long)
    return ids, mask


class TokenChoice:
    """Picks each step's token per row from its logits (the batched Sampler: each row its own stream)
    and keeps the stop state, all on the device: the step count and each row's stop step. A row
    that has stopped gets `pad`. Calls must come in step order (the prefill's first)."""

    NEVER = torch.iinfo(torch.long).max  # finished_at of a row still running

    def __init__(self, input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int, params: SamplingParams,
                 seeds: list[int], eos: torch.Tensor, pad: int, fused: bool):
        B, device = input_ids.shape[0], input_ids.device
        self.eos, self.pad = eos, pad
        self.sampler = Sampler(B, vocab_size, device, penalties=params.penalized)
        for row, seed in enumerate(seeds):
            self.sampler.set_row(row, params, seed, input_ids[row][valid[row]] if params.penalized else ())
        self.how = Sampler.how([params], fused)
        self.rows = torch.arange(B, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)  # the step the next call chooses for
        self.finished_at = torch.full((B,), self.NEVER, dtype=torch.long, device=device)  # step of each row's stop

    def peek(self, logits: torch.Tensor) -> torch.Tensor:
        """The tokens [B] a call would choose, with no state advanced (a warm-up before a capture)."""
        return self.sampler.choose(logits, self.rows, self.how)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Tokens [B] for this step from logits [B, V]."""
        new = self.sampler(logits, self.rows, self.how)
        new = torch.where(self.finished_at < self.step, self.pad, new)  # rows already stopped are padded
        # Written with where: isin and a masked_fill by a tensor value read back to the host,
        # which a captured graph cannot do.
        stops = (self.finished_at == self.NEVER) & (new[:, None] == self.eos[None, :]).any(-1)
        self.finished_at.copy_(torch.where(stops, self.step, self.finished_at))
        self.step += 1
        return new


def check_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """The mask as a LongTensor of 0 and 1; ValueError unless it holds only 0 and 1 (or bools) and
    each row is its tokens with padding on one side: 0..0 1..1 or 1..1 0..0, never empty."""
    binary = (attention_mask == 0) | (attention_mask == 1)
    if not bool(binary.all()):
        wrong = attention_mask[~binary][0].item()
        raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (token), or bools; it holds {wrong!r}")
    attention_mask = attention_mask.long()
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
    return attention_mask


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
    if B == 0:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} holds no prompt: generation needs at least one row")
    device = model.lm_head.weight.device
    input_ids = input_ids.to(device)
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a tensor like input_ids, got {type(attention_mask).__name__}")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}")
        attention_mask = check_padding(attention_mask.to(device))
    # The context holds each row's tokens, not its padding: the longest row is what must fit.
    longest = T if attention_mask is None else int(attention_mask.sum(1).max())
    max_new_tokens = plain(max_new_tokens)  # numpy's integers as Python's (checked next)
    check_request(longest, max_new_tokens, config.max_position_embeddings, seed, new_name="max_new_tokens", least=0)
    check_in_vocab(input_ids, config.vocab_size)
    cuda_graph = resolve_cuda_graph(cuda_graph, device)

    eos_ids = resolve_eos(eos_token_id, gen_config, config)
    if not all(0 <= t < config.vocab_size for t in eos_ids):
        raise ValueError(f"eos_token_id must be token ids in [0, {config.vocab_size}), got {eos_ids}")
    pad = token_id(pad_token_id, "pad_token_id") if pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    if not 0 <= pad < config.vocab_size:
        raise ValueError(f"pad_token_id must be a token id in [0, {config.vocab_size}), got {pad}")
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    seeds = row_seeds(seed, B, getattr(model, "tp", None))

    if attention_mask is not None and bool(attention_mask.all()):
        attention_mask = None  # no padding: the prefill takes the plain causal path
    if max_new_tokens == 0:
        return input_ids
    valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    fused = resolve_kernels(config.kernels, device) == "fused"
    choose = TokenChoice(input_ids, valid, config.vocab_size, params, seeds, eos, pad, fused)
    lengths = valid.sum(1)  # [B]: each row's tokens
    per_row = -(-(longest + max_new_tokens) // BLOCK_SIZE)
    cache = PagedKVCache.for_model(model, B * per_row, BLOCK_SIZE)
    tables = torch.arange(B * per_row, device=device).view(B, per_row)  # row b's blocks, in order
    first = choose(prefill(model, input_ids, valid, attention_mask is None, cache, tables, longest))

    def make_step() -> GraphRunner:
        return decode_steps(model, cache, tables, choose, first, lengths, cuda_graph)

    new_tokens = read_steps(first, make_step, choose, max_new_tokens, device, on_token)  # [B, n]
    return torch.cat([input_ids, new_tokens.to(device)], dim=1)


def read_steps(first: torch.Tensor, make_step, choose: TokenChoice, max_new_tokens: int, device: torch.device,
               on_token) -> torch.Tensor:
    """The new tokens [B, n] of every row: the prefill's (`first`), then those of the decode steps
    that make_step() returns, up to the step where every row has stopped (or max_new_tokens),
    each step's tokens streamed to on_token in order while the GPU computes the next one."""
    B = first.shape[0]
    # Each step's tokens and every row's stop step land in their own row of these host buffers
    # (pinned on CUDA, so that the copies run behind the GPU's work without a wait).
    pinned = device.type == "cuda"
    host_tokens = torch.empty(max_new_tokens, B, dtype=torch.long, pin_memory=pinned)
    host_stops = torch.empty(max_new_tokens, B, dtype=torch.long, pin_memory=pinned)

    def to_host(i: int, tokens: torch.Tensor) -> tuple[int, torch.cuda.Event | None]:
        """Queue the copies of step i's tokens and stop steps to the host, with an event that marks
        them done: waiting for it waits for this step only, not for the step queued after."""
        host_tokens[i].copy_(tokens, non_blocking=pinned)
        host_stops[i].copy_(choose.finished_at, non_blocking=pinned)
        ready = None
        if pinned:  # on the stream of the model's GPU, which may not be the current device
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        return i, ready

    def read(published) -> bool:
        """Wait for a to_host's copies, stream the tokens; whether every row had stopped by then."""
        i, ready = published
        if ready is not None:
            ready.synchronize()
        if on_token is not None:
            on_token(host_tokens[i])
        return bool((host_stops[i] != TokenChoice.NEVER).all())

    # The first token as soon as the prefill gives it, before any graph capture.
    n = 1
    all_stopped = read(to_host(0, first))
    # Captured after the first token is out; not at all when no step follows it.
    step = make_step() if max_new_tokens > 1 and not all_stopped else None
    previous = None
    for i in range(1, max_new_tokens + 1):
        if all_stopped:
            break
        # Queue step i on the GPU before looking at step i - 1's tokens.
        current = to_host(i, step(B)) if i < max_new_tokens else None
        if previous is not None:
            all_stopped = read(previous)
            n = previous[0] + 1
        previous = current
    if all_stopped:  # the steps after the last stop are padding
        n = int(host_stops[n - 1].max()) + 1
    return host_tokens[:n].T


def row_seeds(seed: int | None, B: int, tp) -> list[int]:
    """Each row's seed: the caller's for every row (so that each row samples what its prompt samples
    alone), else one of its own per row. Tensor-parallel ranks sample alike: rank 0's seeds."""
    if seed is not None:
        return [seed] * B
    base = tp.shared_seed() if tp is not None else random_seed()
    return [(base + row) % 2**63 for row in range(B)]


def prefill(model, input_ids: torch.Tensor, valid: torch.Tensor, unpadded: bool, cache: PagedKVCache,
            tables: torch.Tensor, longest: int) -> torch.Tensor:
    """Each row's tokens (valid [B, T]) written to its blocks from position 0 -> the logits [B, V] of
    its last token. Rows of one length run as rows; padded ones packed back to back, padding left out."""
    B, T = input_ids.shape
    if unpadded:
        positions = metadata.rows_positions(B, T, input_ids.device)
        cu_seqlens = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=input_ids.device)
        meta = metadata.prefill(positions, cu_seqlens, cache, tables, T, rows=T)
        return model(input_ids.reshape(-1), positions, meta)
    lengths = valid.sum(1)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    positions = (valid.long().cumsum(1) - 1)[valid]  # [N]: each row's tokens count from 0
    meta = metadata.prefill(positions, cu_seqlens, cache, tables, longest)
    return model(input_ids[valid], positions, meta)


def decode_steps(model, cache: PagedKVCache, tables: torch.Tensor, choose: "TokenChoice", first: torch.Tensor,
                 lengths: torch.Tensor, cuda_graph: bool) -> GraphRunner:
    """runner(B): one decode step, the next token of each row: the model over the last tokens at
    their positions, then `choose`; its tokens become the next step's input and the positions
    advance by one, in place (with cuda_graph the whole step is one replay, and the tokens it
    returns are a buffer that the next call overwrites)."""
    ids, positions = first.clone(), lengths.clone()  # [B] each: the step's input, updated in place
    cu_seqlens = torch.arange(ids.shape[0] + 1, dtype=torch.int32, device=ids.device)

    def forward(B: int) -> torch.Tensor:
        meta = metadata.decode(positions, cache, tables, cu_seqlens=cu_seqlens, consecutive_blocks=True)
        return model(ids, positions, meta)

    def step(B: int) -> torch.Tensor:
        tokens = choose(forward(B))
        ids.copy_(tokens)
        positions.add_(1)
        return tokens

    # The warm-up runs the forward and the choice without advancing anything: it writes the cache
    # slots the first replay writes again, and leaves the choice's state (steps, stops) as it was.
    return GraphRunner(step, [ids.shape[0]], ids.device, cuda_graph, warm_up=lambda B: choose.peek(forward(B)))
