"""Text in and out: the checkpoint's tokenizer, the chat prompt, and streaming detokenization."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, from its tokenizer.json (Qwen3 checkpoints ship one)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}: the checkpoint's tokenizer must come "
                                "in Hugging Face tokenizers' format, as Qwen3 checkpoints ship it")
    from transformers import AutoTokenizer  # on first use: importing transformers takes most of a second

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as err:  # transformers raises many kinds of errors, most of them not naming the file
        raise ValueError(broken_tokenizer_file(path) or f"transformers cannot load the tokenizer in {path}: "
                                                        f"{err}") from None
    # The model checks a prompt against its context when it runs, naming the numbers; the
    # tokenizer's own warning for text longer than that would only print a second message.
    tokenizer.model_max_length = int(1e30)
    return tokenizer


# What transformers reads to build a tokenizer, in its order; each must be valid JSON.
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.json",
                   "config.json")


def broken_tokenizer_file(path: Path) -> str | None:
    """Which of the tokenizer's files is broken, in a sentence naming it (None if none is): looked for
    once transformers has failed, whose own message rarely names the file."""
    from tokenizers import Tokenizer

    for name in TOKENIZER_FILES:
        file = path / name
        if not file.is_file():
            continue
        try:
            json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return f"{file} is not valid JSON: {err}"
    try:
        Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as err:  # the tokenizers library's own error
        return f"{path / 'tokenizer.json'} is not a tokenizer the tokenizers library can read: {err}"
    return None


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool = True, thinking: bool = True) -> list[int]:
    """Token ids for one prompt: through the chat template (as a user turn, with the assistant's
    turn opened, thinking on or off) when asked and the tokenizer has one; else raw completion."""
    if chat and tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=thinking,
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


class TextStream:
    """Turns a growing list of token ids into text pieces, never splitting a multi-byte
    character. Each token is one step of the tokenizers library's DecodeStream (incremental:
    the text so far is not decoded again, so a token costs the same at any length); flush()
    ends the stream with what a full decode of every token adds to the pieces already out (a
    character still incomplete at the end, as U+FFFD, as `tokenizer.decode` gives it)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.printed = 0  # characters already emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        piece = self.stream.step(self.tokenizer.backend_tokenizer, token_id) or ""  # None: a character incomplete
        self.printed += len(piece)
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        piece, self.printed = text[self.printed :], len(text)
        return piece


def byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, Qwen's): the character that stands for each byte in a
    token's name -> the byte. Printable bytes stand for themselves; the other 68 are shifted to
    the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


class TokenPieces:
    """Each token's own bytes and text, as OpenAI's log-probabilities show a token: a token of
    byte-level BPE may hold part of a character, so its bytes are exact and its text replaces an
    incomplete character with U+FFFD (what decoding the token alone gives)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.alphabet = byte_alphabet()
        self.known: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token."""
        if token_id not in self.known:
            name = self.tokenizer.convert_ids_to_tokens(token_id)
            if name is not None and name and all(c in self.alphabet for c in name):
                raw = bytes(self.alphabet[c] for c in name)
            else:  # not byte-level (or a special token named otherwise): its decoded text
                raw = self.tokenizer.decode([token_id]).encode()
            self.known[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self.known[token_id]
