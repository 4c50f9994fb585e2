"""The runtime's paged KV cache and attention metadata (runtime/cache.py, runtime/metadata.py), and the
model's forward through them, against the no-cache forward, transformers and the contiguous kernel.

References: the plain forward model(input_ids) (which test_model holds equal to transformers), a
transformers model of the same checkpoint, and the decode kernel reading contiguous rows (a paged
read must see exactly what a contiguous one sees)."""

import pytest
import torch
from checkpoints import hf_model, prompts, save
from conftest import DEVICE, requires_cuda, use_path
from tolerances import LOGITS_BF16_REL, LOGITS_FP32_ATOL, LOGITS_FP32_RTOL, relative_error

from ops.attention.decode_attention import decode_attention, keys_per_step, shared_memory_per_program
from qwen3 import Qwen3ForCausalLM
from runtime import metadata
from runtime.blocks import BlockPool, block_keys
from runtime.cache import PagedKVCache

PATHS = ["reference", "fused"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save(hf_model(seed=5, num_hidden_layers=2), tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def model(checkpoint):
    return Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, device=DEVICE, progress=False)



def on_device(data, dtype=torch.long):
    return torch.tensor(data, dtype=dtype, device=DEVICE)


def assert_logits_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=LOGITS_FP32_RTOL, atol=LOGITS_FP32_ATOL)


# ---- blocks and slots --------------------------------------------------------------------------


def test_blocks_are_allocated_released_and_reused():
    cache = PagedKVCache(1, n_blocks=5, block_size=4, n_kv_heads=1, head_dim=8, dtype=torch.float32, device=DEVICE)
    assert cache.pool.num_free == 5 and cache.blocks_for(9) == 3 and cache.blocks_for(8) == 2
    a = cache.pool.allocate(3)
    b = cache.pool.allocate(2)
    assert sorted(a + b) == [0, 1, 2, 3, 4] and cache.pool.num_free == 0
    assert cache.pool.allocate(1) is None and cache.pool.num_free == 0  # out of blocks: nothing taken
    cache.pool.release(a)
    assert cache.pool.num_free == 3
    assert sorted(cache.pool.allocate(3)) == sorted(a)  # the freed blocks are handed out again
    cache.pool.release(b)
    with pytest.raises(RuntimeError, match="released more often than it is owned"):
        cache.pool.release(b)


def test_a_shared_block_is_free_only_when_its_last_owner_releases_it():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.share(a[:1])  # a second sequence reuses the first block (a common prefix)
    pool.release(a)
    assert pool.num_free == 3  # the shared block still has an owner
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(a)  # the second block is free: the whole call is refused, nothing changes
    assert pool.num_free == 3
    pool.release(a[:1])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="include a free one"):
        pool.share(a[:1])


def test_registered_blocks_stay_cached_and_are_evicted_least_recently_freed_first():
    """Full blocks registered under their keys (the hash chain of their tokens) are found again
    by a prompt with the same tokens, stay findable once their owners let go, and are handed out
    again only when no unregistered block is free, the one let go longest ago first."""
    pool = BlockPool(4)
    tokens = list(range(10))
    keys = block_keys(tokens, 4, 2)
    assert keys == block_keys(tokens[:8] + [99], 4, 2)  # the same first two blocks: the same keys
    assert keys[1] != block_keys([7] + tokens[1:], 4, 2)[1]  # one earlier token differs: the chain does
    assert block_keys(tokens, 4, 2, first=1, before=keys[0]) == keys[1:]  # a chain continued
    first = pool.allocate(2)
    for block, key in zip(first, keys):
        pool.register(block, key)
    assert pool.lookup(keys) == first and pool.lookup([b"other"] + keys) == []  # a run from the first key only
    pool.release(first)
    assert pool.counts() == (2, 2, 0) and pool.num_free == 4 and pool.lookup(keys) == first
    pool.share(first[:1])  # a later prompt reuses the first block: it is in use again
    assert pool.counts() == (2, 1, 1) and pool.num_free == 3
    other = pool.allocate(3)  # the two free ones, then the cached second block (its key forgotten)
    assert first[1] in other and pool.lookup(keys) == first[:1]
    assert pool.allocate(1) is None and pool.counts() == (0, 0, 4)
    pool.release(other + first[:1])
    assert pool.counts() == (3, 1, 0)
    with pytest.raises(RuntimeError, match="no owner"):
        pool.register(other[0], b"other")


def test_a_key_registered_twice_keeps_its_first_block():
    """The same prefix prefilled by two sequences at once: the second's block stays unregistered
    and is freed, not cached, when its sequence ends."""
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.register(a, b"k")
    pool.register(b, b"k")
    assert pool.lookup([b"k"]) == [a]
    pool.release([a, b])
    assert pool.counts() == (2, 1, 0)


