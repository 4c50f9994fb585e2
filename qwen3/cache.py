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
        return cls(c.num_hidden_layers, batch, c.num_key_value_heads, max_len, c.head_dim, weight.dtype, weight.device)

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
