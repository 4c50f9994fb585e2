"""The engine's two kinds of forward, each replayed from CUDA graphs of a few sizes (runtime/graphs.py):
a decode step over the running sequences, one token each (DecodeStep, batch-size buckets), and
prompts' prefills, chunks of them packed back to back (PrefillStep, token-count buckets). Both read and write
static buffers that each call fills, so that a graph replays on the same memory; the padding of
a bucket writes to the cache's scratch slot and the sampler's scratch row.
"""

import itertools
from collections.abc import Callable

import torch

from runtime import metadata
from runtime.cache import PagedKVCache
from runtime.graphs import GraphRunner
from runtime.logprobs import Logprobs, token_logprobs
from runtime.sampler import Sampler
from runtime.staging import staged, to_device

# On CUDA, packs of prompts of up to this many tokens in all, and of up to PACKED_SEQUENCES
# prompts, are prefilled from a CUDA graph: an eager forward costs the same host time of kernel
# launches from Python whatever its length, many times a short pack's GPU time. A longer pack
# keeps the matmuls longer (docs/benchmarks/serve-notes.md: 8,192 against 4,096).
PREFILL_GRAPH_TOKENS = 8192
PACKED_SEQUENCES = 64
# Prefill graphs every FINE_BUCKET_STEP tokens from FINE_BUCKETS_FROM on (prefill_buckets).
FINE_BUCKETS_FROM, FINE_BUCKET_STEP = 2048, 512


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a captured graph: 1, 2, 4, 8, then every 16, up to max_batch."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


