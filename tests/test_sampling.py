"""Sampling parameters' refusals, and penalized generation against transformers' generate (the
sampler's draws are tests/test_sampler.py's)."""

import numpy as np
import pytest
import torch
from checkpoints import hf_model, save

from qwen3 import Qwen3ForCausalLM
from runtime.sampling import SamplingParams


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


def test_numpy_numbers_are_taken_as_the_python_numbers_they_equal():
    """A value read from a numpy array means what the Python number does; a numpy float is still
    not an integer (top_k), nor a numpy bool a number."""
    assert SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.875)) == \
        SamplingParams(temperature=0.5, top_k=3, top_p=0.875)
    assert type(SamplingParams(top_k=np.int32(3)).top_k) is int
    with pytest.raises(ValueError, match="top_k must be an integer >= 0 .*, got 2.0"):
        SamplingParams(top_k=np.float32(2))
    with pytest.raises(ValueError, match="temperature must be >= 0 and finite"):
        SamplingParams(temperature=np.bool_(True))


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
