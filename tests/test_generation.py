"""KV-cached generation against transformers' generate, and the cache against the no-cache forward."""

import pytest
import torch
from checkpoints import hf_model, save
from conftest import DEVICE, requires_cuda
from tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

from qwen3 import KVCache, Qwen3ForCausalLM

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    reference = hf_model(seed=11, num_hidden_layers=3).to(DEVICE)
    path = save(reference, tmp_path_factory.mktemp("gen"))
    ours = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, device=DEVICE, progress=False)
    return reference, ours


def prompts(lengths, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def left_pad(rows, pad=0):
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=DEVICE)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=DEVICE)
    return ids, mask


def hf_greedy(reference, ids, mask):
    return reference.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0)


def test_greedy_equals_transformers_single(models):
    reference, ours = models
    ids, mask = left_pad(prompts([9], reference.config.vocab_size))
    expected = hf_greedy(reference, ids, mask)
    actual = ours.generate(ids, max_new_tokens=NEW_TOKENS, temperature=0.0)
    assert actual.shape == (1, 9 + NEW_TOKENS)
    assert torch.equal(actual, expected)


def test_greedy_equals_transformers_batched_left_padded(models):
    reference, ours = models
    rows = prompts([5, 12, 1, 8], reference.config.vocab_size, seed=1)
    ids, mask = left_pad(rows)
    expected = hf_greedy(reference, ids, mask)
    actual = ours.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, temperature=0.0)
    assert torch.equal(actual, expected)
    for i, row in enumerate(rows):  # each row is what that prompt generates alone
        alone = ours.generate(torch.tensor([row], device=DEVICE), max_new_tokens=NEW_TOKENS, temperature=0.0)
        assert torch.equal(actual[i, ids.shape[1]:], alone[0, len(row):])


def test_cached_logits_equal_the_full_forward_at_every_step(models):
    _, ours = models
    ids = torch.tensor(prompts([30], ours.config.vocab_size, seed=2), device=DEVICE)
    with torch.no_grad():
        full = ours(ids)
        cache = KVCache.for_model(ours, batch=1, max_len=30)
        pieces = [ours(ids[:, :10], cache=cache)]  # prefill 10, then one token at a time
        pieces += [ours(ids[:, t : t + 1], cache=cache) for t in range(10, 30)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=LOGITS_FP32_RTOL, atol=LOGITS_FP32_ATOL)
    assert cache.length == 30
    with pytest.raises(ValueError, match="KV cache is full"), torch.no_grad():
        ours(ids[:, :1], cache=cache)


def test_static_shape_steps_equal_slicing_steps_on_a_padded_batch(models):
    """The decode step a CUDA graph replays (KVCache.slot set: it writes at a device-side slot and
    attends over every slot through a mask) against the usual step, which slices the cache, after
    the same left-padded prefill. Slots not yet written are zeroed, as GraphedDecodeStep does."""
    _, ours = models
    ids, mask = left_pad(prompts([5, 9], ours.config.vocab_size, seed=6))
    B, T, new = *ids.shape, 6
    key_valid = torch.ones(B, T + new, dtype=torch.bool, device=DEVICE)
    key_valid[:, :T] = mask.bool()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    slicing, static = (KVCache.for_model(ours, B, T + new) for _ in range(2))
    with torch.no_grad():
        for cache in (slicing, static):
            ours(ids, positions, cache=cache, attention_mask=key_valid[:, :T])
        static.k[:, :, :, T:].zero_()
        static.v[:, :, :, T:].zero_()
        step_ids, step_positions = ids[:, -1:], positions[:, -1:]
        for _ in range(new):
            step_positions = step_positions + 1
            expected = ours(step_ids, step_positions, cache=slicing,
                            attention_mask=key_valid[:, : slicing.length + 1], last_only=True)
            static.slot = torch.tensor([static.length], device=DEVICE)
            actual = ours(step_ids, step_positions, cache=static, attention_mask=key_valid, last_only=True)
            static.slot = None
            static.advance(1)
            torch.testing.assert_close(actual, expected, rtol=LOGITS_FP32_RTOL, atol=LOGITS_FP32_ATOL)
            step_ids = expected[:, -1].argmax(-1, keepdim=True)
    assert static.length == slicing.length == T + new


@requires_cuda
def test_cuda_graph_decoding_equals_transformers_batched_left_padded(models):
    reference, ours = models
    ids, mask = left_pad(prompts([5, 12, 1, 8], reference.config.vocab_size, seed=1))
    expected = hf_greedy(reference, ids, mask)
    actual = ours.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, temperature=0.0, cuda_graph=True)
    assert torch.equal(actual, expected)


def test_stops_per_row_at_eos_and_pads(models):
    _, ours = models
    ids, mask = left_pad(prompts([4, 7], ours.config.vocab_size, seed=3))
    free = ours.generate(ids, attention_mask=mask, max_new_tokens=12, temperature=0.0)
    eos = int(free[0, ids.shape[1] + 2])  # row 0's third new token
    pad = ours.config.vocab_size - 1
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=12, temperature=0.0, eos_token_id=eos,
                        pad_token_id=pad)
    row0 = out[0, ids.shape[1]:].tolist()
    stop = row0.index(eos)
    assert stop <= 2 and all(t == pad for t in row0[stop + 1 :])
    row1 = out[1, ids.shape[1]:].tolist()
    expected1 = free[1, ids.shape[1]:].tolist()[: len(row1)]
    cut = expected1.index(eos) + 1 if eos in expected1 else len(row1)
    assert row1[:cut] == expected1[:cut]


def test_seed_makes_sampling_reproducible(models):
    _, ours = models
    ids = torch.tensor(prompts([6], ours.config.vocab_size, seed=4), device=DEVICE)
    kwargs = dict(max_new_tokens=20, temperature=1.0, top_k=50, top_p=0.9)
    a = ours.generate(ids, seed=123, **kwargs)
    b = ours.generate(ids, seed=123, **kwargs)
    c = ours.generate(ids, seed=124, **kwargs)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_generation_config_supplies_defaults(models):
    _, ours = models
    ids = torch.tensor(prompts([6], ours.config.vocab_size, seed=5), device=DEVICE)
    greedy = ours.generate(ids, max_new_tokens=10, temperature=0.0)
    ours.generation_config = {"do_sample": False}
    try:
        assert torch.equal(ours.generate(ids, max_new_tokens=10, seed=1), greedy)
    finally:
        ours.generation_config = {}


def test_refusals_before_any_compute(models):
    _, ours = models
    ctx = ours.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"exceeds the model's context of {ctx}"):
        ours.generate(torch.zeros(1, ctx - 3, dtype=torch.long, device=DEVICE), max_new_tokens=4)
    with pytest.raises(ValueError, match="token ids in"):
        ours.generate(torch.full((1, 3), ours.config.vocab_size, device=DEVICE), max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        ours.generate(torch.zeros(1, 3, dtype=torch.long, device=DEVICE), temperature=-1.0)
    with pytest.raises(TypeError, match="LongTensor"):
        ours.generate(torch.zeros(3, dtype=torch.long, device=DEVICE))
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device"):
            ours.generate(torch.zeros(1, 3, dtype=torch.long), cuda_graph=True)
