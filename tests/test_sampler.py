"""The batched sampler: its draws follow transformers' filters, the fused kernels choose what the
torch reference chooses, and a row's tokens depend on its own logits, parameters and seed only."""


import pytest
import torch
from conftest import DEVICE, INTERPRETED, requires_cuda
from tolerances import SAMPLING_MAX_DEVIATIONS
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ops.sampling.candidates import choose_among_candidates
from ops.sampling.rejection import sample_by_rejection
from ops.sampling.scale import scaled_logits
from runtime.sampler import Sampler
from runtime.sampling import SamplingParams

V = 300  # more than the fused path's 128 candidates: both of its ways to a token are reached
SEEN = list(range(0, 60, 2))  # tokens "already in the sequence", for the penalties

# (parameters, spread of the logits): peaked rows settle inside the candidates, flat ones go past them.
CASES = {
    "qwen3-recommended": (SamplingParams(temperature=0.6, top_k=20, top_p=0.95), 2.0),
    "top_p-peaked": (SamplingParams(temperature=0.8, top_p=0.9), 2.0),
    "top_p-flat": (SamplingParams(top_p=0.95), 0.5),
    "min_p": (SamplingParams(min_p=0.05), 1.0),
    "min_p-flat": (SamplingParams(temperature=1.5, min_p=0.3), 0.3),
    "top_k-past-the-candidates": (SamplingParams(top_k=200), 1.0),
    "top_k-past-the-candidates-and-top_p": (SamplingParams(top_k=150, top_p=0.9), 0.5),
    "repetition-penalty": (SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.5), 2.0),
    "repetition-penalty-on-negative-logits": (SamplingParams(repetition_penalty=1.5), 1.0),  # none filtered
    "top_p-crossed-by-the-second-token": (SamplingParams(top_p=0.3), 4.0),  # p 0.22, 0.21: both kept
    "top_p-crossed-by-the-first-token": (SamplingParams(top_p=0.35), 8.0),  # p 0.40: it alone is kept
    "no-filter": (SamplingParams(), 1.0),
}


def case_logits(spread: float) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(3)) * spread


