"""Automatic prefix caching and chunked prefill in the serving engine (serve/engine.py,
runtime/blocks.py), on the CPU in fp32.

Reference: `model.generate` of each request alone (what a request must produce, whatever its
prefix's keys came from); the block pool's bookkeeping is checked after every engine step."""

import random

import pytest
import torch
from checkpoints import hf_model, prompts, save
from conftest import DEVICE, use_path

from qwen3 import Qwen3ForCausalLM
from runtime.sampling import SamplingParams
from serve.engine import Engine, Request
from serve.steps import chunk_cost

GREEDY = SamplingParams(temperature=0.0)
pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    checkpoint = save(hf_model(seed=5, num_hidden_layers=2), tmp_path_factory.mktemp("prefix"))
    return Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, device=DEVICE, progress=False)


def alone(model, prompt, max_tokens):
    out = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=max_tokens, eos_token_id=[],
                         temperature=0.0)
    return out[0, len(prompt) :].tolist()


def run_alone(engine, prompt, max_tokens):
    """Run one request through the engine to its end: its tokens."""
    outputs = []
    engine.add(Request(prompt, max_tokens, GREEDY, eos_ids=()), outputs.append)
    engine.run()
    return [t for o in outputs for t in o.token_ids]


def prefilled_tokens(model):
    """A list that each prefill forward (not a decode step) appends its token count to, and its hook."""
    counts = []
    hook = model.register_forward_pre_hook(
        lambda module, args: counts.append(args[0].shape[0]) if args[2].rows != 1 else None)
    return counts, hook


def assert_blocks_add_up(engine):
    stats = engine.prefix_stats()
    assert stats["empty_blocks"] + stats["cached_blocks"] + stats["used_blocks"] == engine.cache.n_blocks
    in_use = sum(len(s.blocks) for s in engine.running)  # blocks of running sequences, shared ones once
    assert stats["used_blocks"] <= in_use


@pytest.mark.parametrize("path", ["reference", "fused"])
def test_a_shared_prefix_is_prefilled_once_and_changes_no_token(model, path):
    """Requests that share a system prompt of 3 blocks and a half, one after another: the first
    prefills it all; each later one finds its 3 full blocks and prefills only its own tokens (the
    hit rate says so), and generates what it generates alone, and (reference path) what the engine
    without the cache generates. The fused path (the paged chunk kernel, interpreted here) with
    two requests: the interpreter's time."""
    use_path(model, path)
    try:
        system = prompts([3 * BLOCK + 2], model.config.vocab_size, seed=21)[0]
        users = prompts([5, 1, 9], model.config.vocab_size, seed=22)[: 3 if path == "reference" else 2]
        cached = Engine(model, max_batch=4, n_blocks=64, block_size=BLOCK, cuda_graph=False)
        plain = Engine(model, max_batch=4, n_blocks=64, block_size=BLOCK, cuda_graph=False, prefix_cache=False)
        counts, hook = prefilled_tokens(model)
        try:
            for user in users:
                prompt = system + user
                counts.clear()
                got = run_alone(cached, prompt, 4)
                prefilled = counts[0]
                assert got == alone(model, prompt, 4)
                if path == "reference":
                    assert got == run_alone(plain, prompt, 4)
                assert prefilled == (len(prompt) if user is users[0] else len(prompt) - 3 * BLOCK)
        finally:
            hook.remove()
        stats = cached.prefix_stats()
        assert stats["hit_tokens"] == (len(users) - 1) * 3 * BLOCK and stats["used_blocks"] == 0
        assert stats["cached_blocks"] > 0 and stats["prompt_tokens"] == sum(len(system) + len(u) for u in users)
        assert plain.prefix_stats()["hit_tokens"] == 0 and plain.prefix_stats()["cached_blocks"] == 0
    finally:
        use_path(model, None)


def test_a_conversations_next_turn_reuses_its_reply(model):
    """Turn 2 of a conversation is turn 1's prompt, its reply and a new message: the blocks the
    reply's decode steps wrote are found too, and turn 2 prefills only past them."""
    engine = Engine(model, max_batch=2, n_blocks=64, block_size=BLOCK, cuda_graph=False)
    first = prompts([6], model.config.vocab_size, seed=23)[0]
    reply = run_alone(engine, first, 11)
    second = first + reply + prompts([3], model.config.vocab_size, seed=24)[0]
    counts, hook = prefilled_tokens(model)
    try:
        got = run_alone(engine, second, 4)
    finally:
        hook.remove()
    # 6 + 11 = 17 tokens went through the cache: 16 of them in full blocks (the reply's last token's
    # keys were never written: its sequence ended on it).
    assert counts[0] == len(second) - 4 * BLOCK
    assert got == alone(model, second, 4)


