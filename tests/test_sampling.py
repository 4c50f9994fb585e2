"""Sampling filters and penalties against distributions worked out by hand, and penalized
generation against transformers' generate."""

import math

import pytest
import torch
from checkpoints import hf_model, save
from conftest import DEVICE, requires_cuda

from qwen3 import Qwen3ForCausalLM
from runtime.sampling import SamplingParams, apply_penalties, draw, filter_logits, next_token

PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]


def logits():
    return torch.tensor([PROBS]).log()


def kept_distribution(**params) -> list[float]:
    return filter_logits(logits(), SamplingParams(**params)).softmax(-1)[0].tolist()


def assert_dist(actual, expected):
    assert actual == pytest.approx(expected, abs=1e-6)


def test_top_k_keeps_the_k_most_likely():
    assert_dist(kept_distribution(top_k=3), [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0])


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    # 0.5 < 0.6, so 0.2 (which crosses 0.6) stays; 0.15 is dropped.
    assert_dist(kept_distribution(top_p=0.6), [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0])
    assert_dist(kept_distribution(top_p=0.45), [1, 0, 0, 0, 0])  # 0.5 crosses it alone
    assert_dist(kept_distribution(top_p=0.3), [1, 0, 0, 0, 0])  # never empty


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    # threshold 0.25 * 0.5 = 0.125: keeps 0.5, 0.2, 0.15
    assert_dist(kept_distribution(min_p=0.25), [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0])


def test_temperature_sharpens():
    t = 0.5  # p_i^(1/t) renormalized
    powered = [p ** (1 / t) for p in PROBS]
    assert_dist(kept_distribution(temperature=t), [p / sum(powered) for p in powered])


def test_repetition_and_presence_penalties():
    raw = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_penalties(raw, seen, SamplingParams(repetition_penalty=2.0))
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0]]  # positive divided, negative multiplied
    out = apply_penalties(raw, seen, SamplingParams(presence_penalty=0.75))
    assert out.tolist() == [[1.25, -1.75, 0.5, 3.0]]


def test_greedy_picks_the_penalized_argmax():
    raw = torch.tensor([[3.0, 2.9, 0.0]])
    seen = torch.tensor([[True, False, False]])
    assert next_token(raw, seen, SamplingParams(temperature=0.0)).item() == 0
    assert next_token(raw, seen, SamplingParams(temperature=0.0, repetition_penalty=1.1)).item() == 1


def test_draws_follow_the_filtered_distribution():
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(top_k=3)
    n = 20000
    batch = logits().expand(n, -1)
    draws = next_token(batch, torch.zeros_like(batch, dtype=torch.bool), params, gen)
    freq = torch.bincount(draws, minlength=5).double() / n
    expected = torch.tensor([0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0], dtype=torch.double)
    # binomial standard error at n=20000 is <= 0.0036; 4 sigma
    assert (freq - expected).abs().max() < 4 * math.sqrt(0.25 / n)


def test_draw_is_torch_multinomial_from_the_same_generator():
    """draw() gives the tokens torch.multinomial(probs, 1) gives from the same seed: its algorithm,
    without its read-back of the probabilities."""
    probs = torch.rand(6, 5000, generator=torch.Generator().manual_seed(1)).pow(8).to(DEVICE)
    probs = probs / probs.sum(-1, keepdim=True)
    expected = torch.multinomial(probs, 1, generator=torch.Generator(DEVICE).manual_seed(2)).squeeze(-1)
    assert torch.equal(draw(probs, torch.Generator(DEVICE).manual_seed(2)), expected)


@requires_cuda
def test_sampling_does_not_wait_for_the_gpu():
    """Choosing a token with every filter and penalty on leaves the host free to queue the next
    decode step: nothing is read back (torch.multinomial would read the probabilities back)."""
    logits = torch.randn(3, 50000, device=DEVICE)
    seen = torch.rand(3, 50000, device=DEVICE) < 0.01
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.5)
    generator = torch.Generator(DEVICE).manual_seed(0)
    next_token(logits, seen, params, generator)  # first calls set up their kernels
    torch.cuda.set_sync_debug_mode("error")
    try:
        next_token(logits, seen, params, generator)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(temperature=-0.1), "temperature must be >= 0 and finite"),
        (dict(temperature=float("nan")), "temperature must be >= 0 and finite .*, got nan"),
        (dict(temperature=float("inf")), "temperature must be >= 0 and finite .*, got inf"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(top_k=2.5), "top_k must be an integer >= 0"),
        (dict(min_p=2.0), "min_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0 and finite"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
        (dict(presence_penalty=float("inf")), "presence_penalty must be a finite number"),
    ],
)
def test_invalid_values_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """transformers' Qwen3 and ours from its checkpoint; greedy on this prompt repeats tokens it generated."""
    reference = hf_model(seed=8)
    path = save(reference, tmp_path_factory.mktemp("penalties"))
    return reference, Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, progress=False)


PROMPT = torch.tensor([[5, 17, 42, 99, 7]])
NEW = 24


def test_repetition_penalty_in_generation_equals_transformers(models):
    reference, ours = models
    plain = ours.generate(PROMPT, max_new_tokens=NEW, temperature=0.0)
    penalized = ours.generate(PROMPT, max_new_tokens=NEW, temperature=0.0, repetition_penalty=1.3)
    expected = reference.generate(PROMPT, max_new_tokens=NEW, do_sample=False, repetition_penalty=1.3)
    assert torch.equal(penalized, expected)
    # The penalty changes the text, and among the tokens it penalizes are some the model generated.
    generated = plain[0, PROMPT.shape[1]:].tolist()
    assert not torch.equal(penalized, plain)
    assert len(set(generated)) < len(generated) and not set(generated) & set(PROMPT[0].tolist())


def test_presence_penalty_in_generation_never_repeats_a_token(models):
    """transformers has no presence penalty. A penalty far above the logits' spread makes greedy
    choose the best token not yet in the sequence, prompt or generated, at every step."""
    _, ours = models
    plain = ours.generate(PROMPT, max_new_tokens=NEW, temperature=0.0)
    assert len(set(plain[0].tolist())) < plain.shape[1]  # without it, tokens repeat
    penalized = ours.generate(PROMPT, max_new_tokens=NEW, temperature=0.0, presence_penalty=1e3)
    assert len(set(penalized[0].tolist())) == penalized.shape[1]
    with torch.no_grad():
        logits = ours(penalized[:, :-1])[0]  # [T + NEW - 1, V], no cache
    for t in range(PROMPT.shape[1], penalized.shape[1]):
        unseen = logits[t - 1].clone()
        unseen[penalized[0, :t]] = float("-inf")
        assert penalized[0, t] == unseen.argmax()