def test_slots_follow_each_tokens_block_table_row():
    cache = PagedKVCache(1, n_blocks=6, block_size=4, n_kv_heads=1, head_dim=8, dtype=torch.float32, device=DEVICE)
    tables = on_device([[5, 2, 0], [1, 3, 4]])
    positions = on_device([0, 3, 4, 9, 2, 5, 11, 0])
    rows = tables[on_device([0, 0, 0, 0, 1, 1, 1, 1])]
    valid = on_device([True] * 7 + [False], torch.bool)
    assert cache.slots(positions, rows, valid).tolist() == [20, 23, 8, 1, 6, 13, 19, cache.scratch]


def paged_copy(k_rows, v_rows, block_size, seed=0):
    """The rows [B, S, K, hd] stored in shuffled blocks of a PagedKVCache, and their block table."""
    B, S, K, hd = k_rows.shape
    per_row = S // block_size
    cache = PagedKVCache(1, B * per_row + 3, block_size, K, hd, k_rows.dtype, k_rows.device)
    order = torch.randperm(cache.n_blocks, generator=torch.Generator().manual_seed(seed))[: B * per_row]
    table = order.view(B, per_row).to(k_rows.device)
    positions = torch.arange(S, device=k_rows.device).repeat(B)
    cache.write(0, cache.slots(positions, table.repeat_interleave(S, dim=0)), k_rows, v_rows)
    return cache, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, S, splits", [(3, 96, 4), (4, 1024, 1)], ids=["many-slices", "one-slice-long-rows"])
def test_paged_decode_attention_equals_contiguous(dtype, B, S, splits):
    """The Triton kernel (interpreted on the CPU) reading keys through a block table gives the
    bits it gives reading the same keys from contiguous rows, with many slices per row (64 keys
    a loop trip) and with one slice of rows that can be long (128 in 16 bits); so does the
    reference path's read (gather)."""
    H, K, hd, block = 4, 2, 32, 16
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, hd, generator=gen).to(DEVICE, dtype)
    k_rows = torch.randn(B, S, K, hd, generator=gen).to(DEVICE, dtype)
    v_rows = torch.randn(B, S, K, hd, generator=gen).to(DEVICE, dtype)
    seq_lens = on_device([1, 50, 96] if B == 3 else [1, 200, 777, 1024])
    long_steps = S == 1024 and dtype == torch.bfloat16
    assert keys_per_step(splits, S, dtype, hd, shared_memory_per_program(DEVICE)) == (128 if long_steps else 64)
    cache, table = paged_copy(k_rows, v_rows, block)
    k_blocks, v_blocks = cache.blocks(0)
    contiguous = decode_attention(q, k_rows, v_rows, seq_lens, hd**-0.5, splits=splits)
    paged = decode_attention(q, k_blocks, v_blocks, seq_lens, hd**-0.5, block_table=table, splits=splits)
    assert torch.equal(paged, contiguous)
    k_gathered, v_gathered = cache.gather(0, table)
    assert torch.equal(k_gathered, k_rows) and torch.equal(v_gathered, v_rows)
    with pytest.raises(ValueError, match="block_table must be"):
        decode_attention(q, k_blocks, v_blocks, seq_lens, 1.0, block_table=table[:2])


# ---- the forward through the cache -------------------------------------------------------------


def prefill_each(model, cache, rows, tables):
    """Each row prefilled alone into its blocks; returns each one's last-token logits [1, V]."""
    logits = []
    for row, table in zip(rows, tables):
        n = len(row)
        positions = torch.arange(n, device=DEVICE)
        cu_seqlens = on_device([0, n], torch.int32)
        meta = metadata.prefill(positions, cu_seqlens, cache, on_device([table]), n, rows=n)
        logits.append(model(on_device(row), positions, meta))
    return logits


@pytest.mark.parametrize("path", PATHS)
def test_decode_steps_through_scattered_blocks_equal_the_full_forward(model, path):
    """Two rows prefilled one at a time into scattered blocks, then decoded together one token
    per step at their own positions: every step's logits equal the plain forward's, on the
    reference path (gather + SDPA) and the fused one (the paged Triton kernel)."""
    use_path(model, path)
    rows = prompts([7, 3], model.config.vocab_size, seed=2)
    more = prompts([6, 6], model.config.vocab_size, seed=3)
    cache = PagedKVCache.for_model(model, n_blocks=12, block_size=4)
    tables = [[9, 2, 11, 0, 5], [4, 7, 1, 10, 3]]
    try:
        with torch.no_grad():
            last = prefill_each(model, cache, rows, tables)
            steps = []
            for t in range(6):
                positions = on_device([len(rows[0]) + t, len(rows[1]) + t])
                meta = metadata.decode(positions, cache, on_device(tables))
                steps.append(model(on_device([more[0][t], more[1][t]]), positions, meta))
            for i in range(2):
                full = model(on_device([rows[i] + more[i]]))[0]
                assert_logits_close(last[i][0], full[len(rows[i]) - 1])
                assert_logits_close(torch.stack([s[i] for s in steps]), full[len(rows[i]):])
    finally:
        use_path(model, None)


