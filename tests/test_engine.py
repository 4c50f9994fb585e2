"""The paged KV cache, paged decode attention and the continuous-batching engine, on the CPU.

References: the contiguous KVCache / decode kernel (a paged read must see exactly what a
contiguous one sees), the no-cache forward, and `model.generate` of each request alone (what
a request must produce whatever runs beside it)."""

from pathlib import Path

import pytest
import torch
from checkpoints import hf_model, save
from conftest import DEVICE, requires_cuda, use_path
from tolerances import LOGITS_BF16_REL, LOGITS_FP32_ATOL, LOGITS_FP32_RTOL, relative_error

from ops.attention.decode_attention import decode_attention, keys_per_step, shared_memory_per_program
from qwen3 import Qwen3ForCausalLM
from runtime.cache import PagedKVCache
from runtime.sampling import SamplingParams
from runtime.text import load_tokenizer
from serve.engine import Engine, QueueFull, Request

GREEDY = SamplingParams(temperature=0.0)
SHIPPED = Path(__file__).resolve().parent.parent / "weights" / "qwen3-stdlib-tiny"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these are many tiny forwards, which OpenMP threads only slow down when
    the machine's cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save(hf_model(seed=5, num_hidden_layers=2), tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def model(checkpoint):
    return Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, device=DEVICE, progress=False)


def prompts(lengths, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


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


# ---- the paged cache ---------------------------------------------------------------------------


def test_blocks_are_allocated_released_and_reused():
    cache = PagedKVCache(1, n_blocks=5, block_size=4, n_kv_heads=1, head_dim=8, dtype=torch.float32, device=DEVICE)
    assert cache.num_free == 5 and cache.blocks_for(9) == 3 and cache.blocks_for(8) == 2
    a = cache.allocate(3)
    b = cache.allocate(2)
    assert sorted(a + b) == [0, 1, 2, 3, 4] and cache.num_free == 0
    assert cache.allocate(1) is None and cache.num_free == 0  # out of blocks: nothing taken
    cache.release(a)
    assert cache.num_free == 3
    assert sorted(cache.allocate(3)) == sorted(a)  # the freed blocks are handed out again
    cache.release(b)
    with pytest.raises(RuntimeError, match="released twice"):
        cache.release(b)


def test_slots_follow_the_block_table():
    cache = PagedKVCache(1, n_blocks=6, block_size=4, n_kv_heads=1, head_dim=8, dtype=torch.float32, device=DEVICE)
    table = torch.tensor([[5, 2, 0], [1, 3, 4]], device=DEVICE)
    positions = torch.tensor([[0, 3, 4, 9], [2, 5, 11, 0]], device=DEVICE)
    valid = torch.tensor([[True] * 4, [True, True, True, False]], device=DEVICE)
    assert cache.slots(positions, valid, table).tolist() == [20, 23, 8, 1, 6, 13, 19, cache.scratch]


def paged_copy(k_rows, v_rows, block_size, seed=0):
    """The rows [B, S, K, hd] stored in shuffled blocks of a PagedKVCache, and their block table."""
    B, S, K, hd = k_rows.shape
    per_row = S // block_size
    cache = PagedKVCache(1, B * per_row + 3, block_size, K, hd, k_rows.dtype, k_rows.device)
    order = torch.randperm(cache.n_blocks, generator=torch.Generator().manual_seed(seed))[: B * per_row]
    table = order.view(B, per_row).to(k_rows.device)
    positions = torch.arange(S, device=k_rows.device).expand(B, S)
    slots = cache.slots(positions, None, table)
    cache.write(0, slots, k_rows, v_rows)
    return cache, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, S, splits", [(3, 96, 4), (4, 1024, 1)], ids=["many-slices", "one-slice-long-rows"])
def test_paged_decode_attention_equals_contiguous(dtype, B, S, splits):
    """The Triton kernel (interpreted on the CPU) reading keys through a block table gives the
    bits it gives reading the same keys from contiguous rows, with many slices per row (64 keys
    a loop trip) and with one slice of rows that can be long (128 in 16 bits); so does the torch
    path (gather)."""
    H, K, hd, block = 4, 2, 32, 16
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, hd, generator=gen).to(DEVICE, dtype)
    k_rows = torch.randn(B, S, K, hd, generator=gen).to(DEVICE, dtype)
    v_rows = torch.randn(B, S, K, hd, generator=gen).to(DEVICE, dtype)
    seq_lens = torch.tensor([1, 50, 96] if B == 3 else [1, 200, 777, 1024], device=DEVICE)
    long_steps = S == 1024 and dtype == torch.bfloat16
    steps = keys_per_step(splits, S, dtype, hd, shared_memory_per_program(DEVICE))
    assert steps == (128 if long_steps else 64)
    cache, table = paged_copy(k_rows, v_rows, block)
    k_blocks, v_blocks = cache.blocks(0)
    contiguous = decode_attention(q, k_rows, v_rows, seq_lens, hd**-0.5, splits=splits)
    paged = decode_attention(q, k_blocks, v_blocks, seq_lens, hd**-0.5, block_table=table, splits=splits)
    assert torch.equal(paged, contiguous)
    k_gathered, v_gathered = cache.gather(0, table)
    assert torch.equal(k_gathered, k_rows) and torch.equal(v_gathered, v_rows)
    with pytest.raises(ValueError, match="block_table must be"):
        decode_attention(q, k_blocks, v_blocks, seq_lens, 1.0, block_table=table[:2])


