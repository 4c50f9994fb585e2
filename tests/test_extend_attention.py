"""ops/attention/extend_attention.py: causal attention of packed new-token chunks over a paged KV
cache, against torch's scaled_dot_product_attention of each sequence alone, over its keys gathered
out of the blocks through its table row, with an explicit boolean mask of positions (in float64).

Every cache slot no sequence owns (the tails of last blocks, spare blocks, the block that table
entries past a sequence's length name) holds NaN, and so do the padding tokens' queries: a read of
any of them would spread NaN into the rows compared."""

import pytest
import torch
from conftest import DEVICE
from tolerances import (
    EXTEND_ATTENTION_16BIT_EPS,
    EXTEND_ATTENTION_FP32_ATOL,
    EXTEND_ATTENTION_FP32_RTOL,
    relative_error,
)

from ops.attention.extend_attention import extend_attention, tokens_per_tile

# (cached keys, new tokens) per sequence: an empty chunk first (cu_seqlens starts 0, 0), a prompt from
# position 0 of 37 tokens (a tile of 32 and 5 more), a long cached prefix and a short chunk, one new
# token (decode), another empty chunk, a chunk of 20 after 3 cached keys; no key count a multiple of 64.
SEQS = [(4, 0), (0, 37), (70, 5), (12, 1), (9, 0), (3, 20)]
PADDING = 7  # unused tokens after cu_seqlens[-1] (a CUDA graph bucket's room)


