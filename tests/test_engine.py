"""The continuous-batching engine (serve/engine.py), on the CPU.

Reference: `model.generate` of each request alone (what a request must produce whatever runs
beside it); the cache and the forward through it are test_cache.py's."""

from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import hf_model, prompts, save
from conftest import DEVICE, requires_cuda, use_path

from qwen3 import Qwen3ForCausalLM
from runtime.sampling import SamplingParams
from runtime.text import load_tokenizer
from serve.engine import PREFILL_TOKENS, PREFILL_TOKENS_CPU, Engine, Request

GREEDY = SamplingParams(temperature=0.0)
pytestmark = pytest.mark.usefixtures("one_thread")
SHIPPED = Path(__file__).resolve().parent.parent / "weights" / "qwen3-stdlib-tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save(hf_model(seed=5, num_hidden_layers=2), tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def model(checkpoint):
    return Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, device=DEVICE, progress=False)



def alone(model, prompt, max_tokens, **kwargs):
    """The tokens model.generate gives this prompt by itself."""
    out = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=max_tokens, eos_token_id=[], **kwargs)
    return out[0, len(prompt):].tolist()


def collect(engine, request):
    """Add a request; returns the list its outputs are appended to."""
    outputs = []
    engine.add(request, outputs.append)
    return outputs


def tokens(outputs):
    return [t for o in outputs for t in o.token_ids]


# ---- the engine --------------------------------------------------------------------------------


@pytest.mark.parametrize("path, max_tokens", [("reference", [6, 14, 9, 4, 12]), ("fused", [2, 5, 3, 2, 3])])
def test_requests_joining_and_leaving_generate_what_they_would_alone(model, path, max_tokens):
    """Five greedy requests of different lengths through a batch of 3: the later ones join as the
    first ones finish; each gets exactly what model.generate gives it alone (on the torch path:
    the fused one is tested equal to it in test_generation). Triton: fewer tokens, interpreted."""
    lengths = [5, 11, 2, 8, 3]
    requests = [Request(p, m, GREEDY, eos_ids=()) for p, m in
                zip(prompts(lengths, model.config.vocab_size, seed=4), max_tokens)]
    expected = [alone(model, r.prompt_ids, r.max_tokens, temperature=0.0) for r in requests]
    use_path(model, path)
    try:
        engine = Engine(model, max_batch=3, n_blocks=64, block_size=4)
        outputs = [collect(engine, r) for r in requests]
        while engine.has_work():
            engine.step()
            assert len(engine.running) <= 3
        for request, out, want in zip(requests, outputs, expected):
            assert tokens(out) == want
            assert out[-1].finish_reason == "length" and out[-1].completion_tokens == request.max_tokens
        assert engine.peak_running == 3 and engine.free_blocks == 64
    finally:
        use_path(model, None)


@pytest.mark.parametrize("prefill_tokens, steps", [
    (5, [[5], [1, 2, 2], [5], [5], [1, 4], [5], [2, 3], [1]]),
    (24, [[2, 4, 7, 11], [3, 9]]),
    (10_000, [[2, 3, 4, 7, 9, 11]])], ids=["chunks", "two-steps", "all-together"])
def test_prompts_prefilled_together_generate_what_they_would_alone(model, prefill_tokens, steps):
    """Six prompts of different lengths, arriving together: each step prefills up to
    prefill_tokens prompt tokens (counting tokens alone: attention_cost 0), first the rest of
    prompts begun earlier, then prompts in arrival order, the last one cut to a chunk that fits
    (5: 5 of the 7-token prompt, then its last 2, the 2-token prompt and the first token of the
    11-token one...), packed into one forward (shortest chunk first); or whole prompts (7, 2, 11
    and 4 fill 24; then 9 and 3), or all in one forward: each row's tokens equal model.generate's
    for its prompt alone, the one whose max_tokens is 1 ending in its prefill beside the others."""
    lengths = [7, 2, 11, 4, 9, 3]
    requests = [Request(p, 1 if i == 1 else 4, GREEDY, eos_ids=())
                for i, p in enumerate(prompts(lengths, model.config.vocab_size, seed=7))]
    expected = [alone(model, r.prompt_ids, r.max_tokens, temperature=0.0) for r in requests]
    # Eager prefills (a GPU would replay each pack from a graph: test_graphed_engine_equals_eager_engine)
    engine = Engine(model, max_batch=6, n_blocks=64, block_size=4, prefill_tokens=prefill_tokens, cuda_graph=False,
                    attention_cost=0)  # prefill_tokens counts tokens alone
    outputs = [collect(engine, r) for r in requests]
    chunks = []  # each prefill forward's chunk lengths (a decode step's rows are 1 token each)
    hook = model.register_forward_pre_hook(
        lambda module, args: chunks.append(args[2].cu_seqlens.diff().tolist()) if args[2].rows != 1 else None)
    per_step = []  # of the steps that prefilled
    try:
        while engine.has_work():
            engine.step()
            if chunks:
                per_step.append(sum(chunks, []))
                chunks.clear()
    finally:
        hook.remove()
    assert per_step == steps
    assert [tokens(out) for out in outputs] == expected and outputs[1][-1].finish_reason == "length"
    with pytest.raises(ValueError, match="prefill_tokens"):
        Engine(model, prefill_tokens=0)
    Engine(model, attention_cost=np.float32(0.5))  # a numpy number is a number
    for wrong in (float("nan"), -1.0, float("inf"), "1", True):
        with pytest.raises(ValueError, match="attention_cost must be a finite number >= 0"):
            Engine(model, attention_cost=wrong)