@pytest.mark.parametrize("path", ["reference", "fused"])
def test_paged_forward_equals_the_full_forward(model, path):
    """Two rows prefilled one at a time into scattered blocks, then decoded together one token
    per step at their own positions: every step's logits equal the no-cache forward's, on the
    torch path (gather + SDPA) and the fused one (the paged Triton kernel)."""
    use_path(model, path)
    rows = prompts([7, 3], model.config.vocab_size, seed=2)
    more = prompts([6, 6], model.config.vocab_size, seed=3)
    cache = PagedKVCache.for_model(model, n_blocks=12, block_size=4)
    tables = [[9, 2, 11, 0, 5], [4, 7, 1, 10, 3]]
    try:
        with torch.no_grad():
            for row, table in zip(rows, tables):
                n = len(row)
                model(torch.tensor([row], device=DEVICE), torch.arange(n, device=DEVICE)[None], cache=cache,
                      block_table=torch.tensor([table], device=DEVICE))
            table = torch.tensor(tables, device=DEVICE)
            steps = []
            for t in range(6):
                ids = torch.tensor([[more[0][t]], [more[1][t]]], device=DEVICE)
                positions = torch.tensor([[len(rows[0]) + t], [len(rows[1]) + t]], device=DEVICE)
                steps.append(model(ids, positions, cache=cache, block_table=table)[:, 0])
            for i in range(2):
                full = model(torch.tensor([rows[i] + more[i]], device=DEVICE))[0, len(rows[i]) :]
                torch.testing.assert_close(torch.stack([s[i] for s in steps]), full, rtol=LOGITS_FP32_RTOL,
                                           atol=LOGITS_FP32_ATOL)
            with pytest.raises(ValueError, match="needs a block_table"):
                model(ids, positions, cache=cache)
    finally:
        use_path(model, None)


