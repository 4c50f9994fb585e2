"""The serving engine's scheduling (serve/engine.py launches what it chooses): the waiting queue
and the running batch, each running sequence's blocks and row of the block table, and the prompt
tokens each step prefills.

Each step prefills up to prefill_tokens prompt tokens (chunked prefill): the next chunks of
prompts admitted earlier, then waiting requests, oldest first, admitted while the batch has room
and the cache has blocks for them, each starting after the longest prefix of it that the cache
holds. A token's attention to the tokens before it counts too (attention_cost), so that a chunk
deep in a long prompt is shorter and every step's prefill takes about the same time. The chunks
are packed into as few forwards as the prefill graphs hold. A request whose grammar compiles (in
a worker thread) keeps its place at the head of the queue while the requests behind it are
admitted; it is admitted once that is done.

Prefix caching: every full block of a sequence (its prompt's, and its generated tokens') is
registered under the hash chain of its tokens once they are written, and stays cached when the
sequence ends, until a new block is needed and no free one is left (least recently freed first).
A prompt's prefill starts after its longest cached prefix (always leaving its last token to
compute); the blocks found are shared by reference count and never written: the sequence's new
tokens go to blocks of its own.

A sequence gets a block when its next token starts one. When none is free, the request that
arrived last is preempted (first come, first served): its blocks are freed and it waits at the
head of the queue, to be prefilled again from its prompt and the tokens it had (vLLM's recompute
preemption). A request
is accepted only if it fits the whole cache alone, so the oldest sequence always progresses:
running out of blocks makes requests wait, never corrupts or drops them.

The engine reads a step's tokens one step after its launch. So a sequence is admitted with a
block for its next token too, and a preempted one is not prefilled again while a token of its is
in flight: a sequence's tokens are read in order, once. Freed blocks can be handed out at once:
every step runs on one CUDA stream, so a block's next owner writes it after the in-flight step
that may still write it.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.blocks import block_keys
from runtime.cache import PagedKVCache

from . import steps
from .sequence import Sequence

# Prompt tokens prefilled per engine step by default (a longer prompt alone): the prompts of a
# burst get their first tokens a step's worth at a time instead of all at the end of one long
# prefill. More per step takes a burst into the batch in fewer steps (fewer decode steps run
# part-filled) and keeps the running sequences waiting longer in each (docs/benchmarks/serve-notes.md).
PREFILL_TOKENS = 8192
# On a CPU: a step's work must stay well inside the server's --engine-timeout (60 s), past which
# the engine is taken for hung, and a CPU prefills a real model's tokens thousands of times slower.
PREFILL_TOKENS_CPU = 512
# What a step waits at most for the grammar of the request at the head of the queue: a grammar in
# xgrammar's cache is ready within it (runtime/grammar.py Matcher.ready); a new one takes a few
# steps of this (milliseconds to compile), while the running sequences go on.
GRAMMAR_WAIT_S = 0.0005

Chunk = tuple[Sequence, int]  # a sequence, and how many of its tokens after the cached ones to prefill


@dataclass
class Prefills:
    """A step's prefill work: packs of chunks, each pack one forward, and the sequences admitted
    for it (new rows: the engine sets their sampling state before the packs run)."""

    packs: list[list[Chunk]]
    admitted: list[Sequence]


class Scheduler:
    """Which sequences wait and which run, their blocks and block-table rows, and each step's
    prefill chunks (see the module docstring). Called from the thread that steps the engine.

    table_width: blocks a sequence can own (the block table's columns).
    prefill_tokens, attention_cost: each step's prefill budget in prompt tokens, and what a key
        attended to costs beside a token (serve/steps.py chunk_tokens).
    prefix_cache: register full blocks, and start prompts after their cached prefixes.
    """

    def __init__(self, cache: PagedKVCache, max_batch: int, table_width: int, *, prefill_tokens: int,
                 attention_cost: float, prefix_cache: bool):
        self.cache, self.max_batch = cache, max_batch
        self.prefill_tokens, self.attention_cost, self.prefix_cache = prefill_tokens, attention_cost, prefix_cache
        # Each running sequence owns a row of this host-side table, written a block at a time as the
        # sequence grows: a decode step gathers its rows' first columns, never rebuilds the table.
        self.block_rows = torch.zeros(max_batch, table_width, dtype=torch.long)
        self._free_rows = list(range(max_batch - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: preemption takes from the end
        self.preemptions = 0
        self.prompt_tokens = 0  # prompt tokens of every admission (a preempted sequence's each time)
        self.hit_tokens = 0  # of those, the ones found in the cache (prefix caching)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def prefix_stats(self) -> dict:
        """What the prefix cache holds and how often it was hit (for /health): blocks empty (never
        registered, or evicted), cached (registered, no owner) and used (owned), which add up to the
        cache; /health's free_blocks are the empty and the cached ones, as `allocate` can take both."""
        free, cached, in_use = self.cache.pool.counts()
        rate = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {"enabled": self.prefix_cache, "empty_blocks": free, "cached_blocks": cached, "used_blocks": in_use,
                "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens, "hit_rate": round(rate, 4)}

    def prefills(self, grammar_ready: Callable[[Sequence, float], bool],
                 one_forward: Callable[[int, int, bool], bool]) -> Prefills:
        """This step's prefills, up to prefill_tokens prompt tokens: first the next chunks of
        sequences admitted earlier, oldest first, then waiting sequences, oldest first, admitted
        while the batch has room and the cache has blocks for them (keeping one per running
        sequence for its next token), each starting after the longest prefix of it that the cache
        holds. A sequence whose next uncached block is one that a sequence prefilled in this step
        computes waits a step, and then finds it cached: a burst of prompts with one system prompt
        (n choices of one prompt) prefills it once; the sequences behind it are not held back.
        grammar_ready(seq, wait_s): whether a constrained sequence's grammar is compiled, waiting
            up to wait_s (one that failed has ended its sequence, and left the queue);
        one_forward(n_tokens, n_sequences, from_start): whether a pack that large is one forward."""
        budget = float(self.prefill_tokens)
        chunks: list[Chunk] = []
        admitted: list[Sequence] = []
        computing: set[bytes] = set()  # the key of the first uncached block of each sequence prefilled now

        def take(seq: Sequence) -> None:
            nonlocal budget
            n = steps.chunk_tokens(budget, seq.cached, len(seq.ids) - seq.cached, self.attention_cost)
            budget -= steps.chunk_cost(seq.cached, n, self.attention_cost)
            chunks.append((seq, n))
            if (key := self._next_key(seq)) is not None:
                computing.add(key)

        for seq in self.running:
            if budget > 0 and seq.prefilling:
                take(seq)
        # Requests at the head of the queue passed over this step, the ones behind going first: their
        # grammars compile, or their next block is one this step computes.
        passed = 0
        while budget > 0 and len(self.waiting) > passed and len(self.running) < self.max_batch:
            seq = self.waiting[passed]
            if seq.matcher is not None and not grammar_ready(seq, GRAMMAR_WAIT_S if not passed else 0):
                passed += seq.finish_reason is None  # else it failed, and has left the queue
                continue
            if seq.unread:  # preempted with a token in flight: prefilled again once its ids hold it
                break
            if self.prefix_cache and self._next_key(seq, lookup=True) in computing:
                passed += 1
                continue
            if not self._admit(seq, passed):
                break
            admitted.append(seq)
            take(seq)
        return Prefills(self._pack(chunks, one_forward), admitted)

    @staticmethod
    def _pack(chunks: list[Chunk], one_forward: Callable[[int, int, bool], bool]) -> list[list[Chunk]]:
        """The chunks packed into as few forwards as one_forward allows, shortest first."""
        from_start = all(seq.cached == 0 for seq, _ in chunks)
        packs: list[list[Chunk]] = []
        pack_tokens = 0  # in the last pack
        for chunk in sorted(chunks, key=lambda c: c[1]):
            if packs and one_forward(pack_tokens + chunk[1], len(packs[-1]) + 1, from_start):
                packs[-1].append(chunk)
                pack_tokens += chunk[1]
            else:
                packs.append([chunk])
                pack_tokens = chunk[1]
        return packs

    def _admit(self, seq: Sequence, place: int = 0) -> bool:
        """Give the sequence at `place` in the queue (the head, but for requests passed over: their
        grammars compile, or their next block is one this step computes) a row, and blocks for its
        tokens and the next one's position (so that it is not preempted before its prefill's token
        has been read): the cached blocks of its prefix, shared, and new ones for the rest. False
        if they do not fit."""
        bs = self.cache.block_size
        hits = []
        if self.prefix_cache:  # at least its last token is computed: its logits give the next token
            hits = self.cache.pool.lookup(self._keys(seq, (len(seq.ids) - 1) // bs))
        need = self.cache.blocks_for(len(seq.ids) + 1) - len(hits)
        if self.cache.pool.num_free - self.cache.pool.cached_among(hits) - need < len(self.running):
            return False
        del self.waiting[place]
        self.cache.pool.share(hits)
        seq.blocks = hits + self.cache.pool.allocate(need)
        seq.registered = len(hits)
        seq.cached = len(hits) * bs
        self.prompt_tokens += len(seq.ids)
        self.hit_tokens += seq.cached
        seq.row = self._free_rows.pop()
        self.block_rows[seq.row, : len(seq.blocks)] = torch.tensor(seq.blocks)
        self.running.append(seq)
        return True

    def grow(self) -> None:
        """Give every running sequence that will be launched a block for the position its next
        token is written to, preempting the requests that arrived last when none is free (first
        come, first served: a request passed over in the queue, admitted after one behind it, is
        still the older)."""
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            done = seq.n_launched >= seq.request.max_tokens  # its last token is in flight
            if done or seq.cached // self.cache.block_size < len(seq.blocks):
                i += 1
                continue
            block = self.cache.pool.allocate(1)
            if block is not None:
                self.block_rows[seq.row, len(seq.blocks)] = block[0]
                seq.blocks += block
                i += 1
                continue
            j = max(range(len(self.running)), key=lambda k: self.running[k].id)  # the latest: maybe seq itself
            victim = self.running.pop(j)
            i -= j < i  # the sequences after it moved up one
            self._free(victim)
            victim.cached = 0
            self.waiting.appendleft(victim)
            self.preemptions += 1

    def release(self, seq: Sequence) -> None:
        """Take an ended sequence out of the batch or the queue, freeing its row and its blocks at
        once (its registered ones stay cached)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        self.cache.pool.release(seq.blocks)
        seq.blocks, seq.registered = [], 0
        if seq.row >= 0:
            self._free_rows.append(seq.row)
            seq.row = -1

    def block_table(self, seqs: list[Sequence]) -> torch.Tensor:
        """The block-table rows [B, M] of these running sequences, on the host, M the most blocks
        one of them holds: a step's kernels read no further."""
        return self.block_rows[torch.tensor([s.row for s in seqs]), : max(len(s.blocks) for s in seqs)]

    def register_blocks(self, seq: Sequence) -> None:
        """Register the sequence's blocks whose tokens are all known and written (launched: a later
        step that reads them runs after the one that writes them, on the same stream)."""
        if not self.prefix_cache:
            return
        full = min(seq.cached, len(seq.ids)) // self.cache.block_size
        if full > seq.registered:
            for block, key in zip(seq.blocks[seq.registered : full], self._keys(seq, full)[seq.registered :]):
                self.cache.pool.register(block, key)
            seq.registered = full

    def _next_key(self, seq: Sequence, lookup: bool = False) -> bytes | None:
        """The key of the sequence's first full prompt block that is not cached (its own registered
        ones, or with `lookup` the cache's), None if there is none or prefix caching is off."""
        if not self.prefix_cache:
            return None
        keys = self._keys(seq, (len(seq.ids) - 1) // self.cache.block_size)
        known = len(self.cache.pool.lookup(keys)) if lookup else seq.registered
        return keys[known] if known < len(keys) else None

    def _keys(self, seq: Sequence, n: int) -> list[bytes]:
        """The keys of the sequence's first n full blocks (computed once: its ids only grow)."""
        if n > len(seq.keys):
            before = seq.keys[-1] if seq.keys else b""
            seq.keys += block_keys(seq.ids, self.cache.block_size, n, len(seq.keys), before)
        return seq.keys[:n]
