"""KV-cached generation against transformers' generate, and the cache against the no-cache forward."""

import numpy as np
import pytest
import torch
from checkpoints import hf_model, prompts, save
from conftest import DEVICE, INTERPRETED, requires_cuda, use_path

from qwen3 import Qwen3ForCausalLM
from runtime.generate import pad_left
from runtime.sampling import GREEDY_BELOW

NEW_TOKENS = 40


def new_tokens(path: str, n: int = NEW_TOKENS) -> int:
    """Tokens to decode on `path`: n, but 6 where Triton's interpreter runs the fused
    kernels one program after another (the same path decodes n tokens in the GPU test set)."""
    return min(n, 6) if path == "fused" and INTERPRETED else n


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    reference = hf_model(seed=11, num_hidden_layers=2).to(DEVICE)
    path = save(reference, tmp_path_factory.mktemp("gen"))
    ours = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, device=DEVICE, progress=False)
    return reference, ours



def left_pad(rows, pad=0):
    ids, mask = pad_left(rows, pad)
    return ids.to(DEVICE), mask.to(DEVICE)


def hf_greedy(reference, ids, mask, n=NEW_TOKENS):
    return reference.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0)


def test_greedy_equals_transformers_single(models):
    reference, ours = models
    ids, mask = left_pad(prompts([9], reference.config.vocab_size))
    expected = hf_greedy(reference, ids, mask)
    actual = ours.generate(ids, max_new_tokens=NEW_TOKENS, temperature=0.0)
    assert actual.shape == (1, 9 + NEW_TOKENS)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("path", ["reference", "fused"])
def test_greedy_equals_transformers_batched_left_padded(models, path):
    reference, ours = models
    rows = prompts([5, 12, 1, 8], reference.config.vocab_size, seed=1)
    ids, mask = left_pad(rows)
    n = new_tokens(path)
    expected = hf_greedy(reference, ids, mask, n)
    use_path(ours, path)
    try:
        actual = ours.generate(ids, attention_mask=mask, max_new_tokens=n, temperature=0.0)
        for i, row in enumerate(rows):  # each row is what that prompt generates alone (batch 1: GEMVs)
            alone = ours.generate(torch.tensor([row], device=DEVICE), max_new_tokens=n, temperature=0.0)
            assert torch.equal(actual[i, ids.shape[1]:], alone[0, len(row):])
    finally:
        use_path(ours, None)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("path", ["reference", "fused"])
def test_right_padded_batch_generates_each_row_as_alone(models, path):
    """A tokenizer pads on the right by default: each row continues from its last real token."""
    _, ours = models
    use_path(ours, path)
    rows = prompts([5, 12, 1], ours.config.vocab_size, seed=7)
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=DEVICE)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=DEVICE)
    n = new_tokens(path, 12)
    try:
        out = ours.generate(ids, attention_mask=mask, max_new_tokens=n, temperature=0.0, eos_token_id=[])
        for i, row in enumerate(rows):
            alone = ours.generate(torch.tensor([row], device=DEVICE), max_new_tokens=n, temperature=0.0,
                                  eos_token_id=[])
            assert torch.equal(out[i, width:], alone[0, len(row):])
    finally:
        use_path(ours, None)


def test_padding_between_tokens_or_an_empty_row_is_refused(models):
    _, ours = models
    ids = torch.ones(2, 4, dtype=torch.long, device=DEVICE)
    for mask in ([[1, 1, 1, 1], [0, 2, 2, 2]], [[1.0, 1.0, 1.0, 1.0], [0.0, 0.5, 1.0, 1.0]]):
        with pytest.raises(ValueError, match=r"attention_mask must hold only 0 \(padding\) and 1 \(token\), or bools"):
            ours.generate(ids, attention_mask=torch.tensor(mask, device=DEVICE))
    bools = torch.tensor([[True, True, True, True], [False, True, True, True]], device=DEVICE)
    assert torch.equal(ours.generate(ids, attention_mask=bools, max_new_tokens=3, temperature=0.0),
                       ours.generate(ids, attention_mask=bools.long(), max_new_tokens=3, temperature=0.0))
    with pytest.raises(ValueError, match="row 1 of attention_mask has padding between its tokens"):
        ours.generate(ids, attention_mask=torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]], device=DEVICE))
    with pytest.raises(ValueError, match="row 0 of attention_mask is all padding"):
        ours.generate(ids, attention_mask=torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]], device=DEVICE))