def transformers_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V]: the probabilities transformers' sampling gives each token after its processors, in the
    order its generate applies them."""
    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        processors.append(MinPLogitsWarper(params.min_p))
    scores = processors(torch.tensor([SEEN]), logits[None].clone())
    return scores.softmax(-1)[0].double()


def draws(logits: torch.Tensor, params: SamplingParams, n: int, how: str) -> torch.Tensor:
    """n first tokens of n rows that differ only in their seed (0..n-1)."""
    sampler = Sampler(n, V, DEVICE)
    for row in range(n):
        sampler.set_row(row, params, seed=row, seen_ids=SEEN)
    rows = torch.arange(n, device=DEVICE)
    return sampler(logits.to(DEVICE).expand(n, V), rows, how).cpu()


@pytest.mark.parametrize("how", ["reference", pytest.param("fused", marks=requires_cuda)])
@pytest.mark.parametrize("case", list(CASES))
def test_draws_follow_transformers_filters(case, how):
    params, spread = CASES[case]
    logits = case_logits(spread)
    if how == "fused" and Sampler.how([params], fused=True) != "fused":
        pytest.skip("the fused path sends these rows to the reference")
    n = 20000
    freq = torch.bincount(draws(logits, params, n, how), minlength=V).double() / n
    expected = transformers_distribution(logits, params)
    assert not freq[expected == 0].any(), "a token transformers filters out was drawn"
    sigma = (expected * (1 - expected) / n).sqrt()
    deviations = ((freq - expected).abs() - 1 / n).clamp(min=0) / sigma.clamp(min=1e-12)
    assert deviations[expected > 0].max() <= SAMPLING_MAX_DEVIATIONS
    assert (expected > 0).sum() == 1 if case == "top_p-crossed-by-the-first-token" else (expected > 0).sum() > 1


@pytest.mark.parametrize("how", ["reference", pytest.param("fused", marks=requires_cuda)])
def test_presence_penalty_lowers_each_seen_tokens_logit_by_its_amount(how):
    """Two likely tokens, one seen: the draws split between them as transformers' sequence bias of
    -presence_penalty on the seen one splits them (0.32 / 0.68 at 0.75; 0.5 would give 0.38)."""
    params = SamplingParams(presence_penalty=0.75)
    logits = torch.full((V,), -10.0)
    logits[SEEN[1]], logits[1] = 3.0, 3.0  # token 1 is odd: never seen
    n = 20000
    freq = torch.bincount(draws(logits, params, n, how), minlength=V).double() / n
    # Token 0 left out: transformers before 5.25 takes only positive ids in this list form (its
    # logit is e^-13 of the likely ones': leaving its bias out moves no compared probability).
    bias = SequenceBiasLogitsProcessor(sequence_bias=[[[t], -params.presence_penalty] for t in SEEN if t > 0])
    expected = bias(torch.tensor([SEEN]), logits[None].clone()).softmax(-1)[0].double()
    sigma = (expected * (1 - expected) / n).sqrt()
    for token in (SEEN[1], 1):
        assert abs(freq[token] - expected[token]) <= SAMPLING_MAX_DEVIATIONS * sigma[token], (token, freq[token])


MIXED = [
    SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
    SamplingParams(top_p=0.95),
    SamplingParams(temperature=0.7, min_p=0.05, presence_penalty=0.5),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),  # greedy, penalized
    SamplingParams(temperature=0.0),
    SamplingParams(top_k=200),
    SamplingParams(temperature=0.5, top_k=5, top_p=0.5, min_p=0.1),
    SamplingParams(top_p=0.3),
    SamplingParams(temperature=2.0, top_p=0.99),
    SamplingParams(top_k=150, min_p=0.01),
    SamplingParams(temperature=0.9, top_k=1),
    SamplingParams(temperature=1.5, min_p=0.3, repetition_penalty=0.8),
]


@pytest.mark.skipif(DEVICE.type != "cuda" and not INTERPRETED, reason="the fused kernels need CUDA or the interpreter")
@pytest.mark.parametrize("vocab", [V, 50, 2 * 4096 + 300])
def test_fused_kernels_choose_what_the_reference_chooses(vocab):
    """Rows of every kind of filter side by side, each with its own seed (up to 2**63 - 1: both
    halves of the key), over a few steps: a vocabulary past the candidates, one below them, and
    one of three chunks of the scaling pass and several blocks of the rejection kernel."""
    gen = torch.Generator().manual_seed(5)
    B = len(MIXED) * 3
    fused, reference = (Sampler(B, vocab, DEVICE) for _ in range(2))
    for sampler in (fused, reference):
        for row in range(B):
            seen = torch.randperm(vocab, generator=torch.Generator().manual_seed(row))[:vocab // 5].tolist()
            sampler.set_row(row, MIXED[row % len(MIXED)], seed=2**63 - 1 - 7919 * row, seen_ids=seen)
    rows = torch.arange(B, device=DEVICE)
    for step in range(3):
        logits = (torch.randn(B, vocab, generator=gen) * torch.tensor([0.3, 1.0, 3.0]).repeat(len(MIXED))[:, None])
        logits = logits.to(DEVICE)
        expected = reference(logits, rows, "reference")
        assert torch.equal(fused(logits, rows, "fused"), expected), f"step {step}"


@pytest.mark.skipif(DEVICE.type != "cuda" and not INTERPRETED, reason="the fused kernels need CUDA or the interpreter")
def test_top_k_keeps_every_token_tied_with_the_kth_past_the_candidates():
    """Equal logits: transformers' top-k keeps all the tokens tied with the k-th, past the 128
    candidates too; so do both paths (the fused one through the rejection kernel)."""
    B = 8
    fused, reference = Sampler(B, V, DEVICE), Sampler(B, V, DEVICE)
    for sampler in (fused, reference):
        for row in range(B):
            sampler.set_row(row, SamplingParams(top_k=50), seed=row)
    logits, rows = torch.zeros(B, V, device=DEVICE), torch.arange(B, device=DEVICE)
    tokens = fused(logits, rows, "fused")
    assert torch.equal(tokens, reference(logits, rows, "reference")) and int(tokens.max()) >= 128


@pytest.mark.parametrize("how", ["reference", "fused"])
def test_a_rows_tokens_depend_on_its_own_logits_parameters_and_seed_only(how):
    """The same request's row alone, and at another place in a batch of 16 other rows with other
    parameters, seeds and logits, draws the same tokens step after step."""
    if how == "fused" and DEVICE.type != "cuda" and not INTERPRETED:
        pytest.skip("the fused kernels need CUDA or the interpreter")
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2)
    gen = torch.Generator().manual_seed(9)
    alone, crowd = Sampler(1, V, DEVICE), Sampler(17, V, DEVICE)
    alone.set_row(0, params, seed=77, seen_ids=SEEN)
    for row in range(17):
        if row == 6:
            crowd.set_row(row, params, seed=77, seen_ids=SEEN)
        else:
            crowd.set_row(row, MIXED[row % len(MIXED)], seed=row, seen_ids=[row])
    rows_alone, rows_crowd = torch.tensor([0], device=DEVICE), torch.arange(17, device=DEVICE).flip(0)
    tokens_alone, tokens_crowd = [], []
    for _ in range(6):
        mine = torch.randn(V, generator=gen) * 0.5
        others = torch.randn(17, V, generator=gen)
        others[10] = mine  # batch position 10 holds sampler row 6 (rows_crowd is reversed)
        tokens_alone.append(int(alone(mine[None].to(DEVICE), rows_alone, how)[0]))
        tokens_crowd.append(int(crowd(others.to(DEVICE), rows_crowd, how)[10]))
    assert tokens_crowd == tokens_alone and len(set(tokens_alone)) > 1


@pytest.mark.skipif(DEVICE.type != "cuda" and not INTERPRETED, reason="the fused kernels need CUDA or the interpreter")
def test_penalties_divide_positive_multiply_negative_and_subtract_presence():
    """The scaling pass on worked values: a seen positive logit divided by the repetition penalty,
    a seen negative one multiplied (transformers' RepetitionPenaltyLogitsProcessor gives the same),
    then the presence penalty subtracted from every seen token (transformers has none)."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]] * 2, device=DEVICE)
    sampler = Sampler(2, 4, DEVICE)
    sampler.set_row(0, SamplingParams(repetition_penalty=2.0), seed=0, seen_ids=[0, 1])
    sampler.set_row(1, SamplingParams(repetition_penalty=2.0, presence_penalty=0.75), seed=0, seen_ids=[0, 1])
    rows = torch.arange(2, device=DEVICE)
    x, _ = scaled_logits(logits, rows, sampler.params, sampler.seeds, sampler.steps, sampler.seen)
    assert x.tolist() == [[1.0, -2.0, 0.5, 3.0], [0.25, -2.75, 0.5, 3.0]]
    transformers_rule = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[0, 1]]), logits[:1].cpu().clone())
    assert x[0].tolist() == transformers_rule[0].tolist()


