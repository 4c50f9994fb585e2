"""Continuous batching over a paged KV cache: the serving engine behind serve/server.py.

Requests join and leave the running batch between decode steps. Each engine step:
1. applies what other threads asked (new requests, cancellations): a cancelled sequence's
   blocks return to the cache at once;
2. prefills up to prefill_tokens prompt tokens (chunked prefill): the next chunks of prompts
   admitted earlier, then waiting requests, oldest first, admitted while the batch has room and
   the cache has blocks for them, each starting after the longest prefix of it that the cache
   holds (prefix caching: runtime/blocks.py); the chunks are packed into one forward (on CUDA
   from the CUDA graph of its token-count bucket), and the chunk that ends a prompt samples its
   first token on the device;
3. launches one decode step over the running sequences that have tokens left to make, the ones
   just prefilled included (one token per row, rows of different lengths, keys read through
   each row's block table), each row sampled on the device with its own parameters, its token
   fed to the next step on the device;
4. while those run, reads the tokens of the previous step's prefills and decode step back,
   applies their stops, hands new text to their consumers and frees the blocks of the rows
   that finished.

Tokens are read one step after their launch, so that the host's work on them (per token: stops,
detokenizing, an output) overlaps the GPU's next prefills and decode step instead of leaving the
GPU idle: nothing in a step waits for the GPU except the reading of the step before. A sequence
that a stop token ends has one more decode step launched whose token is dropped (two when the
prefill gave the stop token) and keeps its blocks until that is known; max_tokens is known in
advance and never overshoots. A sequence is admitted with a block for its next token too, and a
preempted one is not prefilled again while a token of its is in flight, so a sequence's tokens
are read in order, once. Freed blocks can be handed out at once: every step runs on one CUDA
stream, so a block's next owner writes it after the in-flight step that may still write it.

Constrained decoding (a request's `grammar`: runtime/grammar.py): its sequence's mask of allowed
tokens is written before each of its steps' choice, and the step chooses among them. The mask
needs the token before, known on the host only once the step before has run: so a decode step
with constrained rows launches its forward first, then waits for the previous step's tokens,
hands the constrained sequences' to their grammars and writes their masks (xgrammar's threads)
while the GPU runs that forward, then launches the choice (as SGLang overlaps grammars). A
constrained sequence whose prefill has just launched joins the decode steps one step later. Its
grammar compiles in a worker thread while it waits (the requests behind it are admitted
meanwhile); it is admitted once that is done.

Prefix caching: every full block of a sequence (its prompt's, and its generated tokens') is
registered under the hash chain of its tokens once they are written, and stays cached when the
sequence ends, until a new block is needed and no free one is left (least recently freed first).
A prompt's prefill starts after its longest cached prefix (always leaving its last token to
compute); the blocks found are shared by reference count and never written: the sequence's new
tokens go to blocks of its own.

A sequence gets a block when its next token starts one. When none is free, the sequence
admitted last is preempted: its blocks are freed and it waits at the head of the queue, to be
prefilled again from its prompt and the tokens it had (vLLM's recompute preemption). A request
is accepted only if it fits the whole cache alone, so the oldest sequence always progresses:
running out of blocks makes requests wait, never corrupts or drops them.

On CUDA the decode step is replayed from a CUDA graph per batch-size bucket (the batch padded to
the bucket's size, padding rows writing to the scratch slot), a greedy and a sampling graph
captured at start, largest first, in one memory pool, as nano-vllm does (a graph of the reference
sampler the first time a request needs it: a top-k of 128 or more with top-p, on the fused path).
A step's chunks are packed back to back into one forward (each attending to its own sequence's
keys), replayed from the graph of its token-count bucket the same way, up to PREFILL_GRAPH_TOKENS
tokens. The CPU runs both eagerly; the CPU tests exercise the eager paths,
the graphed ones run on a GPU only.

The engine owns the model; whoever calls `step` drives it (the server's engine process,
serve/engine_process.py; tests, by hand). `submit` and `cancel` are safe to call from any
thread (they queue for the next step), and outputs reach each request through its `on_output`
callback, called during `step`.
"""