class DecodeStep:
    """One token per running sequence: the last token of each of its engine rows [B], at positions
    [B], through block tables [B, M] -> the next tokens [B], chosen by the engine's sampler and
    written back to last_token, all in one step: eager, or (CUDA) replayed from the graph of the
    smallest batch bucket >= B (runtime/graphs.py), its padding rows on the scratch row and slot.
    A graph per way of choosing (Sampler.how): greedy steps and sampling ones, each captured at
    start; a third (the reference sampler beside the fused kernels) the first time it is needed.
    Steps that also return the tokens' log-probabilities (runtime/logprobs.py) are graphs of
    their own, captured the first time a request asks for them: the steps of requests that do
    not ask compute none of it. A step whose rows choose among the tokens their grammars allow
    (runtime/grammar.py) runs in two graphs, the forward to the logits and the choice, and the
    caller's `masks()` between them writes the sampler's masks while the GPU runs the forward:
    the masks need the tokens of the step before, known on the host only once it has run."""

    def __init__(self, model, cache: PagedKVCache, sampler: Sampler, last_token: torch.Tensor, max_batch: int,
                 table_width: int, graph: bool, fused: bool):
        """fused: the model runs the fused kernels, and sampling steps take the fused sampler."""
        self.model, self.cache, self.sampler, self.last_token = model, cache, sampler, last_token
        self.max_batch, self.graph = max_batch, graph
        device = model.lm_head.weight.device
        self.rows = torch.full((max_batch,), sampler.scratch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.valid = torch.zeros(max_batch, dtype=torch.bool, device=device)
        self.block_table = torch.zeros(max_batch, table_width, dtype=torch.long, device=device)
        self.cu_seqlens = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.logits: torch.Tensor | None = None  # [max_batch, V], between a masked step's two graphs
        self.runners: dict[tuple, GraphRunner] = {}
        for how in ("greedy", "fused" if fused else "reference"):
            self.runner(how, False)

    def runner(self, *key) -> GraphRunner:
        """The steps of `key`, captured the first time they are asked for: (how, logprobs) a whole
        step choosing tokens `how`; ("forward",) a masked step's forward; (how, logprobs, "masked")
        its choice. Every row is padding while capturing (the scratch row, valid False, block 0):
        the warm-up and capture runs write to the cache's scratch slot and the sampler's scratch row
        only, also when a runner is captured while sequences run (their rows' buffers are refilled after)."""
        if key not in self.runners:
            self.rows.fill_(self.sampler.scratch)
            self.valid.fill_(False)
            self.positions.zero_()
            self.block_table.zero_()
            if key == ("forward",):
                step = lambda n: self._forward(n, keep=True)  # noqa: E731
            elif len(key) == 3:
                step = lambda n: self._choose(n, self.logits[:n], *key[:2], masked=True)  # noqa: E731
            else:
                step = lambda n: self._choose(n, self._forward(n), *key)  # noqa: E731
            self.runners[key] = GraphRunner(step, batch_buckets(self.max_batch), self.rows.device, self.graph)
        return self.runners[key]

    def _forward(self, n: int, keep: bool = False) -> torch.Tensor:
        """The logits of the rows' next tokens; keep: also in self.logits (a masked step's, for its choice)."""
        meta = metadata.decode(self.positions[:n], self.cache, self.block_table[:n], self.valid[:n],
                               self.cu_seqlens[: n + 1])
        logits = self.model(self.last_token[self.rows[:n]], self.positions[:n], meta)
        if keep:
            self.logits[:n].copy_(logits)
        return logits

    def _choose(self, n: int, logits: torch.Tensor, how: str, logprobs: bool,
                masked: bool = False) -> tuple[torch.Tensor, Logprobs | None]:
        rows = self.rows[:n]
        if masked:  # the distribution chosen from, and its log-probabilities, are the grammar's
            logits = self.sampler.mask(logits, rows)
        tokens = self.sampler(logits, rows, how)
        self.last_token[rows] = tokens
        return tokens, token_logprobs(logits, tokens) if logprobs else None

    def __call__(self, rows: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                 how: str, logprobs: bool = False,
                 masks: Callable[[], None] | None = None) -> tuple[torch.Tensor, Logprobs | None]:
        """The next tokens [B] of the rows, and with `logprobs` their log-probabilities. masks: the
        rows choose among the tokens the sampler's masks allow, which masks() writes once the
        forward is launched."""
        B = rows.shape[0]
        if masks is not None and self.logits is None:
            self.logits = torch.zeros(self.max_batch, self.sampler.vocab_size, dtype=self.model.lm_head.weight.dtype,
                                      device=self.rows.device)
        # Both graphs looked up (captured, the first time) before the buffers are filled: a capture pads them
        runner = self.runner("forward") if masks is not None else self.runner(how, logprobs)
        choice = self.runner(how, logprobs, "masked") if masks is not None else None
        bucket = runner.bucket(B)
        self.rows[:B].copy_(rows)
        self.positions[:B].copy_(positions)
        self.block_table[:B, : block_table.shape[1]].copy_(block_table)  # columns past it: never read
        self.valid[:B] = True
        self.valid[B:bucket] = False  # padding rows: the scratch row, position 0 of block 0, written to scratch
        self.rows[B:bucket] = self.sampler.scratch
        self.positions[B:bucket] = 0
        self.block_table[B:bucket] = 0
        if masks is None:
            tokens, lp = runner(B)
        else:
            runner(B)
            masks()
            tokens, lp = choice(B)
        return tokens[:B], lp[:B] if lp is not None else None


def attention_cost(config) -> float:
    """What one query's attention to one earlier key costs, in tokens' worth of the layers' matrix
    products (arithmetic only, per token: 2 flops per weight; per key: q.k and p.v, 2 x 2 flops
    per head and dimension). Qwen3-0.6B: 1 / 3,840 (a token 32k keys deep costs 8.5 tokens' worth);
    8B: 1 / 23,552 (1.4)."""
    c = config
    H, K, hd, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
    mlp = 3 * D * (c.num_experts_per_tok * c.moe_intermediate_size if c.num_experts else c.intermediate_size)
    per_token = 2 * (D * (H + 2 * K) * hd + H * hd * D + mlp)
    per_key = 4 * H * hd
    return per_key / per_token


def chunk_cost(start: int, n: int, cost: float) -> float:
    """What prefilling n tokens from position start costs, in tokens' worth (see chunk_tokens)."""
    return n + cost * n * (start + (n + 1) / 2)


def chunk_tokens(budget: float, start: int, remaining: int, cost: float) -> int:
    """How many of a prompt's remaining tokens, from position start on, a step's budget (in tokens'
    worth) prefills: n tokens cost n + cost * (the keys each attends to, start + 1 ... start + n),
    so a chunk deep in a long prompt is shorter and a step takes about the same time wherever it
    is. At least one token (a step always makes progress), at most `remaining`."""
    def price(n: int) -> float:
        return chunk_cost(start, n, cost)

    if price(remaining) <= budget:
        return remaining
    b = 1 + cost * (start + 0.5)  # solve cost/2 n^2 + b n = budget
    n = int(budget / b) if cost == 0 else int((-b + (b * b + 2 * cost * budget) ** 0.5) / cost)
    while n > 1 and price(n) > budget:  # float rounding
        n -= 1
    return max(1, min(n, remaining))


def prefill_buckets(max_tokens: int) -> list[int]:
    """Pack sizes with a captured prefill graph: 16, 24, 32, 48, 64, ... (powers of two and 1.5
    times them: a short pack is padded by less than half) up to 2,048, then every 512 tokens up to
    max_tokens: a step's pack is its budget's worth of tokens, a few percent under the largest
    bucket whatever the prompts' lengths, and each padding token costs a real token's matmuls.
    27 sizes up to 8,192, each captured at start for both kinds of pack (PrefillStep)."""
    sizes, n = [], 16
    while n < min(max_tokens, FINE_BUCKETS_FROM):
        sizes += [n, n * 3 // 2]
        n *= 2
    sizes += range(FINE_BUCKETS_FROM, max_tokens, FINE_BUCKET_STEP)
    return [b for b in sizes if b < max_tokens] + [max_tokens]


class PrefillStep:
    """Prompts' forwards, packed: chunks of several sequences' tokens back to back in one forward,
    each chunk continuing its sequence from a start position (0: a prompt's beginning; later: after
    a cached prefix or the sequence's earlier chunks, attending to those keys through the cache)
    -> the logits [N, V] of each chunk's last token. Packing keeps the matmuls long whatever the
    prompts' lengths: a short prompt alone leaves most of the GPU idle (docs/benchmarks/serve-notes.md).
    On CUDA, up to PACKED_SEQUENCES chunks of PREFILL_GRAPH_TOKENS tokens in all are replayed from
    the graph of the smallest token bucket that holds them (the padding written to the scratch slot):
    packs whose chunks all start at 0 from graphs of varlen flash attention, the others (with
    `extend_graph`: the fused kernels) from graphs of the paged chunk kernel. Larger packs, and every
    pack on the CPU, run eagerly (`fits`)."""

    def __init__(self, model, cache: PagedKVCache, table_width: int, graph: bool, extend_graph: bool):
        self.model, self.cache = model, cache
        self.max_len = model.config.max_position_embeddings
        device = model.lm_head.weight.device
        buckets = prefill_buckets(min(PREFILL_GRAPH_TOKENS, self.max_len))
        T, N = buckets[-1], PACKED_SEQUENCES
        self.ids = torch.zeros(T, dtype=torch.long, device=device) if graph else None
        self.positions = torch.zeros(T, dtype=torch.long, device=device) if graph else None
        self.cu_seqlens = torch.zeros(N + 1, dtype=torch.int32, device=device) if graph else None
        self.block_table = torch.zeros(N, table_width, dtype=torch.long, device=device) if graph else None
        # While capturing every sequence is empty and every token padding, written to scratch.
        self.runners = {
            True: GraphRunner(lambda T: self._step(T, True), buckets, device, graph),
            False: GraphRunner(lambda T: self._step(T, False), buckets, device, graph and extend_graph),
        }

    def fits(self, n_tokens: int, n_sequences: int = 1, from_start: bool = True) -> bool:
        """Whether a pack of n_sequences chunks of n_tokens in all is replayed from a graph."""
        return self.runners[from_start].fits(n_tokens) and n_sequences <= PACKED_SEQUENCES

    def _step(self, T: int, from_start: bool) -> torch.Tensor:
        if from_start:
            meta = metadata.prefill(self.positions[:T], self.cu_seqlens, self.cache, self.block_table, T)
        else:
            meta = metadata.extend(self.positions[:T], self.cu_seqlens, self.cache, self.block_table, self.max_len)
        return self.model(self.ids[:T], self.positions[:T], meta)

    def __call__(self, chunks: list[tuple[list[int], int]], block_table: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] of each chunk's last token: chunks of (token ids, the position of the first),
        their keys and values written through their rows of block_table [N, M]."""
        lengths = [len(ids) for ids, _ in chunks]
        bounds = list(itertools.accumulate(lengths, initial=0))
        n, N = bounds[-1], len(chunks)
        ids = list(itertools.chain.from_iterable(ids for ids, _ in chunks))
        positions = [p for chunk, start in chunks for p in range(start, start + len(chunk))]
        from_start = all(start == 0 for _, start in chunks)
        device = block_table.device
        if not self.fits(n, N, from_start):  # eager, its inputs queued behind the step in flight too
            cu_seqlens = to_device(bounds, device, torch.int32)
            token_positions = to_device(positions, device)
            longest = max(start + len(chunk) for chunk, start in chunks)
            make = metadata.prefill if from_start else metadata.extend
            meta = make(token_positions, cu_seqlens, self.cache, block_table, longest)
            return self.model(to_device(ids, device), token_positions, meta)
        # Padding keeps earlier ids and positions (any valid ones do); the bounds past the last
        # sequence's end make empty sequences.
        host = staged([ids, positions], device)
        self.ids[:n].copy_(host[0], non_blocking=True)
        self.positions[:n].copy_(host[1], non_blocking=True)
        bounds += [n] * (PACKED_SEQUENCES - N)
        self.cu_seqlens.copy_(staged(bounds, device, torch.int32), non_blocking=True)
        self.block_table[:N, : block_table.shape[1]].copy_(block_table)  # columns past it: never read
        return self.runners[from_start](n)[:N]
