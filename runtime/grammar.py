"""Constrained decoding: a grammar decides which tokens may come next, and the sampler chooses
among those only, so that the output follows a JSON schema, or Qwen3's tool-call format, by
construction.

    grammars = Grammars(tokenizer, vocab_size, stop_ids)   # once per engine
    matcher = grammars.matcher(spec)                       # per request, compiled in a worker thread
    grammars.accept(matchers, tokens)                      # the tokens chosen: each grammar moves on
    grammars.fill(matchers, words)                         # the tokens each allows next, as bits of words[i]
    logits = allow(logits, words)                          # on the device (a CUDA graph captures it)

A grammar's spec is an xgrammar structural tag (JSON text: a JSON schema, a tool call, a reasoning
block before them; serve/constraints.py builds them). xgrammar rather than llguidance: it ships
Qwen3's formats (structural tags for `<think>` and `<tool_call>`), compiles a schema in
milliseconds, and its per-token mask is a precomputed table walk of tens of microseconds; vLLM
and SGLang use it by default.

A mask is 32 tokens per int32 word, token i at bit i % 32 of word i // 32, 1 = allowed: xgrammar's
layout, unpacked by `allow` with tensor operations that a graph captures.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's mask."""
    return -(-vocab_size // 32)


def allow(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with every token that words [B, mask_words(V)] does not allow at -inf."""
    V = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :V].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def check_spec(spec: str) -> None:
    """ValueError saying what is wrong unless xgrammar can build the grammar of this structural tag
    (a schema it does not support, say); needs no tokenizer, takes about a millisecond."""
    import xgrammar

    try:
        xgrammar.Grammar.from_structural_tag(spec)
    except Exception as err:  # xgrammar raises RuntimeError with its C++ source location first
        message = str(err).strip().splitlines()[0]
        raise ValueError(message.split("] ", 1)[-1].split(": ", 1)[-1] if "] " in message else message) from None


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, compiled: Future):
        self.compiled = compiled
        self.state = None  # xgrammar's GrammarMatcher, once compiled
        self.rejected = False  # a token it did not allow was offered (and not taken)

    def ready(self, wait_s: float = 0.0) -> bool:
        """Compiled (or failed to: `start` raises its error), waiting up to wait_s for it. Waiting
        releases the GIL to the compiling thread, which a busy caller would otherwise hold it from
        for Python's switch interval (5 ms) each time: a grammar found in the cache is ready in
        microseconds once that thread runs."""
        if not self.compiled.done() and wait_s > 0:
            wait([self.compiled], timeout=wait_s)
        return self.compiled.done()

    def start(self) -> None:
        import xgrammar

        if self.state is None:
            self.state = xgrammar.GrammarMatcher(self.compiled.result())

    @property
    def terminated(self) -> bool:
        """The grammar is complete and has taken a stop token: nothing may follow."""
        return self.state.is_terminated()


class Grammars:
    """Compiles specs for one tokenizer (xgrammar caches each spec's compiled grammar), one at a
    time in a worker thread (each by xgrammar's threads), so that a step never waits for a
    compilation; moves and reads many matchers at once, on the caller's thread.

    One thread writes a step's masks by default: at a step's tens of rows, handing them to
    xgrammar's threads costs more than it saves (scripts/bench_grammar.py compares on any host;
    docs/benchmarks/serve-notes.md has the figures); and accepting a token holds the GIL, so
    threads would only contend there."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], fill_threads: int = 1):
        """The tokenizer's vocabulary is read (a second for Qwen3's 151k tokens) in the worker
        thread, before the first compilation, not by the caller. fill_threads: xgrammar's, for
        a step's masks."""
        import xgrammar

        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qwen3-grammar")
        self.compiler = self.worker.submit(lambda: xgrammar.GrammarCompiler(
            xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids),
            max_threads=min(8, os.cpu_count() or 1)))
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=fill_threads)

    def matcher(self, spec: str) -> Matcher:
        return Matcher(self.worker.submit(lambda: self.compiler.result().compile_structural_tag(spec)))

    def accept(self, matchers: list[Matcher], tokens: list[int]) -> None:
        """Each matcher moves on by its token; one that does not allow it stays, `rejected`."""
        for matcher, token in zip(matchers, tokens):
            matcher.rejected |= not matcher.state.accept_token(token)

    def fill(self, matchers: list[Matcher], words: torch.Tensor) -> None:
        """words[i] (a host int32 tensor's row): the tokens matchers[i] allows next; every token
        for one that has terminated (the token it gets is dropped: its sequence has ended)."""
        live = [i for i, m in enumerate(matchers) if not m.terminated]
        if len(live) < len(matchers):
            words.fill_(-1)
        if live:
            self.batch.batch_fill_next_token_bitmask([matchers[i].state for i in live], words, indices=live)


def structural_tag(fmt: dict) -> str:
    """A structural tag's JSON text around one format (a dict of xgrammar's format shapes)."""
    return json.dumps({"type": "structural_tag", "format": fmt})
