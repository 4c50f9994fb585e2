"""Attention metadata: where each token's keys and values go, and what each query attends to.

A forward runs N tokens laid out as S sequences back to back (input_ids [N], positions [N]); the
model reads this object and never asks how it is being scheduled. The runtime builds it (generate,
the serving engine, the plain `model(input_ids)` call), with device-side ops only, so that a CUDA
graph captures the building too:

- `plain(B, T)`: B rows of T tokens from position 0, no cache (the plain forward, training);
- `prefill(...)`: sequences from position 0 whose keys and values are written to a cache, packed
  back to back (or, all of one length, as rows);
- `decode(...)`: one new token per sequence after its cached ones;
- `extend(...)`: new tokens after cached ones, packed (a prefill after a cached prefix, a prompt's
  next chunk, a chat's next turn).

Each token attends to its own sequence's keys at positions up to its own.
"""

from dataclasses import dataclass

import torch

from .cache import PagedKVCache


@dataclass
class AttentionMetadata:
    cu_seqlens: torch.Tensor  # [S + 1] int32: sequence s holds tokens [cu_seqlens[s], cu_seqlens[s + 1])
    rows: int | None  # T when every sequence holds T tokens (tokens as [S, T]); None: lengths vary (packed)
    from_start: bool  # every sequence's new tokens start at its position 0: its keys are its new tokens
    cache: PagedKVCache | None = None  # where keys and values go (None: nowhere; the keys are the new tokens)
    slots: torch.Tensor | None = None  # [N] long: each token's cache slot (padding: the scratch slot)
    block_tables: torch.Tensor | None = None  # [S, M] long: each sequence's blocks, in order
    seq_lens: torch.Tensor | None = None  # [S] long: each sequence's keys once its new tokens are written
    max_seq_len: int = 0  # a bound on seq_lens, known on the host (a captured graph: its tables' width)
    logits_at: torch.Tensor | None = None  # [S] long: the tokens whose logits are wanted; None: all
    # Sequence s owns blocks s * M .. s * M + M - 1, in order (block_tables [S, M] is that range, as
    # generate lays out its rows): its keys are one run of the cache, read without the table.
    consecutive_blocks: bool = False

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.shape[0] - 1


def plain(B: int, T: int, device: torch.device, last_only: bool = False) -> AttentionMetadata:
    """B rows of T tokens each, from position 0, attending causally to their own row; no cache.
    last_only: the logits of each row's last token only."""
    cu_seqlens = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
    logits_at = (cu_seqlens[1:] - 1).long() if last_only else None
    return AttentionMetadata(cu_seqlens, rows=T, from_start=True, max_seq_len=T, logits_at=logits_at)


def rows_positions(B: int, T: int, device: torch.device) -> torch.Tensor:
    """Positions [B * T] of B rows of T tokens from position 0."""
    return torch.arange(T, device=device).repeat(B)


def prefill(positions: torch.Tensor, cu_seqlens: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor,
            max_seq_len: int, rows: int | None = None) -> AttentionMetadata:
    """Sequences from position 0 (positions [N] restart at 0 with each), their keys and values
    written through their rows of block_tables [S, M]; the logits of each one's last token. Tokens
    past cu_seqlens[-1] are padding (a captured pack's unused room): written to scratch. rows: T
    when every sequence holds T tokens and there is no padding."""
    return packed(positions, cu_seqlens, cache, block_tables, max_seq_len, rows, from_start=True)


def extend(positions: torch.Tensor, cu_seqlens: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor,
           max_seq_len: int, all_logits: bool = False) -> AttentionMetadata:
    """New tokens of sequences packed back to back (cu_seqlens [S + 1]) after their cached ones:
    each sequence's positions [N] continue from its cached length (a prefill that starts after a
    cached prefix, a prompt's next chunk, a chat's next turn), its keys read and written through its
    row of block_tables [S, M]; max_seq_len bounds every sequence's length once they are written.
    The logits of each one's last token (all_logits: of every token). Padding as in `prefill`."""
    meta = packed(positions, cu_seqlens, cache, block_tables, max_seq_len, None, from_start=False)
    if all_logits:
        meta.logits_at = None
    return meta


def packed(positions: torch.Tensor, cu_seqlens: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor,
           max_seq_len: int, rows: int | None, from_start: bool) -> AttentionMetadata:
    """`prefill` and `extend`: a sequence's length is its last token's position + 1."""
    N, S = positions.shape[0], cu_seqlens.shape[0] - 1
    tokens = torch.arange(N, device=positions.device)
    sequence = torch.searchsorted(cu_seqlens[1:], tokens.to(cu_seqlens.dtype), right=True).clamp(max=S - 1)
    slots = cache.slots(positions, block_tables[sequence], tokens < cu_seqlens[-1])
    last = (cu_seqlens[1:] - 1).clamp(min=0).long()  # an empty sequence's: any token (its logits unused)
    seq_lens = positions[last.clamp(max=N - 1)] + 1
    return AttentionMetadata(cu_seqlens, rows, from_start, cache, slots, block_tables, seq_lens, max_seq_len, last)


def decode(positions: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor,
           valid: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
           consecutive_blocks: bool = False) -> AttentionMetadata:
    """One new token per sequence at positions [S], after its cached ones, through block_tables
    [S, M]; sequences where valid [S] is False are padding (written to scratch, read by no one).
    cu_seqlens: 0..S as int32, for a caller that keeps one (a graph's step makes none).
    consecutive_blocks: the tables are generate's layout (see AttentionMetadata)."""
    S = positions.shape[0]
    if cu_seqlens is None:
        cu_seqlens = torch.arange(S + 1, dtype=torch.int32, device=positions.device)
    slots = cache.slots(positions, block_tables, valid)
    max_seq_len = block_tables.shape[1] * cache.block_size
    return AttentionMetadata(cu_seqlens, 1, False, cache, slots, block_tables, positions + 1, max_seq_len,
                             consecutive_blocks=consecutive_blocks)
