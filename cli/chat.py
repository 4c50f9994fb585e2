"""A conversation in the terminal (qwen3-chat, or generate.py --interactive). Each line typed at the
`> ` prompt (shown when stdin is a terminal; piped lines get the replies alone) is a user turn; the
reply streams to stdout, then a status line goes to stderr: "[412 tokens in the conversation, 31 new
at 30.2 tok/s]". A turn's prompt is the whole conversation through the checkpoint's chat template
(enable_thinking per --thinking, on by default): each turn prefills it all again, which a prefix cache
in the serving engine would spare by reusing the previous turn's keys and values.

Qwen3's reasoning, between `<think>` and `</think>` at the start of a reply, is shown dimmed (ANSI) when
stdout is a terminal, else under a line `[thinking]`, the answer under a line `[answer]`. The history
keeps the answer only, as Qwen3's template expects; a reply cut off before `</think>` is all reasoning.
Without a chat template (a base model, as weights/qwen3-stdlib-tiny) or with --no-chat, a turn's prompt
is the lines and replies so far, each typed line starting a line of the text (a note at the start
says so), and no reasoning is looked for.

/reset forgets the history; /exit or Ctrl-D ends the session (status 0); /help lists the commands;
a blank line is ignored. Any other line that starts with "/" is a mistyped command: it gets one line
saying so and is not sent; "//" sends a line that starts with "/" (one "/" less).
Ctrl-C during a reply stops it and leaves that exchange out of the history; Ctrl-C at the prompt
drops the line being typed and shows a new prompt, as Python's own prompt does. A reply may take all
the room the model's context leaves, which a turn keeps at 2,048 tokens or a quarter of the
context, the smaller (or --max-new-tokens, when given, as the reply's limit and the room kept);
a turn that would not leave that room drops the oldest exchanges, as few as make it fit,
and says how many; a line that does not fit even alone is not sent. A reply cut at its limit says so
in its status line ("cut while thinking": Qwen3 reasons at length, give it room).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from runtime.generate import stop_ids
from runtime.reasoning import OPEN, Part, ReasoningSplitter
from runtime.text import TextStream

from . import output
from .output import Stdout, bad_flag, fail

DIM, PLAIN = "\x1b[2m", "\x1b[0m"
PROMPT = "> "
COMMANDS = '/reset forgets the history, /exit (or Ctrl-D) ends the session; "//" sends a line that starts with "/"'
# The room a reply keeps when --max-new-tokens is not given, at most a quarter of the context: Qwen3's
# reasoning alone often takes hundreds of tokens, and older exchanges go before a reply is squeezed.
REPLY_ROOM = 2048


class ReplyView:
    """Writes a reply's parts to stdout: on a terminal the reasoning dimmed; elsewhere under a line
    [thinking], the answer that follows it under a line [answer] (no label for a reply without one)."""

    def __init__(self, out: Stdout, terminal: bool):
        self.out, self.terminal = out, terminal
        self.part: Part | None = None

    def show(self, parts: list[tuple[Part, str]]) -> None:
        for part, text in parts:
            if part is not self.part:
                self.switch(part)
            self.out.write(text)

    def switch(self, part: Part) -> None:
        """Reasoning comes first, if at all: the answer is set apart only from reasoning before it."""
        after_reasoning, self.part = self.part is Part.REASONING, part
        if part is Part.ANSWER and not after_reasoning:
            return
        self.out.end_line()  # the reasoning's and the answer's own lines
        if self.terminal:
            self.escape(DIM if part is Part.REASONING else PLAIN)
        else:
            self.out.write(f"[{part.value}]\n")

    def close(self, stopped: bool = False) -> None:
        """Ends the reply: its dimming and its line. The ^C a terminal echoes at Ctrl-C leaves the line open."""
        if self.terminal and self.part is Part.REASONING:
            self.escape(PLAIN)
        if stopped and self.terminal:
            self.out.write("\n")
        else:
            self.out.end_line()

    def escape(self, code: str) -> None:
        """An ANSI code moves no cursor: the line stays as open (or ended) as it was."""
        line_open = self.out.line_open
        self.out.write(code)
        self.out.line_open = line_open


@dataclass
class Conversation:
    """The exchanges so far (typed line, stored answer) and how a turn's prompt renders from them."""

    tokenizer: object
    chat: bool
    thinking: bool
    exchanges: list[tuple[str, str]] = field(default_factory=list)

    def prompt_text(self, line: str, exchanges: list[tuple[str, str]]) -> str:
        if not self.chat:
            text = "".join(user + answer for user, answer in exchanges)
            return text + ("\n" if text and not text.endswith("\n") else "") + line  # a typed line starts a line
        messages = [m for user, answer in exchanges
                    for m in ({"role": "user", "content": user}, {"role": "assistant", "content": answer})]
        return self.tokenizer.apply_chat_template(messages + [{"role": "user", "content": line}],
                                                  add_generation_prompt=True, enable_thinking=self.thinking,
                                                  tokenize=False)

    def fit(self, line: str, room: int) -> tuple[str, list[int], int] | None:
        """The turn's prompt text and ids with as few of the oldest exchanges dropped as leave `room`
        tokens for the prompt, and how many were dropped; None if the line alone does not fit."""
        for dropped in range(len(self.exchanges) + 1):
            text = self.prompt_text(line, self.exchanges[dropped:])
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) <= room:
                return text, ids, dropped
        return None