import itertools
import queue
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ops import resolve_kernels
from runtime.blocks import block_keys
from runtime.cache import PagedKVCache
from runtime.generate import resolve_eos
from runtime.grammar import Grammars
from runtime.graphs import resolve_cuda_graph
from runtime.logprobs import Logprobs, TokenLogprobs, keep, token_logprobs
from runtime.sampler import Sampler, random_seed
from runtime.text import TextStream

from . import steps
from .request import Limits, Output, QueueFull, Request, check_request
from .sequence import Sequence
from .steps import DecodeStep, PrefillStep

__all__ = ["PREFILL_TOKENS", "Engine", "Limits", "Output", "QueueFull", "Request", "check_request"]

# Prompt tokens prefilled per engine step by default (a longer prompt alone): the prompts of a
# burst get their first tokens a step's worth at a time instead of all at the end of one long
# prefill. More per step takes a burst into the batch in fewer steps (fewer decode steps run
# part-filled) and keeps the running sequences waiting longer in each (docs/benchmarks/serve-notes.md).
PREFILL_TOKENS = 8192
# What a step waits at most for the grammar of the request at the head of the queue: a grammar in
# xgrammar's cache is ready within it (runtime/grammar.py Matcher.ready); a new one takes a few
# steps of this (milliseconds to compile), while the running sequences go on.
GRAMMAR_WAIT_S = 0.0005