def test_state_advances_by_the_tokens_drawn():
    """Each call advances its rows' steps (the next draw is new) and marks their tokens seen (the
    repetition penalty then applies to them); choose() alone changes nothing."""
    sampler = Sampler(2, V, DEVICE)
    params = SamplingParams(temperature=0.0, repetition_penalty=1e6)  # greedy, never the same token twice
    for row in range(2):
        sampler.set_row(row, params, seed=row)
    logits = torch.zeros(2, V, device=DEVICE)
    logits[:, 7] = 2.0
    logits[:, 9] = 1.0
    rows = torch.arange(2, device=DEVICE)
    assert sampler.choose(logits, rows, "reference").tolist() == [7, 7]
    assert sampler(logits, rows, "reference").tolist() == [7, 7]
    assert sampler(logits, rows, "reference").tolist() == [9, 9]  # 7 is penalized now


def test_greedy_rows_take_the_argmax_in_one_operation():
    assert Sampler.how([SamplingParams(temperature=0.0)] * 3, fused=True) == "greedy"
    assert Sampler.how([SamplingParams(temperature=0.0), SamplingParams()], fused=True) == "fused"
    assert Sampler.how([SamplingParams(temperature=0.0, repetition_penalty=1.1)], fused=False) == "reference"
    assert Sampler.how([SamplingParams(top_k=300, top_p=0.9)], fused=True) == "reference"
    logits = torch.randn(4, V, dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(Sampler(4, V, DEVICE)(logits, torch.arange(4, device=DEVICE), "greedy"), logits.argmax(-1))


def test_penalties_need_a_sampler_that_keeps_seen_tokens():
    with pytest.raises(ValueError, match="keeps no seen tokens"):
        Sampler(1, V, DEVICE, penalties=False).set_row(0, SamplingParams(repetition_penalty=1.1), seed=0)


@requires_cuda
def test_sampling_does_not_wait_for_the_gpu():
    """Choosing tokens with every filter and penalty on leaves the host free to queue the next
    decode step: nothing is read back."""
    B, vocab = len(MIXED), 50000
    sampler = Sampler(B, vocab, DEVICE)
    for row in range(B):
        sampler.set_row(row, MIXED[row], seed=row, seen_ids=list(range(row, vocab, 97)))
    logits, rows = torch.randn(B, vocab, device=DEVICE), torch.arange(B, device=DEVICE)
    sampler(logits, rows, "fused")  # first calls set up their kernels
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampler(logits, rows, "fused")
    finally:
        torch.cuda.set_sync_debug_mode("default")



@pytest.mark.skipif(DEVICE.type != "cuda" and not INTERPRETED, reason="the fused kernels need CUDA or the interpreter")
def test_the_rejection_kernel_chooses_what_the_reference_chooses():
    """The whole-vocabulary kernel on rows of every filter it takes, even those the candidates
    settle (a small top-k: many rounds, its kept set's edge reached in a quarter of the rows)."""
    filters = [dict(top_k=3), dict(top_k=10, min_p=0.2), dict(top_k=129), dict(top_k=200), dict(top_p=0.3),
               dict(top_p=0.9), dict(min_p=0.5), dict(temperature=0.7, min_p=0.2), dict()]
    B = 4 * len(filters)
    params = [SamplingParams(**filters[row % len(filters)]) for row in range(B)]
    reference = Sampler(B, V, DEVICE)
    for row in range(B):
        reference.set_row(row, params[row], seed=row, seen_ids=SEEN)
    logits = (torch.randn(B, V, generator=torch.Generator().manual_seed(6)) * 0.3).to(DEVICE)
    rows = torch.arange(B, device=DEVICE)
    tables = reference.params, reference.seeds, reference.steps
    x, chunks = scaled_logits(logits, rows, *tables, reference.seen)
    vals, idx = x.topk(128, dim=-1)
    _, _, whole = choose_among_candidates(vals, idx, chunks, rows, *tables, V)
    tokens = torch.full((B,), -1, dtype=torch.long, device=DEVICE)
    active = torch.ones(B, dtype=torch.bool, device=DEVICE)
    sample_by_rejection(x, whole, rows, *tables, active, tokens)
    assert torch.equal(tokens, reference.choose(logits, rows, "reference"))
