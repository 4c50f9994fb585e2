"""Continuous batching over a paged KV cache: the serving engine behind serve/server.py.

Requests join and leave the running batch between decode steps. Each engine step:
1. applies the cancellations asked since the last step (from any thread): a cancelled
   sequence's blocks return to the cache at once;
2. launches the prefills that the scheduler chooses (serve/scheduler.py: admission with prefix
   caching, chunked prefill, growth and preemption), packed into as few forwards as the prefill
   graphs hold; the chunk that ends a prompt samples its first token on the device;
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
advance and never overshoots. Admission and preemption keep a sequence's tokens in order.

Constrained decoding (a request's `grammar`: runtime/grammar.py): its sequence's mask of allowed
tokens is written before each of its steps' choice, and the step chooses among them. The mask
needs the token before, known on the host only once the step before has run: so a decode step
with constrained rows launches its forward first, then waits for the previous step's tokens,
hands the constrained sequences' to their grammars and writes their masks
while the GPU runs that forward, then launches the choice (as SGLang overlaps grammars). A
constrained sequence whose prefill has just launched joins the decode steps one step later.

On CUDA both forwards replay CUDA graphs of batch-size and token-count buckets (serve/steps.py);
the CPU runs them eagerly: the CPU tests exercise the eager paths, the graphed ones need a GPU.

The engine owns the model; whoever calls `step` drives it (the server's engine process,
serve/engine_process.py; tests, by hand) and adds requests (`add`, on that thread); `cancel` is
safe to call from any thread (it queues for the next step), and outputs reach each request
through its `on_output` callback, called during `step`.
"""

import itertools
import queue
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from math import inf

import torch

from ops import resolve_kernels
from runtime.cache import PagedKVCache
from runtime.generate import resolve_eos
from runtime.grammar import Grammars
from runtime.graphs import resolve_cuda_graph
from runtime.logprobs import Logprobs, TokenLogprobs, keep, token_logprobs
from runtime.sampler import Sampler, random_seed
from runtime.sampling import plain
from runtime.staging import to_device
from runtime.text import TextStream

from . import steps
from .request import Limits, Output, Request, check_request
from .scheduler import PREFILL_TOKENS, PREFILL_TOKENS_CPU, Chunk, Scheduler
from .sequence import Sequence
from .steps import DecodeStep, PrefillStep