@dataclass
class LaunchedStep:
    """A decode step or a prefill on the GPU: its rows, and its tokens on their way to the host."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [B] on the host once `ready` has completed
    logprobs: Logprobs | None  # theirs, when a sequence asked (on the host with the tokens)
    ready: torch.cuda.Event | None  # None: the tokens are already there (CPU)
    matched: bool = False  # its constrained sequences' grammars have taken its tokens


class Engine:
    """Continuous batching over a PagedKVCache (see the module docstring).

    n_blocks: KV-cache blocks of block_size tokens (default: every batch row can hold 2048
        tokens, or the context if shorter).
    max_batch: sequences decoded together at most.
    max_waiting: requests that may wait beyond a full batch: `submit` raises QueueFull when
        max_batch + max_waiting requests are already in (running or waiting).
    cuda_graph: replay decode steps and short prompts' prefills from CUDA graphs (default: on CUDA).
    prefill_tokens: the prefill work per step, in prompt tokens, packed into one forward (on CUDA,
        into as few as the prefill graphs hold); a longer prompt is prefilled in chunks, one a step
        beside the running sequences' decode steps (chunked prefill). A token's attention to the
        tokens before it counts too (attention_cost per key, default from the model's shape:
        serve/steps.py chunk_tokens), so that a chunk deep in a long prompt is shorter and every
        step's prefill takes about the same time; 0: tokens alone.
    prefix_cache: keep the full blocks of every sequence, found again by their tokens: a prompt
        that starts as an earlier one did skips the prefill of that prefix (runtime/blocks.py).
    """

    def __init__(self, model, tokenizer=None, *, n_blocks: int | None = None, block_size: int = 16,
                 max_batch: int = 16, max_waiting: int = 256, cuda_graph: bool | None = None,
                 prefill_tokens: int = PREFILL_TOKENS, prefix_cache: bool = True,
                 attention_cost: float | None = None):
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        self.model, self.tokenizer = model, tokenizer
        self.prefill_tokens = prefill_tokens
        self.attention_cost = steps.attention_cost(model.config) if attention_cost is None else attention_cost
        config = model.config
        self.device = model.lm_head.weight.device
        self.max_len = config.max_position_embeddings
        self.table_width = -(-self.max_len // block_size)  # blocks a sequence can own
        if n_blocks is None:
            n_blocks = max_batch * -(-min(self.max_len, 2048) // block_size)
        self.cache = PagedKVCache.for_model(model, n_blocks, block_size)
        # Each running sequence owns a row of this host-side table, written a block at a time as the
        # sequence grows: a decode step gathers its rows' first columns, never rebuilds the table.
        self.block_rows = torch.zeros(max_batch, self.table_width, dtype=torch.long)
        self._free_rows = list(range(max_batch - 1, -1, -1))
        self.max_batch, self.max_waiting = max_batch, max_waiting
        gen_config = getattr(model, "generation_config", {}) or {}
        eos = set(resolve_eos(None, gen_config, config))
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos = eos
        cuda_graph = resolve_cuda_graph(cuda_graph, self.device)
        self.fused = resolve_kernels(config.kernels, self.device) == "fused"
        # Each running row's sampling state (its parameters, seed, step, tokens seen), and its last
        # token: a decode step's input ids are gathered from it and its sampling writes it, on the
        # device, without a trip through the host. Their last row is scratch, for padding rows.
        self.sampler = Sampler(max_batch, config.vocab_size, self.device)
        self.last_token = torch.zeros(max_batch + 1, dtype=torch.long, device=self.device)
        self.decode = DecodeStep(model, self.cache, self.sampler, self.last_token, max_batch, self.table_width,
                                 cuda_graph, self.fused)
        self.prefill = PrefillStep(model, self.cache, self.table_width, cuda_graph, extend_graph=self.fused)
        self.prefix_cache = prefix_cache
        self.grammars: Grammars | None = None  # made with the first constrained request
        self.prompt_tokens = 0  # prompt tokens of every admission (a preempted sequence's each time)
        self.hit_tokens = 0  # of those, the ones found in the cache (prefix caching)

        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: preemption takes from the end
        self.sequences: dict[int, Sequence] = {}  # every unfinished sequence, by id
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", Sequence) | ("cancel", id)
        self._lock = threading.Lock()
        self._in_flight = 0  # submitted and not finished: the queue bound counts these
        self.preemptions = 0
        self.peak_running = 0  # the largest batch decoded so far
        # Prefills and decode steps launched whose tokens are not read yet, in launch order (a
        # sequence's prefill before its first decode step).
        self.in_flight: list[LaunchedStep] = []

    # ---- any thread -------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return self.cache.num_free

    @property
    def limits(self) -> "Limits":
        c = self.model.config
        return Limits(c.vocab_size, self.max_len, self.cache.n_blocks, self.cache.block_size)

    def prefix_stats(self) -> dict:
        """What the prefix cache holds and how often it was hit (for /health)."""
        free, cached, in_use = self.cache.pool.counts()
        rate = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {"enabled": self.prefix_cache, "free_blocks": free, "cached_blocks": cached, "used_blocks": in_use,
                "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens, "hit_rate": round(rate, 4)}

    def check(self, request: Request) -> None:
        """ValueError naming the numbers unless the request can ever run."""
        check_request(request, self.limits)
        if request.grammar is not None and self.tokenizer is None:
            raise ValueError("a grammar needs the engine's tokenizer (Engine(model, tokenizer))")

    def submit(self, request: Request, on_output: Callable[[Output], None] | None = None) -> int:
        """Queue a request; returns its id. ValueError if it can never run, QueueFull past the bound."""
        self.check(request)
        with self._lock:
            if self._in_flight >= self.max_batch + self.max_waiting:
                raise QueueFull(f"{self.max_batch} requests are running and {self.max_waiting} already waiting; "
                                "try again later")
            self._in_flight += 1
        try:
            seq = self._new_sequence(request, on_output)
        except BaseException:
            with self._lock:
                self._in_flight -= 1
            raise
        self._inbox.put(("add", seq))
        return seq.id

    def cancel(self, seq_id: int) -> None:
        """Stop a request (a client went away): its blocks are freed at the engine's next step."""
        self._inbox.put(("cancel", seq_id))

    # ---- the thread that steps ----------------------------------------------------------------

    def add(self, request: Request, on_output: Callable[[Output], None] | None = None) -> Sequence:
        """Queue a request from the thread that steps the engine."""
        self.check(request)
        with self._lock:
            self._in_flight += 1
        seq = self._new_sequence(request, on_output)
        self._enqueue(seq)
        return seq

    def abort_all(self) -> None:
        """End every sequence with finish_reason "error" (after a failed step), freeing its blocks."""
        self.in_flight = []
        for seq in list(self.sequences.values()):
            self._finish(seq, "error")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight or not self._inbox.empty())

    @torch.inference_mode()
    def step(self) -> None:
        self._drain_inbox()
        previous, self.in_flight = self.in_flight, []
        self._launch_prefills()
        self._launch_decode(previous)
        self._match(previous)  # the constrained sequences' tokens the decode step did not need
        for launched in previous:  # read while the prefills and the decode step just launched run
            self._accept_step(launched)

    def run(self, timeout_s: float = 600.0) -> None:
        """Step until every request has finished (tests)."""
        deadline = time.monotonic() + timeout_s
        while self.has_work():
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests still running after {timeout_s} s")
            self.step()

    def _new_sequence(self, request: Request, on_output) -> Sequence:
        """A sequence of host-side state only: any thread may make one (in submit); its device
        state is made on the thread that steps the engine, in _enqueue."""
        return Sequence(
            id=next(self._ids), request=request, ids=list(request.prompt_ids), on_output=on_output,
            eos=set(request.eos_ids) if request.eos_ids is not None else self.eos,
            seed=request.seed if request.seed is not None else random_seed(),
            stream=TextStream(self.tokenizer) if self.tokenizer is not None else None,
        )

    def _enqueue(self, seq: Sequence) -> None:
        if seq.request.grammar is not None:
            if self.grammars is None:
                self.grammars = Grammars(self.tokenizer, self.model.config.vocab_size, sorted(self.eos))
            seq.matcher = self.grammars.matcher(seq.request.grammar)
        self.sequences[seq.id] = seq
        self.waiting.append(seq)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._enqueue(item)
            elif item in self.sequences:  # a cancel of a sequence not yet finished
                self._finish(self.sequences[item], "cancelled")

    def _launch_prefills(self) -> None:
        """Prefill up to prefill_tokens prompt tokens: first the next chunks of sequences admitted
        earlier, oldest first, then waiting sequences, oldest first, admitted while the batch has
        room and the cache has blocks for them (keeping one per running sequence for its next
        token), each starting after the longest prefix of it that the cache holds. A sequence whose
        next uncached block is one that a sequence prefilled in this step computes waits a step,
        and then finds it cached: a burst of prompts with one system prompt (n choices of one
        prompt) prefills it once."""
        budget = float(self.prefill_tokens)
        chunks: list[tuple[Sequence, int]] = []
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
        compiling = 0  # requests at the head of the queue whose grammars compile: the ones behind go first
        while budget > 0 and len(self.waiting) > compiling and len(self.running) < self.max_batch:
            seq = self.waiting[compiling]
            if seq.matcher is not None and not self._grammar_ready(seq, GRAMMAR_WAIT_S if not compiling else 0):
                compiling += seq.finish_reason is None  # else it failed, and has left the queue
                continue
            if seq.unread:  # preempted with a token in flight: prefilled again once its ids hold it
                break
            if self.prefix_cache and self._next_key(seq, lookup=True) in computing:
                break
            if not self._admit(seq, compiling):
                break
            take(seq)
        # Packed into as few forwards as the graphs allow (on the CPU, one), shortest first.
        from_start = all(seq.cached == 0 for seq, _ in chunks)
        packs: list[list[tuple[Sequence, int]]] = []
        pack_tokens = 0  # in the last pack
        for chunk in sorted(chunks, key=lambda c: c[1]):
            joins = packs and (not self.prefill.runners[from_start].capture
                               or self.prefill.fits(pack_tokens + chunk[1], len(packs[-1]) + 1, from_start))
            if joins:
                packs[-1].append(chunk)
                pack_tokens += chunk[1]
            else:
                packs.append([chunk])
                pack_tokens = chunk[1]
        for pack in packs:
            self._prefill(pack)

    def _match(self, launched_steps: list[LaunchedStep]) -> None:
        """Hand the tokens of the launched steps to the grammars of their constrained sequences
        (waiting for those steps), so that their next masks can be written; once per step."""
        for launched in launched_steps:
            if launched.matched:
                continue
            launched.matched = True
            constrained = [i for i, s in enumerate(launched.seqs) if s.matcher is not None and not s.matcher.terminated]
            if not constrained:
                continue
            if launched.ready is not None:
                launched.ready.synchronize()
            tokens = launched.tokens.tolist()
            self.grammars.accept([launched.seqs[i].matcher for i in constrained], [tokens[i] for i in constrained])

    def _grammar_ready(self, seq: Sequence, wait_s: float) -> bool:
        """Whether the sequence's grammar is compiled (waiting up to wait_s); one that failed to
        compile ends it ("error")."""
        if not seq.matcher.ready(wait_s):
            return False
        try:
            seq.matcher.start()
        except Exception as err:  # the server checks every grammar first: a bug, or a limit of xgrammar's
            print(f"request {seq.id}: its grammar did not compile: {err}", file=sys.stderr)
            self._finish(seq, "error")
            return False
        return True

    def _admit(self, seq: Sequence, place: int = 0) -> bool:
        """Give the sequence at `place` in the queue (the head, but for requests whose grammars
        compile) a row, and blocks for its tokens and the next one's position (so that it is not
        preempted before its prefill's token has been read): the cached blocks of its prefix,
        shared, and new ones for the rest. False if they do not fit."""
        bs = self.cache.block_size
        hits = []
        if self.prefix_cache:  # at least its last token is computed: its logits give the next token
            hits = self.cache.pool.lookup(self._keys(seq, (len(seq.ids) - 1) // bs))
        need = self.cache.blocks_for(len(seq.ids) + 1) - len(hits)
        if self.cache.num_free - self.cache.pool.cached_among(hits) - need < len(self.running):
            return False
        del self.waiting[place]
        self.cache.pool.share(hits)
        seq.blocks = hits + self.cache.allocate(need)
        seq.registered = len(hits)
        seq.cached = len(hits) * bs
        self.prompt_tokens += len(seq.ids)
        self.hit_tokens += seq.cached
        seq.row = self._free_rows.pop()
        self.block_rows[seq.row, : len(seq.blocks)] = torch.tensor(seq.blocks)
        # Its stream continues where it was (a preempted sequence's too): its step is its tokens so far.
        self.sampler.set_row(seq.row, seq.request.params, seq.seed, seq.ids, step=seq.n_generated)
        self.running.append(seq)
        return True

    def _prefill(self, pack: list[tuple[Sequence, int]]) -> None:
        """The next n tokens of each sequence (a preempted one's generated tokens too), after those
        in the cache, packed into one forward; the logits of the last token of each sequence whose
        tokens are then all in the cache give its next token."""
        seqs = [seq for seq, _ in pack]
        width = max(len(s.blocks) for s in seqs)
        table = self._on_device(self.block_rows[torch.tensor([s.row for s in seqs]), :width])
        logits = self.prefill([(seq.ids[seq.cached : seq.cached + n], seq.cached) for seq, n in pack], table)
        done = []
        for i, (seq, n) in enumerate(pack):
            seq.cached += n
            self._register_blocks(seq)
            if not seq.prefilling:
                done.append(i)
        if not done:
            return
        finished = [seqs[i] for i in done]
        rows = self._on_device([s.row for s in finished])
        if len(done) < len(pack):
            logits = logits[self._on_device(done)]
        if self._allow(finished):  # the grammars' tokens only: for the choice and the log-probabilities
            logits = self.sampler.mask(logits, rows)
        tokens = self.sampler(logits, rows, self._how(finished))
        self.last_token[rows] = tokens
        self._send_back(finished, tokens, token_logprobs(logits, tokens) if self._logprobs(finished) else None)

    def _register_blocks(self, seq: Sequence) -> None:
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

    def _grow(self) -> None:
        """Give every running sequence that will be launched a block for the position its next
        token is written to, preempting the sequences admitted last when none is free."""
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            done = seq.n_launched >= seq.request.max_tokens  # its last token is in flight
            if done or seq.cached // self.cache.block_size < len(seq.blocks):
                i += 1
                continue
            block = self.cache.allocate(1)
            if block is not None:
                self.block_rows[seq.row, len(seq.blocks)] = block[0]
                seq.blocks += block
                i += 1
                continue
            victim = self.running.pop()  # the latest admitted: maybe seq itself
            self.cache.release(victim.blocks)
            self._free_rows.append(victim.row)
            victim.blocks, victim.cached, victim.row, victim.registered = [], 0, -1, 0
            self.waiting.appendleft(victim)
            self.preemptions += 1

    def _launch_decode(self, previous: list[LaunchedStep]) -> None:
        """Launch a decode step over the running sequences that have tokens left to make (a
        sequence whose last token is still in flight counts it), if there are any. A constrained
        sequence whose last token is one this step's prefills make waits a step (its mask needs
        it); the others' masks are written once the forward is launched, from the tokens of the
        previous steps."""
        self._grow()
        prefilled = {s for launched in self.in_flight for s in launched.seqs}  # in this step
        seqs = [s for s in self.running if not s.prefilling and s.n_launched < s.request.max_tokens
                and not (s.matcher is not None and (s in prefilled or s.matcher.terminated))]
        if not seqs:
            return
        self.peak_running = max(self.peak_running, len(seqs))
        rows = torch.tensor([s.row for s in seqs])
        positions = self._on_device([s.cached for s in seqs])
        width = max(len(s.blocks) for s in seqs)  # blocks in use: the kernel reads no further
        masks = None
        if any(s.matcher is not None for s in seqs):
            def masks() -> None:
                self._match(previous)
                self._allow(seqs)
        tokens, logprobs = self.decode(self._on_device(rows), positions,
                                       self._on_device(self.block_rows[rows, :width]), self._how(seqs),
                                       self._logprobs(seqs), masks)
        for s in seqs:
            s.cached += 1
        self._send_back(seqs, tokens, logprobs)

    def _send_back(self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: Logprobs | None) -> None:
        """Queue the copy of the tokens [B] sampled for seqs (and their log-probabilities) to the
        host; the next step reads them."""
        for s in seqs:
            s.unread += 1
        ready = None  # the CPU's tokens are there already
        if tokens.device.type == "cuda":
            tokens = tokens.to("cpu", non_blocking=True)
            logprobs = logprobs.to_host() if logprobs is not None else None
            ready = torch.cuda.Event()
            ready.record()
        self.in_flight.append(LaunchedStep(seqs, tokens, logprobs, ready))

    def _accept_step(self, step: LaunchedStep) -> None:
        """Hand out the tokens of a launched prefill or decode step, once they have reached the
        host; a sequence that ended meanwhile (a stop token before, a cancel) drops its token."""
        if step.ready is not None:
            step.ready.synchronize()
        logprobs = itertools.repeat(None)
        if step.logprobs is not None:  # the top ones the step's sequences asked for at most, as lists
            logprobs = step.logprobs.tolist(max(s.request.logprobs or 0 for s in step.seqs))
        for s, token, lp in zip(step.seqs, step.tokens.tolist(), logprobs):
            s.unread -= 1
            if s.finish_reason is None:
                k = s.request.logprobs
                self._accept(s, token, keep(lp, k) if k is not None else None)

    def _on_device(self, data: torch.Tensor | list) -> torch.Tensor:
        """Host data on the engine's device without waiting for the GPU: a copy from pageable
        memory waits for the stream (it would hold the host until the step in flight is done);
        one staged in pinned memory is queued behind it (torch keeps the staging buffer until
        the copy has run)."""
        if self.device.type != "cuda":
            return torch.as_tensor(data, device=self.device)
        return torch.as_tensor(data).pin_memory().to(self.device, non_blocking=True)

    def _how(self, seqs: list[Sequence]) -> str:
        """How the sampler chooses these sequences' tokens (Sampler.how: greedy, fused, reference)."""
        return Sampler.how([s.request.params for s in seqs], self.fused)

    def _allow(self, seqs: list[Sequence]) -> bool:
        """Write the masks of the constrained sequences among seqs (each its grammar's next tokens)
        to their sampler rows; whether there are any (the step is then a masked one)."""
        constrained = [s for s in seqs if s.matcher is not None]
        if not constrained:
            return False
        words = torch.empty(len(constrained), self.sampler.allowed.shape[1], dtype=torch.int32,
                            pin_memory=self.device.type == "cuda")
        self.grammars.fill([s.matcher for s in constrained], words)
        self.sampler.allow_rows(self._on_device([s.row for s in constrained]), words)
        return True

    @staticmethod
    def _logprobs(seqs: list[Sequence]) -> bool:
        """Whether a step over these sequences returns its tokens' log-probabilities: one asks."""
        return any(s.request.logprobs is not None for s in seqs)

    def _accept(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> None:
        """Append a sampled token, apply the stops, hand out the new text."""
        seq.ids.append(token)
        self._register_blocks(seq)
        reason = seq.read(token)
        if seq.matcher is not None:  # its grammar has taken the token (_match, before this)
            if seq.matcher.rejected:  # masked out: a bug, never the request's fault
                print(f"request {seq.id}: token {token} is not one its grammar allows", file=sys.stderr)
                reason = "error"
            elif reason is None and seq.matcher.terminated:  # complete, and a stop token taken (ignore_eos)
                reason = "stop"
        lp = [logprobs] if logprobs is not None else None
        if reason is not None:
            self._finish(seq, reason, token, lp)
        else:
            self._emit(seq, seq.unsent(), [token], None, lp)

    def _finish(self, seq: Sequence, reason: str, token: int | None = None,
                logprobs: list[TokenLogprobs] | None = None) -> None:
        """End a sequence: free its blocks at once (its registered ones stay cached), take it out of
        the batch, send the rest of its text."""
        self.cache.release(seq.blocks)
        seq.blocks, seq.registered = [], 0
        if seq in self.running:
            self.running.remove(seq)
            self._free_rows.append(seq.row)
            seq.row = -1
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.sequences.pop(seq.id, None)
        with self._lock:
            self._in_flight -= 1
        seq.finish_reason = reason
        self._emit(seq, seq.text[seq.sent :], [token] if token is not None else [], reason, logprobs)
        seq.sent = len(seq.text)

    def _emit(self, seq: Sequence, text: str, tokens: list[int], reason: str | None,
              logprobs: list[TokenLogprobs] | None = None) -> None:
        if seq.on_output is None:
            return
        if logprobs is None and seq.request.logprobs is not None:
            logprobs = []  # an output without a token (a cancel) has none: still a list, as asked
        try:
            seq.on_output(Output(text, tokens, reason, seq.n_prompt, seq.n_generated, logprobs))
        except Exception:  # one client's callback (a closed event loop, say) must not stop the engine
            traceback.print_exc()