def test_on_token_streams_exactly_the_returned_tokens(models):
    _, ours = models
    ids, mask = left_pad(prompts([4, 7], ours.config.vocab_size, seed=3))
    free = ours.generate(ids, attention_mask=mask, max_new_tokens=12, temperature=0.0)
    eos = int(free[0, ids.shape[1] + 2])
    streamed = []
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=12, temperature=0.0, eos_token_id=eos,
                        on_token=lambda t: streamed.append(t.tolist()))
    assert torch.tensor(streamed, device=DEVICE).T.tolist() == out[:, ids.shape[1]:].tolist()


@requires_cuda
def test_cuda_graph_decoding_equals_transformers_batched_left_padded(models):
    reference, ours = models
    ids, mask = left_pad(prompts([5, 12, 1, 8], reference.config.vocab_size, seed=1))
    expected = hf_greedy(reference, ids, mask)
    actual = ours.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, temperature=0.0, cuda_graph=True)
    assert torch.equal(actual, expected)


@requires_cuda
@pytest.mark.parametrize("path", ["fused", "reference"])
def test_graphed_decoding_equals_eager_decoding_in_fp32(models, path):
    """The default on CUDA (decode steps replayed from a CUDA graph) chooses the same tokens as
    the eager loop, on the fused path and the unfused one."""
    _, ours = models
    use_path(ours, path)
    ids, mask = left_pad(prompts([5, 30, 17], ours.config.vocab_size, seed=12))
    try:
        graphed = ours.generate(ids, attention_mask=mask, max_new_tokens=60, temperature=0.0, eos_token_id=[])
        eager = ours.generate(ids, attention_mask=mask, max_new_tokens=60, temperature=0.0, eos_token_id=[],
                              cuda_graph=False)
    finally:
        use_path(ours, None)
    assert torch.equal(graphed, eager)


@requires_cuda
def test_graphed_token_choice_equals_eager_with_penalties_and_stops(models):
    """The token choice inside the graph (the tokens seen for the penalty, each row's stop step,
    the padding after it) chooses what the eager loop chooses."""
    _, ours = models
    ids, mask = left_pad(prompts([5, 30, 17], ours.config.vocab_size, seed=13))
    free = ours.generate(ids, attention_mask=mask, max_new_tokens=40, temperature=0.0, repetition_penalty=1.3,
                         eos_token_id=[], cuda_graph=False)
    eos = int(free[1, ids.shape[1] + 9])  # row 1's tenth token: rows stop at different steps
    kwargs = dict(attention_mask=mask, max_new_tokens=40, temperature=0.0, repetition_penalty=1.3, eos_token_id=eos)
    assert torch.equal(ours.generate(ids, **kwargs), ours.generate(ids, **kwargs, cuda_graph=False))


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
    assert torch.equal(ours.generate(ids, seed=np.int64(123), **kwargs | dict(top_p=np.float64(0.9),
                                                                              max_new_tokens=np.int64(20))), a)


def test_a_seeded_row_of_a_batch_samples_what_its_prompt_samples_alone(models):
    """Each row draws from its own stream (the seed's, at its own step), so padding and the other
    rows change nothing: the README's promise for --seed with several prompts."""
    _, ours = models
    rows = prompts([6, 3, 9], ours.config.vocab_size, seed=14)
    ids, mask = left_pad(rows)
    kwargs = dict(max_new_tokens=12, temperature=0.8, top_p=0.9, repetition_penalty=1.2, eos_token_id=[], seed=5)
    batch = ours.generate(ids, attention_mask=mask, **kwargs)
    for i, row in enumerate(rows):
        alone = ours.generate(torch.tensor([row], device=DEVICE), **kwargs)
        assert batch[i, ids.shape[1]:].tolist() == alone[0, len(row):].tolist()
    assert len(set(batch[0, ids.shape[1]:].tolist())) > 1


def test_generation_config_supplies_defaults(models):
    _, ours = models
    ids = torch.tensor(prompts([6], ours.config.vocab_size, seed=5), device=DEVICE)
    greedy = ours.generate(ids, max_new_tokens=10, temperature=0.0)
    ours.generation_config = {"do_sample": False}
    try:
        assert torch.equal(ours.generate(ids, max_new_tokens=10, seed=1), greedy)
    finally:
        ours.generation_config = {}