def test_the_default_prefill_budget_is_the_devices(model):
    """The default budget is PREFILL_TOKENS on a GPU, PREFILL_TOKENS_CPU on the CPU (a step must stay
    inside the server's engine timeout): a 500-token prompt takes as many steps to its first token
    as with the device's budget given; the CPU's takes more than the GPU's."""
    steps = {}
    for budget in (None, PREFILL_TOKENS_CPU, PREFILL_TOKENS):
        engine = Engine(model, max_batch=1, n_blocks=64, prefill_tokens=budget)
        out = []
        engine.add(Request([1 + i % 100 for i in range(500)], 1), out.append)
        steps[budget] = 0
        while not out:
            engine.step()
            steps[budget] += 1
    default = PREFILL_TOKENS if DEVICE.type == "cuda" else PREFILL_TOKENS_CPU
    assert steps[None] == steps[default] and steps[PREFILL_TOKENS_CPU] > steps[PREFILL_TOKENS], steps


def test_out_of_blocks_new_requests_wait_and_nothing_is_corrupted(model):
    """A cache that holds about two sequences: the third waits in the queue until blocks free
    up; sequences that outgrow the cache preempt the request that arrived last, which is recomputed.
    Every request still gets what it gets alone, and every block comes back."""
    engine = Engine(model, max_batch=4, n_blocks=7, block_size=4)  # 28 token slots in all
    requests = [Request(p, 10, GREEDY, eos_ids=()) for p in prompts([6, 5, 7], model.config.vocab_size, seed=6)]
    outputs = [collect(engine, r) for r in requests]
    engine.step()
    assert len(engine.running) == 2 and len(engine.waiting) == 1  # no blocks for the third's prompt + growth
    assert engine.free_blocks == 3  # 2 + 2 prompt blocks taken; the third needs 2, and 1 per running is kept
    engine.run(timeout_s=120)
    assert engine.preemptions > 0
    for request, out in zip(requests, outputs):
        assert tokens(out) == alone(model, request.prompt_ids, 10, temperature=0.0)
    assert engine.free_blocks == 7 and not engine.sequences


def test_a_sequence_whose_last_token_is_in_flight_takes_no_block(model):
    """Steps are launched one ahead of reading their tokens: a sequence whose last token is in
    flight is not launched again, so it must not take a block (here the cache's last one, which
    would preempt the other sequence) for a position nothing will be written to."""
    engine = Engine(model, max_batch=2, n_blocks=3, block_size=4)
    requests = [Request(p, m, GREEDY, eos_ids=()) for p, m in zip(prompts([3, 4], model.config.vocab_size, 8), [2, 4])]
    outputs = [collect(engine, r) for r in requests]
    engine.run()
    assert engine.preemptions == 0 and engine.free_blocks == 3
    assert [tokens(o) for o in outputs] == [alone(model, r.prompt_ids, r.max_tokens, temperature=0.0) for r in requests]