def converse(model, tokenizer, args, out: Stdout) -> None:
    """The session: turns until /exit or the end of input; see the module's docstring."""
    if sys.stdin is None:  # started with stdin closed (`<&-`)
        fail("standard input is closed, so there are no lines to read")
    context = model.config.max_position_embeddings
    if args.max_new_tokens is not None and args.max_new_tokens >= context:
        bad_flag(f"--max-new-tokens {args.max_new_tokens}: leaves no room for a prompt in the model's context "
                     f"of {context} tokens; at most {context - 1}")
    chat = args.chat is not False and bool(tokenizer.chat_template)
    if not chat:
        why = "--no-chat" if args.chat is False else f"{args.model} has no chat template"
        print(f"{output.PROG}: note: {why}: each line continues the conversation's text as a plain prompt",
              file=sys.stderr)
    conversation = Conversation(tokenizer, chat, thinking=args.thinking is not False)
    dim = sys.stdout.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"  # no-color.org
    session = Session(model, tokenizer, args, out, conversation, dim=dim)
    typed = sys.stdin.isatty()  # a person types: show a prompt; piped lines get the replies only
    while (line := read_line(out, PROMPT if typed else "")) is not None and line.strip() != "/exit":
        command = line.strip()
        if command == "/reset":
            conversation.exchanges.clear()
            print("[history cleared]", file=sys.stderr)
        elif command == "/help":
            print(f"[{COMMANDS}]", file=sys.stderr)
        elif command.startswith("//"):
            session.turn(line.replace("/", "", 1))
        elif command.startswith("/"):
            print(f"[unknown command {command.split()[0]}: {COMMANDS}]", file=sys.stderr)
        elif command:
            session.turn(line)


def read_line(out: Stdout, prompt: str) -> str | None:
    """The next line; None at the end of input (Ctrl-D); "" (nothing to send) after Ctrl-C. The
    terminal's own line editing (its cooked mode: backspace, Ctrl-U, Ctrl-W) edits the line, and
    its Ctrl-C discards what was typed, as a new prompt should. Not readline: after Ctrl-C, input()
    would show the discarded line again at the next prompt and send it with the next one."""
    try:
        out.write(prompt)  # through stdout's writer, which reports a failing stdout as such
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        line.encode()  # bytes that stdin's encoding cannot decode may arrive as lone surrogates (surrogateescape)
    except EOFError:
        out.write("\n" if prompt else "")  # the shell's prompt starts a line of its own
        return None
    except KeyboardInterrupt:  # at the prompt: the line typed so far is dropped, a new prompt follows
        out.write("\n")
        return ""
    except UnicodeError:
        fail("a line of standard input holds bytes that are not text in its encoding (UTF-8 as a rule)")
    return line.removesuffix("\n")


@dataclass
class Session:
    """What each turn uses: the model and its tokenizer, the flags, stdout, the conversation so far."""

    model: object
    tokenizer: object
    args: argparse.Namespace
    out: Stdout
    conversation: Conversation
    dim: bool  # stdout is a terminal: the reasoning is dimmed rather than labelled

    def turn(self, line: str) -> None:
        """One exchange: the prompt fitted to the context, the reply streamed, the history extended."""
        context, limit = self.model.config.max_position_embeddings, self.args.max_new_tokens
        room = limit if limit is not None else min(REPLY_ROOM, context // 4)
        fitted = self.conversation.fit(line, context - room)
        if fitted is None:
            what = f"--max-new-tokens {limit}" if limit is not None else f"the {room} tokens a reply keeps"
            print(f"{output.PROG}: this line and {what} exceed the model's context of {context} tokens: not sent; "
                  "type a shorter one", file=sys.stderr)
            return
        text, ids, dropped = fitted
        if dropped:
            print(f"{output.PROG}: note: the conversation outgrew the model's context of {context} tokens: dropped "
                  f"the {dropped} oldest exchange(s)", file=sys.stderr)
            del self.conversation.exchanges[:dropped]
        opened = self.conversation.chat and text.rstrip().endswith(OPEN)  # the template opened the think block
        splitter = ReasoningSplitter(opened, plain=not self.conversation.chat)
        answer = self.reply(ids, splitter, limit if limit is not None else context - len(ids))
        if answer is None:
            print("[stopped: this exchange is left out of the history]", file=sys.stderr)
        else:
            self.conversation.exchanges.append((line, answer))

    def reply(self, ids: list[int], splitter: ReasoningSplitter, limit: int) -> str | None:
        """Generates the reply to `ids`, at most `limit` tokens, writing it as it comes, then its status
        line; its answer, or None if Ctrl-C stopped it."""
        model, args, view = self.model, self.args, ReplyView(self.out, self.dim)
        eos = stop_ids(model, self.tokenizer)
        stream = TextStream(self.tokenizer)
        new_tokens = 0

        last = None

        def on_token(new: torch.Tensor) -> None:
            nonlocal new_tokens, last
            new_tokens, last = new_tokens + 1, int(new[0])
            view.show(splitter.feed(stream.push(last)))

        start = time.perf_counter()
        try:
            model.generate(
                torch.tensor([ids]), max_new_tokens=limit, eos_token_id=sorted(eos) or None,
                seed=args.seed, on_token=on_token, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty, cuda_graph=args.cuda_graph,
            )
            seconds = time.perf_counter() - start
            view.show(splitter.feed(stream.flush()))  # what push held back: an unfinished multi-byte character
            view.show(splitter.finish())
        except KeyboardInterrupt:
            view.close(stopped=True)
            return None
        except (ValueError, torch.OutOfMemoryError) as err:
            view.close()
            fail(err)
        view.close()
        cut = "" if last in eos or new_tokens < limit else \
            ", cut while thinking" if splitter.part is Part.REASONING else ", cut at the limit"
        print(f"[{len(ids) + new_tokens} tokens in the conversation, {new_tokens} new at "
              f"{new_tokens / max(seconds, 1e-9):.1f} tok/s{cut}]", file=sys.stderr)
        return splitter.answer