def test_a_temperature_too_small_to_divide_by_is_greedy(models):
    """Logits divided by 1e-40 overflow to inf (NaN probabilities, then any token): below
    GREEDY_BELOW a temperature is the argmax, as the limit it tends to."""
    _, ours = models
    ids = torch.tensor(prompts([6], ours.config.vocab_size, seed=8), device=DEVICE)
    greedy = ours.generate(ids, max_new_tokens=12, temperature=0.0)
    for cold in (1e-40, 1e-45, GREEDY_BELOW / 2):
        assert torch.equal(ours.generate(ids, max_new_tokens=12, temperature=cold, seed=0), greedy), cold


def test_ids_of_any_integer_type_are_taken_and_others_refused_in_one_line(models):
    """eos_token_id and pad_token_id as Python, numpy or tensor integers mean what the int does; a
    float, a bool or a string is a TypeError naming the argument; the output is a tensor of its own,
    outside inference mode (autograd may use it)."""
    _, ours = models
    ids = torch.tensor(prompts([5], ours.config.vocab_size, seed=9), device=DEVICE)
    eos = int(ours.generate(ids, max_new_tokens=3, temperature=0.0)[0, -2])  # a token greedy decoding reaches
    plain = ours.generate(ids, max_new_tokens=6, temperature=0.0, eos_token_id=eos)
    for same in (np.int64(eos), torch.tensor(eos), [torch.tensor(eos)], torch.tensor([eos])):
        assert torch.equal(ours.generate(ids, max_new_tokens=6, temperature=0.0, eos_token_id=same), plain)
    assert not plain.is_inference() and ours.generate(ids, max_new_tokens=0) is not ids
    for name, wrong in (("eos_token_id", 1.0), ("eos_token_id", True), ("eos_token_id", torch.tensor([1.0])),
                        ("pad_token_id", "0"), ("pad_token_id", 1.5)):
        with pytest.raises(TypeError, match=f"{name} must be an integer token id"):
            ours.generate(ids, max_new_tokens=2, **{name: wrong})
    with pytest.raises(TypeError, match="attention_mask must be a tensor like input_ids, got list"):
        ours.generate(ids, max_new_tokens=2, attention_mask=[[1] * 5])
    with pytest.raises(ValueError, match="temperature must be >= 0 and finite"):
        ours.generate(ids, max_new_tokens=2, temperature=True)


def test_refusals_before_any_compute(models):
    _, ours = models
    ctx = ours.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"maximum context length is {ctx} tokens.*requested {ctx + 1} tokens"):
        ours.generate(torch.zeros(1, ctx - 3, dtype=torch.long, device=DEVICE), max_new_tokens=4)
    # The context holds a row's tokens, not its padding: a short row padded wider than what fits is taken.
    row = prompts([4], ours.config.vocab_size, seed=3)
    ids, mask = left_pad([[0] * (ctx - 6) + row[0]])
    mask[:, : ctx - 6] = 0
    alone = ours.generate(torch.tensor(row, device=DEVICE), max_new_tokens=4, temperature=0.0)
    assert torch.equal(ours.generate(ids, attention_mask=mask, max_new_tokens=4, temperature=0.0)[:, -8:], alone)
    with pytest.raises(ValueError, match="token ids in"):
        ours.generate(torch.full((1, 3), ours.config.vocab_size, device=DEVICE), max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        ours.generate(torch.zeros(1, 3, dtype=torch.long, device=DEVICE), temperature=-1.0)
    with pytest.raises(TypeError, match="LongTensor"):
        ours.generate(torch.zeros(3, dtype=torch.long, device=DEVICE))
    ids = torch.zeros(1, 3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"input_ids \(0, 3\) holds no prompt"):
        ours.generate(torch.zeros(0, 3, dtype=torch.long, device=DEVICE), max_new_tokens=2)
    with pytest.raises(ValueError, match="maximum context length"):  # numpy's int16 would wrap around in the sum
        ours.generate(ids, max_new_tokens=np.int16(32600))
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0, got True"):
        ours.generate(ids, True)
    with pytest.raises(ValueError, match=r"eos_token_id must be token ids in \[0, \d+\), got \[-1\]"):
        ours.generate(ids, max_new_tokens=2, eos_token_id=-1)  # not blamed on the pad id it defaults
    for seed in ("x", -1, 2**70):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
            ours.generate(ids, max_new_tokens=2, temperature=1.0, seed=seed)
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device"):
            ours.generate(torch.zeros(1, 3, dtype=torch.long), cuda_graph=True)