def test_a_request_admitted_when_blocks_are_short_gets_each_token_once(model):
    """Prefill tokens are read one step after their launch. A request admitted while two running
    sequences are about to need a block each, then given room by a cancel, must still produce
    exactly its tokens alone: admitted without a block for its next token it was preempted in
    the step that prefilled it, prefilled again after the cancel, and read its first token twice."""
    a, c, b = prompts([4, 4, 4], model.config.vocab_size, seed=13)
    engine = Engine(model, max_batch=3, n_blocks=7, block_size=4)
    engine.add(Request(a, 10, GREEDY, eos_ids=()))
    seq_c = engine.add(Request(c, 10, GREEDY, eos_ids=()))
    for _ in range(4):
        engine.step()  # a and c reach position 8: each needs a new block in the next step
    out_b = collect(engine, Request(b, 3, GREEDY, eos_ids=()))
    engine.step()
    engine.cancel(seq_c.id)
    engine.run(timeout_s=60)
    assert tokens(out_b) == alone(model, b, 3, temperature=0.0)
    assert engine.free_blocks == 7


def test_cancelling_frees_blocks_at_once_and_the_others_continue(model):
    engine = Engine(model, max_batch=4, n_blocks=32, block_size=4)
    a, b = prompts([6, 9], model.config.vocab_size, seed=7)
    out_a = []
    seq_a = engine.add(Request(a, 40, GREEDY, eos_ids=()), out_a.append)
    out_b = collect(engine, Request(b, 12, GREEDY, eos_ids=()))
    for _ in range(3):
        engine.step()
    held = len(seq_a.blocks)
    free = engine.free_blocks
    engine.cancel(seq_a.id)
    engine.step()
    assert out_a[-1].finish_reason == "cancelled" and not seq_a.blocks
    assert engine.free_blocks >= free + held - 1  # a's blocks back (b may have taken one to grow)
    engine.run(timeout_s=60)
    assert tokens(out_b) == alone(model, b, 12, temperature=0.0)
    assert engine.free_blocks == 32


@pytest.mark.parametrize("path", ["reference", "fused"])
def test_a_seeded_request_samples_the_same_alone_and_in_a_batch(model, path):
    """A seeded sampled request gives the same tokens alone and beside 16 other requests of every
    kind (greedy, sampled with other parameters, the same parameters with another seed), which
    is what model.generate gives its prompt with that seed; the greedy ones beside it are
    unaffected by its parameters."""
    sampled = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
                             presence_penalty=0.3)
    others = [GREEDY, sampled, SamplingParams(temperature=0.6, top_k=20, top_p=0.95), SamplingParams(top_p=0.8)]
    # The interpreter runs the fused kernels' programs one by one: fewer neighbours and tokens there.
    n_others, steps = (16, 15) if path == "reference" else (4, 3)
    p, *rest = prompts([5] + [3 + i % 7 for i in range(n_others)], model.config.vocab_size, seed=8)

    def run(requests):
        engine = Engine(model, max_batch=len(requests), n_blocks=len(requests) * 8, block_size=4)
        outs = [collect(engine, r) for r in requests]
        engine.run(timeout_s=120)
        return [tokens(o) for o in outs]

    seeded = Request(p, steps, sampled, seed=1234, eos_ids=())
    crowd = [Request(q, steps, others[i % 4], seed=i if i % 4 else None, eos_ids=()) for i, q in enumerate(rest)]
    use_path(model, path)
    try:
        (by_itself,) = run([seeded])
        together = run(crowd[:3] + [seeded] + crowd[3:])
    finally:
        use_path(model, None)
    assert together[3] == by_itself and len(set(by_itself)) > 1
    assert together[0] == alone(model, rest[0], steps, temperature=0.0)
    assert by_itself == alone(model, p, steps, seed=1234, **{k: getattr(sampled, k) for k in (
        "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty")})