__all__ = ["PREFILL_TOKENS", "PREFILL_TOKENS_CPU", "Engine", "Limits", "Output", "Request", "check_request"]

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
    max_batch: sequences decoded together at most (more wait in the queue; the server bounds the
        queue: serve/engine_process.py).
    cuda_graph: replay decode steps and short prompts' prefills from CUDA graphs (default: on CUDA).
    prefill_tokens, attention_cost, prefix_cache: the scheduler's (serve/scheduler.py): the prompt
        tokens prefilled per step (chunked prefill; default PREFILL_TOKENS on a GPU, PREFILL_TOKENS_CPU
        on the CPU), what a key that a token attends to costs beside
        the token (default from the model's shape; 0: tokens alone), whether prompts skip the
        prefill of their prefixes that the cache holds.
    """

    def __init__(self, model, tokenizer=None, *, n_blocks: int | None = None, block_size: int = 16,
                 max_batch: int = 16, cuda_graph: bool | None = None,
                 prefill_tokens: int | None = None, prefix_cache: bool = True,
                 attention_cost: float | None = None):
        self.model, self.tokenizer = model, tokenizer
        config = model.config
        self.device = model.lm_head.weight.device
        if prefill_tokens is None:
            prefill_tokens = PREFILL_TOKENS if self.device.type == "cuda" else PREFILL_TOKENS_CPU
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        if attention_cost is not None:
            cost = plain(attention_cost)  # numpy's numbers as Python's
            if isinstance(cost, bool) or not isinstance(cost, int | float) or not 0 <= cost < inf:
                raise ValueError(f"attention_cost must be a finite number >= 0, got {attention_cost!r}")
        self.max_len = config.max_position_embeddings
        table_width = -(-self.max_len // block_size)  # blocks a sequence can own
        if n_blocks is None:
            n_blocks = max_batch * -(-min(self.max_len, 2048) // block_size)
        self.cache = PagedKVCache.for_model(model, n_blocks, block_size)
        self.max_batch = max_batch
        self.attention_cost = steps.attention_cost(config) if attention_cost is None else float(attention_cost)
        self.scheduler = Scheduler(self.cache, max_batch, table_width, prefill_tokens=prefill_tokens,
                                   attention_cost=self.attention_cost, prefix_cache=prefix_cache)
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
        self.decode = DecodeStep(model, self.cache, self.sampler, self.last_token, max_batch, table_width,
                                 cuda_graph, self.fused)
        self.prefill = PrefillStep(model, self.cache, table_width, cuda_graph, extend_graph=self.fused)
        self.grammars: Grammars | None = None  # made with the first constrained request

        self.sequences: dict[int, Sequence] = {}  # every unfinished sequence, by id
        self._ids = itertools.count()
        self._cancels: queue.SimpleQueue = queue.SimpleQueue()  # ids of sequences to stop at the next step
        self.peak_running = 0  # the largest batch decoded so far
        # Prefills and decode steps launched whose tokens are not read yet, in launch order (a
        # sequence's prefill before its first decode step).
        self.in_flight: list[LaunchedStep] = []

    @property  # the scheduler's state (serve/scheduler.py), as callers read it
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self) -> deque[Sequence]:
        return self.scheduler.waiting

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    # ---- any thread -------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return self.cache.pool.num_free

    @property
    def limits(self) -> "Limits":
        c = self.model.config
        return Limits(c.vocab_size, self.max_len, self.cache.n_blocks, self.cache.block_size)

    def prefix_stats(self) -> dict:
        """What the prefix cache holds and how often it was hit (for /health)."""
        return self.scheduler.prefix_stats()

    def check(self, request: Request) -> None:
        """ValueError naming the numbers unless the request can ever run."""
        check_request(request, self.limits)
        if request.grammar is not None and self.tokenizer is None:
            raise ValueError("a grammar needs the engine's tokenizer (Engine(model, tokenizer))")

    def cancel(self, seq_id: int) -> None:
        """Stop a request (a client went away): its blocks are freed at the engine's next step."""
        self._cancels.put(seq_id)

    # ---- the thread that steps ----------------------------------------------------------------

    def add(self, request: Request, on_output: Callable[[Output], None] | None = None) -> Sequence:
        """Queue a request from the thread that steps the engine."""
        self.check(request)
        seq = Sequence(
            id=next(self._ids), request=request, ids=list(request.prompt_ids), on_output=on_output,
            eos=set(request.eos_ids) if request.eos_ids is not None else self.eos,
            seed=request.seed if request.seed is not None else random_seed(),
            stream=TextStream(self.tokenizer) if self.tokenizer is not None else None,
        )
        if request.grammar is not None:
            if self.grammars is None:
                self.grammars = Grammars(self.tokenizer, self.model.config.vocab_size, sorted(self.eos))
            seq.matcher = self.grammars.matcher(request.grammar)
        self.sequences[seq.id] = seq
        self.scheduler.add(seq)
        return seq

    def abort_all(self) -> None:
        """End every sequence with finish_reason "error" (after a failed step), freeing its blocks."""
        self.in_flight = []
        for seq in list(self.sequences.values()):
            self._finish(seq, "error")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight or not self._cancels.empty())

    @torch.inference_mode()
    def step(self) -> None:
        self._drain_cancels()
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

    def _drain_cancels(self) -> None:
        while True:
            try:
                seq_id = self._cancels.get_nowait()
            except queue.Empty:
                return
            if seq_id in self.sequences:  # not finished yet
                self._finish(self.sequences[seq_id], "cancelled")

    def _launch_prefills(self) -> None:
        """Launch the prefills that the scheduler chooses for this step (Scheduler.prefills), a
        forward a pack, once the sequences it admitted have their sampling rows."""
        prefills = self.scheduler.prefills(self._grammar_ready, self._one_forward)
        for seq in prefills.admitted:
            # Its stream continues where it was (a preempted sequence's too): its step is its tokens so far.
            self.sampler.set_row(seq.row, seq.request.params, seq.seed, seq.ids, step=seq.n_generated)
        for pack in prefills.packs:
            self._prefill(pack)

    def _one_forward(self, n_tokens: int, n_sequences: int, from_start: bool) -> bool:
        """Whether a pack of n_sequences chunks of n_tokens in all is prefilled in one forward: an
        eager prefill takes any pack (on the CPU, every one), a graphed one those its graphs hold."""
        return not self.prefill.runners[from_start].capture or self.prefill.fits(n_tokens, n_sequences, from_start)

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

    def _prefill(self, pack: list[Chunk]) -> None:
        """The next n tokens of each sequence (a preempted one's generated tokens too), after those
        in the cache, packed into one forward; the logits of the last token of each sequence whose
        tokens are then all in the cache give its next token."""
        seqs = [seq for seq, _ in pack]
        table = to_device(self.scheduler.block_table(seqs), self.device)
        logits = self.prefill([(seq.ids[seq.cached : seq.cached + n], seq.cached) for seq, n in pack], table)
        done = []
        for i, (seq, n) in enumerate(pack):
            seq.cached += n
            self.scheduler.register_blocks(seq)
            if not seq.prefilling:
                done.append(i)
        if not done:
            return
        finished = [seqs[i] for i in done]
        rows = to_device([s.row for s in finished], self.device)
        if len(done) < len(pack):
            logits = logits[to_device(done, self.device)]
        if self._allow(finished):  # the grammars' tokens only: for the choice and the log-probabilities
            logits = self.sampler.mask(logits, rows)
        tokens = self.sampler(logits, rows, self._how(finished))
        self.last_token[rows] = tokens
        self._send_back(finished, tokens, token_logprobs(logits, tokens) if self._logprobs(finished) else None)

    def _launch_decode(self, previous: list[LaunchedStep]) -> None:
        """Launch a decode step over the running sequences that have tokens left to make (a
        sequence whose last token is still in flight counts it), if there are any. A constrained
        sequence whose last token is one this step's prefills make waits a step (its mask needs
        it); the others' masks are written once the forward is launched, from the tokens of the
        previous steps."""
        self.scheduler.grow()
        prefilled = {s for launched in self.in_flight for s in launched.seqs}  # in this step
        seqs = [s for s in self.running if not s.prefilling and s.n_launched < s.request.max_tokens
                and not (s.matcher is not None and (s in prefilled or s.matcher.terminated))]
        if not seqs:
            return
        self.peak_running = max(self.peak_running, len(seqs))
        rows = to_device([s.row for s in seqs], self.device)
        positions = to_device([s.cached for s in seqs], self.device)
        masks = None
        if any(s.matcher is not None for s in seqs):
            def masks() -> None:
                self._match(previous)
                self._allow(seqs)
        tokens, logprobs = self.decode(rows, positions, to_device(self.scheduler.block_table(seqs), self.device),
                                       self._how(seqs), self._logprobs(seqs), masks)
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
                            pin_memory=self.device.type == "cuda")  # the grammars write it, then it is copied
        self.grammars.fill([s.matcher for s in constrained], words)
        self.sampler.allow_rows(to_device([s.row for s in constrained], self.device), words)
        return True

    @staticmethod
    def _logprobs(seqs: list[Sequence]) -> bool:
        """Whether a step over these sequences returns its tokens' log-probabilities: one asks."""
        return any(s.request.logprobs is not None for s in seqs)

    def _accept(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> None:
        """Append a sampled token, apply the stops, hand out the new text."""
        seq.ids.append(token)
        self.scheduler.register_blocks(seq)
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
        the batch or the queue, send the rest of its text."""
        self.scheduler.release(seq)
        self.sequences.pop(seq.id, None)
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
