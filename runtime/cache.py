"""KV cache: the keys and values of every layer, written at explicit positions.

Row b's token at position p is stored in slot b * max_len + p of a flat slot axis, so a row's
tokens are its first slots in order, whatever padding its prompt had, and a step attends to a
row's slots below its own position + 1. The cache holds no lengths or modes: every write says
where it goes (`slots`), every read how far it looks. One extra slot at the end is scratch:
padding tokens are written there and never read. This is the flat slot mapping a paged cache
generalizes (a block table in place of b * max_len).
"""

import torch


class KVCache:
    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if batch < 1 or max_len < 1:
            raise ValueError(f"a KV cache needs batch >= 1 and max_len >= 1, got {batch} and {max_len}")
        shape = (n_layers, batch * max_len + 1, n_kv_heads, head_dim)  # [L, slots, K, hd]
        # Zeros, not empty: a step captured with static shapes reads every slot of a row (masked),
        # and an uninitialized NaN would leak through a zero attention weight.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch, self.max_len = batch, max_len

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> "KVCache":
        c = model.config
        weight = model.lm_head.weight
        return cls(c.num_hidden_layers, batch, model.kv_heads, max_len, c.head_dim, weight.dtype, weight.device)

    @property
    def scratch(self) -> int:
        return self.batch * self.max_len

    def slots(self, positions: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Flat slots [B * T] of tokens at positions [B, T]; tokens where valid is False go to scratch."""
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        slots = rows * self.max_len + positions
        if valid is not None:
            slots = slots.masked_fill(~valid, self.scratch)
        return slots.reshape(-1)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of one layer over the flat slot axis: [B * max_len + 1, K, hd]."""
        return self.k[layer], self.v[layer]

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of one layer by row: [B, max_len, K, hd] (scratch left out)."""
        shape = (self.batch, self.max_len, *self.k.shape[2:])
        return self.k[layer, : self.scratch].view(shape), self.v[layer, : self.scratch].view(shape)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [..., K * hd or K, hd] of the tokens at flat `slots` [N] of `layer`."""
        shape = (slots.shape[0], *self.k.shape[2:])
        self.k[layer].index_copy_(0, slots, k.reshape(shape))
        self.v[layer].index_copy_(0, slots, v.reshape(shape))


class PagedKVCache:
    """KV cache in fixed-size blocks shared by all sequences (vLLM's paged attention), for serving.

    Storage is [L, n_blocks * block_size + 1, K, hd]: block i holds slots i * block_size up to
    (i + 1) * block_size, and the last slot is scratch, as in KVCache. A sequence owns a list of
    blocks, its block table: its token at position p lives in flat slot
    block_table[p // block_size] * block_size + p % block_size. A forward over several sequences
    takes their tables as one tensor [B, M] (rows padded with any block id: entries past a row's
    length are never read). Blocks are handed out as sequences grow and returned when they end,
    so memory goes to tokens that exist, not to the longest a request might become.

    The free list lives here, beside the storage it describes, so that the count of free blocks
    has one source of truth; which sequence owns which blocks is the scheduler's business
    (serve/engine.py).
    """

    def __init__(
        self,
        n_layers: int,
        n_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a paged KV cache needs n_blocks >= 1 and block_size >= 1, got {n_blocks}, {block_size}")
        shape = (n_layers, n_blocks * block_size + 1, n_kv_heads, head_dim)  # [L, slots, K, hd]
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # zeros: see KVCache
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_blocks, self.block_size = n_blocks, block_size
        self._free = list(range(n_blocks - 1, -1, -1))  # a stack: the block freed last is reused first
        self._is_free = [True] * n_blocks

    @classmethod
    def for_model(cls, model, n_blocks: int, block_size: int = 16) -> "PagedKVCache":
        c = model.config
        weight = model.lm_head.weight
        return cls(c.num_hidden_layers, n_blocks, block_size, model.kv_heads, c.head_dim, weight.dtype,
                   weight.device)

    @staticmethod
    def bytes_per_block(model, block_size: int = 16) -> int:
        c = model.config
        per_token = 2 * c.num_hidden_layers * model.kv_heads * c.head_dim * model.lm_head.weight.element_size()
        return per_token * block_size

    @property
    def scratch(self) -> int:
        return self.n_blocks * self.block_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that n_tokens positions occupy."""
        return -(-n_tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """n free blocks, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        taken = [self._free.pop() for _ in range(n)]  # from the top: O(n), not O(free)
        for block in taken:
            self._is_free[block] = False
        return taken

    def release(self, blocks: list[int]) -> None:
        """Return blocks to the free list (a sequence that ended or was cancelled). Checked whole
        before anything changes, so a bad call leaves the free list as it was."""
        if len(set(blocks)) != len(blocks) or any(self._is_free[block] for block in blocks):
            raise RuntimeError(f"blocks {blocks} include one released twice")
        for block in blocks:
            self._is_free[block] = True
        self._free.extend(reversed(blocks))

    def row_len(self, block_table: torch.Tensor) -> int:
        """Positions a row of block_table [B, M] can hold: M * block_size."""
        return block_table.shape[1] * self.block_size

    def slots(self, positions: torch.Tensor, valid: torch.Tensor | None, block_table: torch.Tensor) -> torch.Tensor:
        """Flat slots [B * T] of tokens at positions [B, T] of the rows of block_table [B, M];
        tokens where valid is False go to scratch."""
        blocks = block_table.gather(1, positions // self.block_size)
        slots = blocks * self.block_size + positions % self.block_size
        if valid is not None:
            slots = slots.masked_fill(~valid, self.scratch)
        return slots.reshape(-1)

    def packed_slots(self, positions: torch.Tensor, sequence: torch.Tensor, valid: torch.Tensor,
                     block_table: torch.Tensor) -> torch.Tensor:
        """Flat slots [T] of packed tokens: token t at position positions[t] of the sequence whose
        blocks are block_table[sequence[t]] ([N, M]); tokens where valid is False go to scratch."""
        blocks = block_table[sequence, positions // self.block_size]
        slots = blocks * self.block_size + positions % self.block_size
        return slots.masked_fill(~valid, self.scratch)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of one layer over the flat slot axis: [n_blocks * block_size + 1, K, hd]."""
        return self.k[layer], self.v[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [..., K * hd or K, hd] of the tokens at flat `slots` [N] of `layer`."""
        shape = (slots.shape[0], *self.k.shape[2:])
        self.k[layer].index_copy_(0, slots, k.reshape(shape))
        self.v[layer].index_copy_(0, slots, v.reshape(shape))

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of one layer by block: [n_blocks, block_size, K, hd] (the paged decode kernel's view)."""
        shape = (self.n_blocks, self.block_size, *self.k.shape[2:])
        return self.k[layer, : self.scratch].view(shape), self.v[layer, : self.scratch].view(shape)

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of one layer's rows, copied out through block_table [B, M]: [B, M * block_size, K, hd],
        position p of row b at index p (the torch path's read; entries past a row's length are junk)."""
        k_blocks, v_blocks = self.blocks(layer)
        B, M = block_table.shape
        shape = (B, M * self.block_size, *self.k.shape[2:])
        return k_blocks[block_table].view(shape), v_blocks[block_table].view(shape)