def test_a_prompt_already_cached_whole_computes_its_last_token(model):
    """The same prompt twice, a whole number of blocks long: the second finds every block but the
    last, whose last token it must compute for its logits (a cached block is never written)."""
    engine = Engine(model, max_batch=2, n_blocks=32, block_size=BLOCK, cuda_graph=False)
    prompt = prompts([3 * BLOCK], model.config.vocab_size, seed=25)[0]
    first = run_alone(engine, prompt, 3)
    counts, hook = prefilled_tokens(model)
    try:
        second = run_alone(engine, prompt, 3)
    finally:
        hook.remove()
    assert counts == [BLOCK] and first == second == alone(model, prompt, 3)


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode(model):
    """Two streams decode while a prompt of 40 tokens arrives with prefill_tokens 8 (tokens alone):
    it is prefilled 8 tokens a step over 5 steps, and every step of those gives each stream its
    next token; everything equals its run alone."""
    engine = Engine(model, max_batch=4, n_blocks=64, block_size=BLOCK, cuda_graph=False, prefill_tokens=8,
                    attention_cost=0)
    streams = prompts([3, 5], model.config.vocab_size, seed=26)
    long_prompt = prompts([40], model.config.vocab_size, seed=27)[0]
    outputs = [[] for _ in range(3)]
    for out, prompt in zip(outputs, streams):
        engine.add(Request(prompt, 20, GREEDY, eos_ids=()), out.append)
    for _ in range(3):  # both prefilled and decoding
        engine.step()
    engine.add(Request(long_prompt, 3, GREEDY, eos_ids=()), outputs[2].append)
    counts, hook = prefilled_tokens(model)
    try:
        for _ in range(5):
            before = [len(out) for out in outputs[:2]]
            engine.step()
            assert [len(out) for out in outputs[:2]] == [n + 1 for n in before]
    finally:
        hook.remove()
    assert counts == [8] * 5
    engine.run()
    got = [[t for o in out for t in o.token_ids] for out in outputs]
    assert got == [alone(model, p, 20) for p in streams] + [alone(model, long_prompt, 3)]


def test_a_chunk_deep_in_a_long_prompt_is_shorter(model):
    """With attention counted (each token's keys cost attention_cost tokens' worth), the chunks of a
    60-token prompt under a budget of 16 shrink as they go deeper, each within the budget, and
    the prompt still generates what it does alone. The default cost comes from the model's shape."""
    assert 0 < Engine(model, n_blocks=8, block_size=BLOCK, cuda_graph=False).attention_cost < 1
    engine = Engine(model, max_batch=2, n_blocks=64, block_size=BLOCK, cuda_graph=False, prefill_tokens=16,
                    attention_cost=0.02)
    prompt = prompts([60], model.config.vocab_size, seed=29)[0]
    counts, hook = prefilled_tokens(model)
    try:
        got = run_alone(engine, prompt, 3)
    finally:
        hook.remove()
    starts = [sum(counts[:i]) for i in range(len(counts))]
    assert sum(counts) == 60 and counts == sorted(counts, reverse=True) and counts[0] > counts[-1] + 3
    assert all(chunk_cost(start, n, 0.02) <= 16 for start, n in zip(starts, counts))
    assert got == alone(model, prompt, 3)


def test_shared_prefixes_cancellations_and_preemptions_lose_nothing(model):
    """A randomized run under a small block budget: 40 requests over 3 shared prefixes of
    different lengths, arriving a few a step, some cancelled, many preempted, small chunks. Every
    request that completes generates what it does alone; after every step free + cached + in use
    = all blocks; at the end no block is in use and the cache was hit."""
    rng = random.Random(7)
    vocab = model.config.vocab_size
    bases = prompts([9, 14, 4], vocab, seed=28)
    engine = Engine(model, max_batch=5, n_blocks=16, block_size=BLOCK, cuda_graph=False, prefill_tokens=12)
    requests, outputs, ids = [], [], []
    pending = list(range(40))
    while pending or engine.has_work():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i = pending.pop(0)
                tail = prompts([rng.randint(1, 10)], vocab, seed=100 + i)[0]
                request = Request(bases[i % 3] + tail, rng.randint(1, 20), GREEDY, eos_ids=())
                requests.append(request)
                outputs.append([])
                ids.append(engine.add(request, outputs[-1].append).id)
        if ids and rng.random() < 0.08:
            engine.cancel(rng.choice(ids))
        engine.step()
        assert_blocks_add_up(engine)
    stats = engine.prefix_stats()
    assert stats["used_blocks"] == 0 and stats["empty_blocks"] + stats["cached_blocks"] == 16
    assert engine.preemptions > 0 and stats["hit_tokens"] > 0
    completed = 0
    for request, out in zip(requests, outputs):
        if out[-1].finish_reason == "length":
            completed += 1
            assert [t for o in out for t in o.token_ids] == alone(model, request.prompt_ids, request.max_tokens)
        else:
            assert out[-1].finish_reason == "cancelled"
    assert completed >= 30


