"""A choice's tokens' log-probabilities written as OpenAI's JSON, an output's worth at a time.

    names = TokenNames(TokenPieces(tokenizer))        # one per server: each token's JSON, made once
    writer = LogprobsWriter(names, chat)              # one per choice
    logprobs = writer(token_ids, logprobs)            # chat: RawJSON, spliced into a chunk as it is

Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]};
completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}. Every
generated token has its entry, a stop token too (as token_ids list it).

Chat's entries are written as text, not as dicts for json.dumps: a stream asking for
log-probabilities sends a chunk per token with up to 21 entries in it, on the event loop that
writes every stream, and a token's name, bytes and the entry's fixed keys are the same each time:
they are rendered once per token id (`TokenNames`), and a chunk only joins them with the numbers
(half the time of the dicts'). A completion's are a dict of small dicts, which json's C encoder
writes as fast as that.
"""

import json

from runtime.logprobs import TokenLogprobs
from runtime.text import TokenPieces


class RawJSON(str):
    """JSON text, to be written into a response as it is."""


def number(value: float) -> str:
    """A float as json.dumps writes it (repr; NaN and the infinities spelt as JavaScript's)."""
    return float.__repr__(value) if value - value == 0 else json.dumps(value)


class TokenNames:
    """Each token's name as JSON, made once per token id: (its text as a JSON string, the text's
    length, the head of its chat entry up to the log-prob, the entry's bytes field)."""

    def __init__(self, pieces: TokenPieces):
        self.pieces = pieces
        self.known: dict[int, tuple[str, int, str, str]] = {}

    def __call__(self, token_id: int) -> tuple[str, int, str, str]:
        known = self.known.get(token_id)
        if known is None:
            text, raw = self.pieces(token_id)
            name = json.dumps(text)
            known = self.known[token_id] = (name, len(text), f'{{"token": {name}, "logprob": ',
                                            f', "bytes": {json.dumps(raw)}')
        return known


class LogprobsWriter:
    """One choice's log-probabilities (see the module docstring); a completion's text offsets
    carry on from output to output."""

    def __init__(self, names: TokenNames, chat: bool):
        self.names, self.chat = names, chat
        self.offset = 0  # a completion's: where the next token's text starts

    def __call__(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None) -> RawJSON | dict | None:
        if logprobs is None:
            return None
        return self.chat_json(token_ids, logprobs) if self.chat else self.completion_json(token_ids, logprobs)

    def chat_json(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> RawJSON:
        names, entries = self.names, []
        for token, (logprob, ids, values) in zip(token_ids, logprobs):
            _, _, head, raw = names(token)
            top = ", ".join([f"{entry[2]}{number(v)}{entry[3]}}}" for entry, v in zip(map(names, ids), values)])
            entries.append(f'{head}{number(logprob)}{raw}, "top_logprobs": [{top}]}}')
        return RawJSON(f'{{"content": [{", ".join(entries)}]}}')

    def completion_json(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict:
        """A dict: its entries are {text: value}, which json's C encoder writes as fast as joined by
        hand (one key per text, the later value, where two tokens share a text)."""
        pieces = self.names.pieces
        texts, offsets = [pieces(t)[0] for t in token_ids], []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": texts, "token_logprobs": [lp for lp, _, _ in logprobs],
                "top_logprobs": [{pieces(i)[0]: v for i, v in zip(ids, values)} for _, ids, values in logprobs],
                "text_offset": offsets}