@pytest.mark.parametrize("path", ["reference", "fused"])
def test_packed_prompts_equal_each_prompt_alone_in_transformers(model, path):
    """Three prompts packed into one forward (cu_seqlens, padding and an empty sequence at the
    end) into scattered blocks: each one's last-token logits equal transformers' for the prompt
    alone, and so do the logits of a next token decoded through the cache the packed forward
    wrote (fp32: SDPA per sequence; torch path and the fused kernels of the triton one)."""
    reference = hf_model(seed=5, num_hidden_layers=2).to(DEVICE)  # the `model` fixture's checkpoint
    rows = prompts([5, 1, 8], model.config.vocab_size, seed=9)
    nexts = [row[0] for row in prompts([1, 1, 1], model.config.vocab_size, seed=10)]
    cache = PagedKVCache.for_model(model, n_blocks=12, block_size=4)
    table = torch.tensor([[3, 8, 0], [11, 5, 6], [1, 9, 4], [7, 2, 10]], device=DEVICE)
    ids = sum(rows, []) + [0, 0]  # two padding tokens
    positions = [p for row in rows for p in range(len(row))] + [0, 0]
    cu_seqlens = torch.tensor([0, 5, 6, 14, 14], dtype=torch.int32, device=DEVICE)
    use_path(model, path)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=DEVICE), torch.tensor([positions], device=DEVICE), cache=cache,
                           last_only=True, block_table=table, cu_seqlens=cu_seqlens)
            step = model(torch.tensor([[t] for t in nexts], device=DEVICE),
                         torch.tensor([[len(row)] for row in rows], device=DEVICE), cache=cache, block_table=table[:3])
            for i, row in enumerate(rows):
                want = reference(torch.tensor([row + [nexts[i]]], device=DEVICE)).logits[0]
                torch.testing.assert_close(logits[i, 0], want[-2], rtol=LOGITS_FP32_RTOL, atol=LOGITS_FP32_ATOL)
                torch.testing.assert_close(step[i, 0], want[-1], rtol=LOGITS_FP32_RTOL, atol=LOGITS_FP32_ATOL)
            assert logits.shape[0] == 4  # a row of logits per sequence, the empty one's included
            with pytest.raises(ValueError, match="packed sequences take"):
                model(torch.tensor([ids, ids], device=DEVICE), cache=cache, block_table=table, cu_seqlens=cu_seqlens,
                      positions=torch.zeros(2, 16, dtype=torch.long, device=DEVICE))
            with pytest.raises(ValueError, match="packed sequences take"):  # positions restart: no default
                model(torch.tensor([ids], device=DEVICE), cu_seqlens=cu_seqlens)
    finally:
        use_path(model, None)


@requires_cuda
def test_packed_prefill_graph_in_bf16_matches_transformers(checkpoint):
    """On the GPU in bf16 a pack of prompts runs varlen flash attention, replayed from the graph of
    its token bucket (the pack's unused sequences empty; a second, smaller pack after a larger
    one, so that its padding holds the first one's ids and positions): each prompt's last-token
    logits, and those of a next token decoded through the cache the pack wrote, match
    transformers' bf16 forward of the prompt alone."""
    model = Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device=DEVICE, progress=False)
    reference = hf_model(seed=5, num_hidden_layers=2, dtype=torch.bfloat16).to(DEVICE)
    engine = Engine(model, max_batch=4, n_blocks=32, block_size=16)
    for seed, lengths in ((12, [40, 1, 23]), (14, [5, 13])):
        rows = prompts(lengths, model.config.vocab_size, seed=seed)
        nexts = [row[0] for row in prompts([1] * len(rows), model.config.vocab_size, seed=seed + 1)]
        table = torch.tensor([[3 * i, 3 * i + 1, 3 * i + 2] for i in range(len(rows))], device=DEVICE)
        assert engine.prefill.fits(sum(lengths), len(rows))
        with torch.inference_mode():
            logits = engine.prefill(rows, table).clone()
            step = model(torch.tensor([[t] for t in nexts], device=DEVICE),
                         torch.tensor([[len(row)] for row in rows], device=DEVICE), cache=engine.cache,
                         block_table=table)
            for i, row in enumerate(rows):
                want = reference(torch.tensor([row + [nexts[i]]], device=DEVICE)).logits[0]
                assert relative_error(logits[i], want[-2]) < LOGITS_BF16_REL
                assert relative_error(step[i, 0], want[-1]) < LOGITS_BF16_REL


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


@pytest.mark.parametrize("prefill_tokens, steps", [(1, [[7], [2], [11], [4], [9], [3]]), (24, [[24], [12]]),
                                                   (10_000, [[36]])], ids=["one-each", "two-steps", "all-together"])