def make_inputs(seqs, H, K, hd, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [cached + new for cached, new in seqs]
    q_lens = [new for _, new in seqs]
    n_used = [-(-n // block_size) for n in seq_lens]
    n_blocks = sum(n_used) + 3
    order = torch.randperm(n_blocks, generator=gen).tolist()  # blocks in shuffled order; the last 3 spare
    nan_block = order[-1]
    M = max(n_used) + 2
    table = torch.full((len(seqs), M), nan_block, dtype=torch.long)
    cache = torch.full((n_blocks, 2, block_size, K, hd), float("nan"))  # k and v interleaved: strided views
    for s, n in enumerate(seq_lens):
        ids, order = order[: n_used[s]], order[n_used[s]:]
        table[s, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        for j in range(n):
            cache[ids[j // block_size], :, j % block_size] = torch.randn(2, K, hd, generator=gen)
    N = sum(q_lens) + PADDING
    qkv = torch.randn(N, (H + 2 * K) * hd, generator=gen)
    qkv[sum(q_lens):] = float("nan")
    q = qkv.to(DEVICE, dtype)[:, : H * hd].view(N, H, hd)  # strided rows, as the projection gives them
    cache = cache.to(DEVICE, dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    return q, cache[:, 0], cache[:, 1], cu, torch.tensor(seq_lens, device=DEVICE), table.to(DEVICE)


def reference(q, k_blocks, v_blocks, cu, seq_lens, table, scale):
    """[cu[-1], H, hd] float64: each sequence's new tokens through SDPA over its gathered keys."""
    block_size, K, hd = k_blocks.shape[1:]
    rows = []
    for s, L in enumerate(seq_lens.tolist()):
        start, end = cu[s].item(), cu[s + 1].item()
        if start == end:
            continue
        ids = table[s, : -(-L // block_size)]
        keys = k_blocks[ids].reshape(-1, K, hd)[:L].double().transpose(0, 1)
        values = v_blocks[ids].reshape(-1, K, hd)[:L].double().transpose(0, 1)
        positions = L - (end - start) + torch.arange(end - start, device=q.device)
        mask = torch.arange(L, device=q.device)[None, :] <= positions[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].double().transpose(0, 1), keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        rows.append(out.transpose(0, 1))
    return torch.cat(rows)


def check(seqs, H, K, hd, block_size, dtype, max_new_tokens=None):
    q, k_blocks, v_blocks, cu, seq_lens, table = make_inputs(seqs, H, K, hd, block_size, dtype)
    scale = hd**-0.5
    with torch.no_grad():
        out = extend_attention(q, k_blocks, v_blocks, cu, seq_lens, table, scale, max_new_tokens=max_new_tokens)
    assert out.shape == q.shape and out.dtype == dtype
    n = cu[-1].item()
    expected = reference(q, k_blocks, v_blocks, cu, seq_lens, table, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(out[:n], expected.float(), atol=EXTEND_ATTENTION_FP32_ATOL,
                                   rtol=EXTEND_ATTENTION_FP32_RTOL)
    else:
        assert not out[:n].isnan().any()
        assert relative_error(out[:n], expected) < EXTEND_ATTENTION_16BIT_EPS * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("max_new_tokens", [None, 37], ids=["no-bound", "bound"])
def test_extend_attention_equals_sdpa(dtype, block_size, max_new_tokens):
    """Mixed chunks (SEQS) of a grouped-query layout (4 heads over 2), in tiles of 32 tokens."""
    check(SEQS, 4, 2, 32, block_size, dtype, max_new_tokens)


@pytest.mark.parametrize("heads", [(4, 1, 16), (2, 2, 16), (8, 2, 24), (4, 4, 32)],
                         ids=["mqa", "mha", "group4-hd24", "mha-hd32"])
def test_extend_attention_head_layouts_equal_sdpa(heads):
    """Groups of 4, 1 (rows padded to 16 tokens of one head) and 2; a head size padded to 32."""
    H, K, hd = heads
    check(SEQS, H, K, hd, 16, torch.float32)


def test_extend_attention_in_float16_equals_sdpa():
    check(SEQS, 4, 2, 32, 16, torch.float16)


@pytest.mark.parametrize("max_new_tokens", [None, 1], ids=["no-bound", "bound-1"])
def test_extend_attention_of_one_token_per_sequence_equals_sdpa(max_new_tokens):
    """A decode-like batch: one new token each, in tiles of 32 tokens or (bound 1) of 8 (16 rows)."""
    check([(5, 1), (0, 1), (40, 1), (17, 1)], 4, 2, 32, 4, torch.float32, max_new_tokens)


def test_tokens_per_tile_fill_64_rows_and_shrink_to_the_bound_but_not_below_16_rows():
    assert tokens_per_tile(2, None) == 32 and tokens_per_tile(4, None) == 16 and tokens_per_tile(1, None) == 64
    assert tokens_per_tile(3, None) == 16  # a group of 3 padded to 4 heads
    assert tokens_per_tile(128, None) == 1  # 128 heads of one token: a tile of 128 rows
    assert tokens_per_tile(2, 1) == 8 and tokens_per_tile(4, 1) == 4 and tokens_per_tile(16, 1) == 1
    assert tokens_per_tile(2, 5) == 8 and tokens_per_tile(2, 20) == 32 and tokens_per_tile(2, 1000) == 32


def test_extend_attention_refuses_bad_input():
    q, k_blocks, v_blocks, cu, seq_lens, table = make_inputs([(3, 2), (0, 4)], 4, 2, 16, 4, torch.float32)
    args = dict(q=q, k_blocks=k_blocks, v_blocks=v_blocks, cu_seqlens=cu, seq_lens=seq_lens, block_table=table,
                scale=0.25)
    bad = {
        "H a multiple of K": dict(q=torch.zeros(q.shape[0], 3, 16, device=DEVICE)),
        "q must be": dict(q=q[0]),
        "share a float dtype": dict(q=q.to(torch.bfloat16)),
        "contiguous in their last dimension": dict(q=q.transpose(0, 2).contiguous().transpose(0, 2)),
        "cu_seqlens must be": dict(cu_seqlens=cu.long()),
        "seq_lens must be": dict(seq_lens=seq_lens[:, None]),
        "block_table must be": dict(block_table=table[:1]),
        "block_size must be a power of two": dict(k_blocks=k_blocks[:, :3], v_blocks=v_blocks[:, :3]),
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            extend_attention(**{**args, **change})
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        extend_attention(**{**args, "cu_seqlens": cu[:2]})