def arriving_together(model, requests):
    """The requests (3 tokens each) added in one step and run to their ends: the engine, each prefill
    forward's chunk lengths (sorted), and each request's outputs."""
    engine = Engine(model, max_batch=4, n_blocks=64, block_size=BLOCK, cuda_graph=False)
    outputs = [[] for _ in requests]
    for out, prompt in zip(outputs, requests):
        engine.add(Request(prompt, 3, GREEDY, eos_ids=()), out.append)
    chunks = []
    hook = model.register_forward_pre_hook(
        lambda module, args: chunks.append(sorted(args[2].cu_seqlens.diff().tolist())) if args[2].rows != 1 else None)
    try:
        engine.run()
    finally:
        hook.remove()
    return engine, chunks, outputs


def test_prompts_that_arrive_together_with_one_prefix_prefill_it_once(model):
    """Four requests with one system prompt of 3 blocks and a half, arriving in the same step: the
    first is prefilled whole; the others wait one step, then find its blocks and prefill only their
    own tokens, packed together; every one generates what it does alone."""
    system = prompts([3 * BLOCK + 2], model.config.vocab_size, seed=30)[0]
    requests = [system + tail for tail in prompts([2, 5, 3, 4], model.config.vocab_size, seed=31)]
    engine, chunks, outputs = arriving_together(model, requests)
    assert chunks == [[len(requests[0])], sorted(len(p) - 3 * BLOCK for p in requests[1:])]
    assert engine.prefix_stats()["hit_tokens"] == 3 * 3 * BLOCK
    assert [[t for o in out for t in o.token_ids] for out in outputs] == [alone(model, p, 3) for p in requests]


def test_a_prompt_behind_one_waiting_for_a_prefix_is_not_held_back(model):
    """Two requests with one system prompt and a third with none of it, arriving together: the first
    and the third are prefilled in the first step (the second waits for the first's blocks, and
    the third, behind it, does not wait with it); every one generates what it does alone."""
    system = prompts([3 * BLOCK + 2], model.config.vocab_size, seed=30)[0]
    shared = [system + tail for tail in prompts([2, 5], model.config.vocab_size, seed=31)]
    requests = [*shared, prompts([7], model.config.vocab_size, seed=32)[0]]
    _, chunks, outputs = arriving_together(model, requests)
    assert chunks == [sorted([len(requests[0]), len(requests[2])]), [len(requests[1]) - 3 * BLOCK]]
    assert [[t for o in out for t in o.token_ids] for out in outputs] == [alone(model, p, 3) for p in requests]


def test_when_blocks_run_short_the_request_that_arrived_last_is_preempted(model):
    """First come, first served: P, passed over while R computes their common prefix, is admitted
    after Q, which arrived behind it; when the cache runs short, Q is preempted, not the older P.
    Every request generates what it does alone."""
    system = prompts([3 * BLOCK], model.config.vocab_size, seed=1)[0]
    requests = {"R": (system + [7], 2), "P": (system + [9, 9], 20), "Q": (prompts([7], model.config.vocab_size,
                                                                                  seed=2)[0], 20)}
    engine = Engine(model, max_batch=4, n_blocks=12, block_size=BLOCK, cuda_graph=False, attention_cost=0)
    outputs = {name: [] for name in requests}
    ids = {engine.add(Request(prompt, n, GREEDY, eos_ids=()), outputs[name].append).id: name
           for name, (prompt, n) in requests.items()}
    admitted, preempted = [], []
    while engine.has_work():
        before = engine.preemptions
        engine.step()
        admitted += [ids[s.id] for s in engine.running if ids[s.id] not in admitted]
        if engine.preemptions > before:
            preempted += [ids[s.id] for s in engine.waiting]
    assert admitted == ["R", "Q", "P"] and preempted and set(preempted) == {"Q"}
    for name, (prompt, n) in requests.items():
        assert [t for o in outputs[name] for t in o.token_ids] == alone(model, prompt, n), name
