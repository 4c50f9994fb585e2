"""The KV cache: the keys and values of every layer, in fixed-size blocks (vLLM's paged attention).

Storage is [L, n_blocks * block_size + 1, K, hd]: block i holds slots i * block_size up to
(i + 1) * block_size, and the last slot is scratch, where padding tokens write and nothing reads.
A sequence owns a list of blocks, its block table: its token at position p lives in slot
table[p // block_size] * block_size + p % block_size. A forward over several sequences takes their
tables as one tensor [S, M] (rows padded with any block id: entries past a sequence's length are
never read). `generate`'s rows are the same thing: one table per row, its blocks in order.

The cache holds no lengths or modes: every write says where it goes (its slots), every read how far
it looks (runtime/metadata.py). Blocks are counted by reference, and full ones can be found again by
their tokens (runtime/blocks.py: sequences share the blocks of a common prefix).
"""

import torch

from .blocks import BlockPool


class PagedKVCache:
    def __init__(self, n_layers: int, n_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a paged KV cache needs n_blocks >= 1 and block_size >= 1, got {n_blocks}, {block_size}")
        shape = (n_layers, n_blocks * block_size + 1, n_kv_heads, head_dim)  # [L, slots, K, hd]
        # Zeros, not empty: a step captured with static shapes reads slots it then masks, and an
        # uninitialized NaN would leak through a zero attention weight.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_blocks, self.block_size = n_blocks, block_size
        self.pool = BlockPool(n_blocks)  # who owns which block (allocate, release, share, find by tokens)

    @classmethod
    def for_model(cls, model, n_blocks: int, block_size: int = 16) -> "PagedKVCache":
        c = model.config
        weight = model.lm_head.weight
        return cls(c.num_hidden_layers, n_blocks, block_size, model.kv_heads, c.head_dim, weight.dtype, weight.device)

    @staticmethod
    def bytes_per_block(model, block_size: int = 16) -> int:
        c = model.config
        per_token = 2 * c.num_hidden_layers * model.kv_heads * c.head_dim * model.lm_head.weight.element_size()
        return per_token * block_size

    @property
    def scratch(self) -> int:
        return self.n_blocks * self.block_size

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that n_tokens positions occupy."""
        return -(-n_tokens // self.block_size)

    def slots(self, positions: torch.Tensor, block_tables: torch.Tensor, valid: torch.Tensor | None = None
              ) -> torch.Tensor:
        """Slots [N] of tokens at positions [N], token n in the sequence whose blocks are
        block_tables[n] ([N, M]: each token's own table row); tokens where valid [N] is False go to
        scratch. Device-side ops only: a CUDA graph captures it."""
        blocks = block_tables.gather(1, (positions // self.block_size)[:, None])[:, 0]
        slots = blocks * self.block_size + positions % self.block_size
        return slots if valid is None else slots.masked_fill(~valid, self.scratch)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of one layer over the flat slot axis: [n_blocks * block_size + 1, K, hd]."""
        return self.k[layer], self.v[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, K * hd or K, hd] of the tokens at `slots` [N] of `layer`."""
        shape = (slots.shape[0], *self.k.shape[2:])
        self.k[layer].index_copy_(0, slots, k.reshape(shape))
        self.v[layer].index_copy_(0, slots, v.reshape(shape))

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of one layer by block: [n_blocks, block_size, K, hd] (the paged decode kernel's view)."""
        shape = (self.n_blocks, self.block_size, *self.k.shape[2:])
        return self.k[layer, : self.scratch].view(shape), self.v[layer, : self.scratch].view(shape)

    def rows(self, layer: int, n_rows: int, row_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of one layer as rows of consecutive blocks, row s holding blocks s * row_blocks onward:
        [n_rows, row_blocks * block_size, K, hd] (views; the decode kernel's contiguous layout)."""
        shape = (n_rows, row_blocks * self.block_size, *self.k.shape[2:])
        end = n_rows * row_blocks * self.block_size
        return self.k[layer, :end].view(shape), self.v[layer, :end].view(shape)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of one layer's sequences, copied out through block_tables [S, M]: [S, M * block_size,
        K, hd], position p of sequence s at index p (the reference path's read; entries past a
        sequence's length are junk)."""
        k_blocks, v_blocks = self.blocks(layer)
        S, M = block_tables.shape
        shape = (S, M * self.block_size, *self.k.shape[2:])
        return k_blocks[block_tables].view(shape), v_blocks[block_tables].view(shape)