def test_prompts_prefilled_together_generate_what_they_would_alone(model, prefill_tokens, steps):
    """Six prompts of different lengths, arriving together: each step admits prompts in arrival
    order up to prefill_tokens tokens (7, 2, 11 and 4 fill 24; then 9 and 3) and prefills them
    packed into one forward (of 24 tokens, then 12), or one prompt per step, or all in one
    forward: each row's tokens equal model.generate's for its prompt alone, the one whose
    max_tokens is 1 ending in its prefill beside the others."""
    lengths = [7, 2, 11, 4, 9, 3]
    requests = [Request(p, 1 if i == 1 else 4, GREEDY, eos_ids=())
                for i, p in enumerate(prompts(lengths, model.config.vocab_size, seed=7))]
    expected = [alone(model, r.prompt_ids, r.max_tokens, temperature=0.0) for r in requests]
    # Eager prefills (a GPU would replay each pack from a graph: test_graphed_engine_equals_eager_engine)
    engine = Engine(model, max_batch=6, n_blocks=64, block_size=4, prefill_tokens=prefill_tokens, cuda_graph=False)
    outputs = [collect(engine, r) for r in requests]
    prefills = []  # tokens of each forward of more than one token: the packed prefills
    hook = model.register_forward_pre_hook(
        lambda module, args: prefills.append(args[0].shape[1]) if args[0].shape[1] > 1 else None)
    per_step = []
    try:
        while engine.waiting or not per_step:
            engine.step()
            per_step.append(prefills[:])
            prefills.clear()
    finally:
        hook.remove()
    assert per_step == steps
    engine.run()
    assert [tokens(out) for out in outputs] == expected and outputs[1][-1].finish_reason == "length"
    with pytest.raises(ValueError, match="prefill_tokens"):
        Engine(model, prefill_tokens=0)


def test_out_of_blocks_new_requests_wait_and_nothing_is_corrupted(model):
    """A cache that holds about two sequences: the third waits in the queue until blocks free
    up; sequences that outgrow the cache preempt the latest admitted, which is recomputed.
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


def test_per_request_seeds_and_parameters_do_not_depend_on_the_batch(model):
    """A seeded sampled request gives the same tokens alone and beside other requests (its own
    generator); a greedy one beside it is unaffected by its parameters."""
    sampled = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
                             presence_penalty=0.3)
    p, q = prompts([5, 8], model.config.vocab_size, seed=8)

    def run(requests):
        engine = Engine(model, max_batch=4, n_blocks=32, block_size=4)
        outs = [collect(engine, r) for r in requests]
        engine.run(timeout_s=60)
        return [tokens(o) for o in outs]

    seeded = Request(p, 15, sampled, seed=1234, eos_ids=())
    (by_itself,) = run([seeded])
    together = run([Request(q, 15, GREEDY, eos_ids=()), seeded, Request(p, 15, sampled, seed=99, eos_ids=())])
    assert together[1] == by_itself and together[2] != by_itself
    assert together[0] == alone(model, q, 15, temperature=0.0)
    assert by_itself == alone(model, p, 15, seed=1234, **{k: getattr(sampled, k) for k in (
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


def test_requests_that_can_never_run_are_refused_and_the_queue_is_bounded(model):
    engine = Engine(model, max_batch=1, n_blocks=8, block_size=4, max_waiting=1)
    ctx = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"maximum context length is {ctx} tokens.*requested {ctx + 1} tokens"):
        engine.check(Request([1] * (ctx - 9), 10))
    with pytest.raises(ValueError, match="needs 9 KV-cache blocks"):
        engine.check(Request([1] * 30, 6))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.check(Request([], 6))
    with pytest.raises(ValueError, match="seed must be an integer in"):  # refused before it takes a queue place
        engine.submit(Request([1, 2], 4, seed=2**64))
    engine.submit(Request([1, 2], 4))  # one runs
    engine.submit(Request([1, 2], 4))  # one waits
    with pytest.raises(QueueFull, match="1 requests are running and 1 already waiting"):
        engine.submit(Request([1, 2], 4))
    engine.run(timeout_s=30)
    assert engine.free_blocks == 8


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
    from serve.engine import batch_buckets, prefill_buckets

    assert batch_buckets(1) == [1] and batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert prefill_buckets(40) == [16, 24, 32, 40] and prefill_buckets(8) == [8]
    assert prefill_buckets(2048) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
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
    import serve.engine

    monkeypatch.setattr(serve.engine, "PREFILL_GRAPH_TOKENS", 32)
    requests = [Request(p, m, GREEDY, eos_ids=()) for p, m in
                zip(prompts([5, 30, 17, 2, 9, 45], model.config.vocab_size, seed=11), [20, 12, 25, 8, 16, 10])]
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