def test_stop_tokens_and_strings():
    """On the shipped model and its tokenizer: a stop string ends the text before it (and is never
    streamed, not even in part), a stop token ends the tokens after it."""
    shipped = Qwen3ForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32, device=DEVICE, progress=False)
    tok = load_tokenizer(SHIPPED)
    engine = Engine(shipped, tok, max_batch=2, n_blocks=32, block_size=8)
    ids = tok("def add(a, b):", add_special_tokens=False)["input_ids"]
    full = collect(engine, Request(ids, 24, GREEDY, eos_ids=()))
    engine.run(timeout_s=60)
    text = "".join(o.text for o in full)
    assert text == tok.decode(alone(shipped, ids, 24, temperature=0.0), skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = collect(engine, Request(ids, 24, GREEDY, stop=(stop, "never-printed"), eos_ids=()))
    eos = tokens(full)[2]
    stopped = collect(engine, Request(ids, 24, GREEDY, eos_ids=(eos,)))
    engine.run(timeout_s=60)
    assert "".join(o.text for o in cut) == text[: text.index(stop)] and cut[-1].finish_reason == "stop"
    assert all(stop not in o.text for o in cut)
    assert tokens(stopped) == tokens(full)[: tokens(full).index(eos) + 1] and stopped[-1].finish_reason == "stop"
    assert engine.free_blocks == 32


def test_requests_that_can_never_run_are_refused(model):
    engine = Engine(model, max_batch=1, n_blocks=8, block_size=4)
    ctx = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"maximum context length is {ctx} tokens.*requested {ctx + 1} tokens"):
        engine.check(Request([1] * (ctx - 9), 10))
    with pytest.raises(ValueError, match="needs 9 KV-cache blocks") as refused:
        engine.check(Request([1] * 30, 6))
    assert refused.value.param == "max_tokens"  # the prompt fits: what it asks to generate does not
    with pytest.raises(ValueError, match="the prompt's 32 tokens and one generated need 9 KV-cache blocks") as refused:
        engine.check(Request([1] * 32, 1))
    assert refused.value.param == "prompt"
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.check(Request([], 6))
    vocab = model.config.vocab_size
    for ids in ([1, vocab], [-1, 2], [1.0, 2], torch.tensor([1, 2])):  # a tensor: its elements are not ints
        with pytest.raises(ValueError, match=rf"prompt token ids must be integers in \[0, {vocab}\)"):
            engine.check(Request(ids, 4))
    with pytest.raises(ValueError, match="seed must be an integer in"):
        engine.add(Request([1, 2], 4, seed=2**64))
    assert not engine.has_work()  # nothing was queued


def test_a_client_callback_that_raises_ends_only_its_own_request(model):
    """The engine keeps serving the others when one request's output callback fails."""
    engine = Engine(model, max_batch=2, n_blocks=16, block_size=4)
    a, b = prompts([3, 4], model.config.vocab_size, seed=11)

    def broken(output):
        raise RuntimeError("the client's event loop is closed")

    engine.add(Request(a, 6, GREEDY, eos_ids=()), broken)
    out_b = collect(engine, Request(b, 6, GREEDY, eos_ids=()))
    engine.run(timeout_s=60)
    assert tokens(out_b) == alone(model, b, 6, temperature=0.0)
    assert engine.free_blocks == 16


def test_graph_buckets_and_the_cuda_graph_switch(model):
    from serve.steps import batch_buckets, prefill_buckets

    assert batch_buckets(1) == [1] and batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert prefill_buckets(40) == [16, 24, 32, 40] and prefill_buckets(8) == [8]
    assert prefill_buckets(2048) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert prefill_buckets(4096)[-6:] == [1536, 2048, 2560, 3072, 3584, 4096]  # every 512 from 2,048 on
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device"):
            Engine(model, cuda_graph=True)


@requires_cuda
@pytest.mark.parametrize("path", ["fused", "reference"])
def test_graphed_engine_equals_eager_engine(model, path, monkeypatch):
    """On the GPU: packs of prompts of up to 32 tokens in all prefilled from their bucket's graph
    (2 + 5 + 9 -> 16, 17 -> 24, 30 -> 32; in fp32 through SDPA under a block-diagonal mask, which
    the graph captures) and a longer one eagerly (45, SDPA per sequence); decode steps replayed
    from the per-bucket CUDA graphs (batches of 6, 5, 4... padded to buckets 8 and 4): every
    token is the one the eager engine chooses."""
    import serve.steps

    monkeypatch.setattr(serve.steps, "PREFILL_GRAPH_TOKENS", 32)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.1)
    lengths, max_tokens = [5, 30, 17, 2, 9, 45], [20, 12, 25, 8, 16, 10]
    requests = [Request(p, m, GREEDY if i % 2 else sampled, seed=i, eos_ids=()) for i, (p, m) in
                enumerate(zip(prompts(lengths, model.config.vocab_size, seed=11), max_tokens))]
    use_path(model, path)
    try:
        results = []
        for graph in (True, False):
            engine = Engine(model, max_batch=8, n_blocks=64, block_size=16, cuda_graph=graph)
            assert engine.prefill.fits(30, 3) == graph and not engine.prefill.fits(45)
            outs = [collect(engine, r) for r in requests]
            engine.run(timeout_s=120)
            results.append([tokens(o) for o in outs])
    finally:
        use_path(model, None)
    assert results[0] == results[1]