@pytest.mark.parametrize("path", PATHS)
def test_packed_prompts_equal_each_prompt_alone_in_transformers(checkpoint, model, path):
    """Three prompts packed into one forward (padding and an empty sequence at the end) into
    scattered blocks: each one's last-token logits equal transformers' for the prompt alone, and
    so do the logits of a next token decoded through the cache the pack wrote (fp32: SDPA per
    sequence on the reference path; the fused kernels on the other)."""
    reference = hf_model(seed=5, num_hidden_layers=2).to(DEVICE)  # the `checkpoint`'s model
    rows = prompts([5, 1, 8], model.config.vocab_size, seed=9)
    nexts = [row[0] for row in prompts([1, 1, 1], model.config.vocab_size, seed=10)]
    cache = PagedKVCache.for_model(model, n_blocks=12, block_size=4)
    table = on_device([[3, 8, 0], [11, 5, 6], [1, 9, 4], [7, 2, 10]])
    ids = sum(rows, []) + [0, 0]  # two padding tokens
    positions = on_device([p for row in rows for p in range(len(row))] + [0, 0])
    cu_seqlens = on_device([0, 5, 6, 14, 14], torch.int32)
    use_path(model, path)
    try:
        with torch.no_grad():
            logits = model(on_device(ids), positions, metadata.prefill(positions, cu_seqlens, cache, table, 8))
            next_positions = on_device([len(row) for row in rows])
            step = model(on_device(nexts), next_positions, metadata.decode(next_positions, cache, table[:3]))
            for i, row in enumerate(rows):
                want = reference(on_device([row + [nexts[i]]])).logits[0]
                assert_logits_close(logits[i], want[-2])
                assert_logits_close(step[i], want[-1])
            assert logits.shape[0] == 4  # a row of logits per sequence, the empty one's included
    finally:
        use_path(model, None)


@pytest.mark.parametrize("path", PATHS)
def test_several_new_tokens_after_cached_ones_equal_the_full_forward(model, path):
    """Chunks of several tokens after cached ones (a prompt's next chunk, a chat's next turn),
    packed, of different lengths after prefixes of different lengths: each attends to its cached
    tokens through the cache, as the plain forward of the whole sequence does."""
    use_path(model, path)
    rows = prompts([7, 4], model.config.vocab_size, seed=9)
    more = prompts([5, 3], model.config.vocab_size, seed=10)
    cache = PagedKVCache.for_model(model, n_blocks=8, block_size=4)
    tables = [[6, 0, 3], [1, 7, 2]]
    try:
        with torch.no_grad():
            prefill_each(model, cache, rows, tables)
            positions = on_device([len(row) + t for row, extra in zip(rows, more) for t in range(len(extra))])
            cu = on_device([0, 5, 8]).int()
            meta = metadata.extend(positions, cu, cache, on_device(tables), 12, all_logits=True)
            chunk = model(on_device(sum(more, [])), positions, meta)
            for i, start in enumerate((0, 5)):
                whole = model(on_device([rows[i] + more[i]]))[0]
                assert_logits_close(chunk[start : start + len(more[i])], whole[len(rows[i]) :])
    finally:
        use_path(model, None)


@requires_cuda
def test_packed_prefill_graph_in_bf16_matches_transformers(checkpoint):
    """On the GPU in bf16 a pack of prompts runs varlen flash attention, replayed from the graph of
    its token bucket (the pack's unused sequences empty; a second, smaller pack after a larger
    one, so that its padding holds the first one's ids and positions): each prompt's last-token
    logits, and those of a next token decoded through the cache the pack wrote, match
    transformers' bf16 forward of the prompt alone."""
    from serve.engine import Engine

    model = Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device=DEVICE, progress=False)
    reference = hf_model(seed=5, num_hidden_layers=2, dtype=torch.bfloat16).to(DEVICE)
    engine = Engine(model, max_batch=4, n_blocks=32, block_size=16)
    for seed, lengths in ((12, [40, 1, 23]), (14, [5, 13])):
        rows = prompts(lengths, model.config.vocab_size, seed=seed)
        nexts = [row[0] for row in prompts([1] * len(rows), model.config.vocab_size, seed=seed + 1)]
        table = on_device([[3 * i, 3 * i + 1, 3 * i + 2] for i in range(len(rows))])
        assert engine.prefill.fits(sum(lengths), len(rows))
        with torch.inference_mode():
            logits = engine.prefill([(row, 0) for row in rows], table).clone()
            positions = on_device([len(row) for row in rows])
            step = model(on_device(nexts), positions, metadata.decode(positions, engine.cache, table))
            for i, row in enumerate(rows):
                want = reference(on_device([row + [nexts[i]]])).logits[0]
                assert relative_error(logits[i], want[-2]) < LOGITS_BF16_REL
                assert relative_error(step[i], want[-1]) < LOGITS_BF16_REL
