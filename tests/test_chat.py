"""The interactive mode (qwen3-chat, generate.py --interactive): a conversation whose every turn's
reply is compared with transformers' greedy reply to the conversation so far, rendered by the
tokenizer's own chat template. On a pseudo-terminal in a process of its own where the terminal is
what is tested (what it shows, Ctrl-C, Ctrl-D); in this process with piped lines elsewhere; and the
splitting of a reply into reasoning and answer on its own."""

import fcntl
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch
from checkpoints import hf_model, save, save_tokenizer
from in_process import call_main
from transformers import AutoTokenizer

from cli import generate
from cli.chat import COMMANDS, Conversation, ReplyView, Session
from runtime.reasoning import Part, ReasoningSplitter

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 120  # seconds for any one wait on the process: a hang fails the test instead of blocking the suite
STATUS = re.compile(rb"\[(\d+) tokens in the conversation, (\d+) new at [\d.]+ tok/s(, cut [a-z ]+)?\]")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A checkpoint with a chat template, and the transformers model it was saved from."""
    model = hf_model(seed=21)
    path = save_tokenizer(save(model, tmp_path_factory.mktemp("chat-model")))
    assert model.config.eos_token_id is None  # the tokenizer's end of text is the only stop, as the CLI resolves it
    return path, model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def base_model_dir(reference, tmp_path_factory):
    """The same weights with a tokenizer that has no chat template, as a base model's."""
    model_dir, _, _ = reference
    path = tmp_path_factory.mktemp("chat-base-model")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (path / name).symlink_to(model_dir / name)
    return save_tokenizer(path, chat=False)


def chat_text(tokenizer, turns: list[str]) -> str:
    """Alternate user and assistant turns, then the assistant's opened turn: transformers' rendering."""
    messages = [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(turns)]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=True, tokenize=False)


def greedy(model, tokenizer, text: str, n: int) -> tuple[str, int, int]:
    """transformers' greedy reply to `text`: its text, the prompt's tokens and the new tokens (the stop's included)."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    new = out[0, ids.shape[1]:].tolist()
    assert new, "no reply"
    return tokenizer.decode(new, skip_special_tokens=True), ids.shape[1], len(new)


def ended(reply: str) -> str:
    """A reply as printed: its line ended."""
    return reply if not reply or reply.endswith("\n") else reply + "\n"


def on_screen(text: str) -> bytes:
    """Text as a terminal shows it: the terminal driver turns each line feed into CR LF."""
    return text.replace("\n", "\r\n").encode()


def take_terminal() -> None:
    """In the child: a session of its own whose controlling terminal is its stdin, the pseudo-terminal,
    so that Ctrl-C typed there sends it SIGINT; Ctrl-C's default action (a shell may start it ignored)."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Terminal:
    """generate.py --interactive in a process of its own, its stdin and stdout a pseudo-terminal, its
    stderr a pipe: what the screen showed and stderr said, read with a timeout on every wait."""

    def __init__(self, *args: str):
        self.master, slave = pty.openpty()
        env = {**os.environ, "TRITON_INTERPRET": "1", "TERM": "dumb"}  # dumb: no escape codes on the screen
        self.process = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "generate.py"), "--interactive", *args],
                                        stdin=slave, stdout=slave, stderr=subprocess.PIPE, cwd=ROOT, env=env,
                                        preexec_fn=take_terminal)
        os.close(slave)
        self.screen, self.stderr = b"", b""
        self.open = {self.master, self.process.stderr.fileno()}

    def read(self, seconds: float) -> None:
        """Takes in what the process wrote within `seconds`."""
        ready, _, _ = select.select(list(self.open), [], [], seconds)
        for fd in ready:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:  # EIO: the terminal's other side is closed, the process gone
                data = b""
            if not data:
                self.open.discard(fd)
            elif fd == self.master:
                self.screen += data
            else:
                self.stderr += data

    def wait_for(self, done, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not done():
            if time.monotonic() > deadline or not self.open:
                pytest.fail(f"{'timed out' if self.open else 'ended'} waiting for {what}; screen: {self.screen!r}, "
                            f"stderr: {self.stderr.decode(errors='replace')}")
            self.read(0.1)

    def statuses(self) -> list[tuple[int, int]]:
        """(tokens in the conversation, new tokens) of each reply so far, from stderr's status lines."""
        return [(int(total), int(new)) for total, new, _ in STATUS.findall(self.stderr)]

    def prompted(self) -> bool:
        return self.screen.endswith(b"> ")

    def turn(self, line: str) -> bytes:
        """Types the line at the prompt; what the screen showed until the next prompt."""
        self.wait_for(self.prompted, "the prompt")
        start, replies = len(self.screen), len(self.statuses())
        self.type(line + "\n")
        self.wait_for(lambda: len(self.statuses()) > replies and self.prompted(), f"the reply to {line!r}")
        return self.screen[start:]

    def asleep(self) -> bool:
        """Whether the process's main thread sleeps: at the prompt, in its wait for a key. A signal sent
        before that wait begins would not end it (CPython checks for signals when a wait is interrupted),
        so Ctrl-C waits for this, as a person, who needs a moment to press it, does."""
        stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] == "S"  # the state follows the name, which may hold spaces

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def exit_status(self) -> int:
        self.wait_for(lambda: not self.open, "the end of the session")
        return self.process.wait(timeout=TIMEOUT)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=TIMEOUT)
        os.close(self.master)
        self.process.stderr.close()


@pytest.fixture
def terminal():
    """terminal(*args): a Terminal, killed at the end of the test if still running."""
    started = []

    def start(*args: str) -> Terminal:
        started.append(Terminal(*args))
        return started[-1]

    yield start
    for term in started:
        term.close()


def test_each_turn_replies_to_the_whole_conversation_until_reset_and_ctrl_d_ends_it(reference, terminal):
    """Three turns: each reply, as the terminal shows it, is transformers' greedy reply to the conversation
    so far (the earlier lines and replies); the second differs from the reply to its line alone, which is
    what the same line gets after /reset. Each status line counts the prompt's tokens and the reply's.
    Ctrl-D at the prompt ends the session with status 0."""
    model_dir, model, tokenizer = reference
    n = 24
    lines = ["def add(a, b):", "print it", "and again"]
    term = terminal("--model", str(model_dir), "--temperature", "0", "--max-new-tokens", str(n), "--device", "cpu")
    turns, counts = [], []
    for line in lines:
        reply, prompt_tokens, new_tokens = greedy(model, tokenizer, chat_text(tokenizer, [*turns, line]), n)
        assert term.turn(line) == on_screen(f"{line}\n{ended(reply)}> ")
        turns += [line, reply]
        counts.append((prompt_tokens + new_tokens, new_tokens))
    assert term.statuses() == counts
    alone, _, _ = greedy(model, tokenizer, chat_text(tokenizer, [lines[1]]), n)
    assert turns[3] != alone  # the test can tell a reply to the conversation from one to the line alone
    term.type("/reset\n")
    term.wait_for(lambda: b"[history cleared]\n" in term.stderr and term.prompted(), "the prompt after /reset")
    assert term.turn(lines[1]) == on_screen(f"{lines[1]}\n{ended(alone)}> ")  # a first turn's reply
    term.type("\x04")
    assert term.exit_status() == 0
    assert term.screen.endswith(b"> \r\n")  # the shell's prompt on a line of its own
    assert b"Traceback" not in term.stderr and b"note:" not in term.stderr, term.stderr


def test_ctrl_c_stops_a_reply_and_leaves_it_out_and_at_the_prompt_drops_the_line(reference, terminal):
    """Ctrl-C while a reply streams: its text so far, ^C and the prompt on a new line; the next turn replies as
    a first turn does (the stopped exchange is not in the history). Ctrl-C at the prompt: the line typed so
    far is dropped and a new prompt shown, the session goes on; Ctrl-D ends it with status 0."""
    model_dir, model, tokenizer = reference
    n = 200
    line = "hello"
    whole, prompt_tokens, new_tokens = greedy(model, tokenizer, chat_text(tokenizer, [line]), n)
    assert new_tokens == n  # long: still streaming when Ctrl-C comes
    term = terminal("--model", str(model_dir), "--temperature", "0", "--max-new-tokens", str(n), "--device", "cpu")
    term.wait_for(term.prompted, "the prompt")
    start = len(term.screen)
    term.type(line + "\n")
    echo = on_screen(f"{line}\n")
    term.wait_for(lambda: len(term.screen) > start + len(echo), "the reply's first text")
    term.process.send_signal(signal.SIGSTOP)  # held mid-reply, so that a fast machine cannot finish first
    term.type("\x03")
    term.process.send_signal(signal.SIGCONT)
    term.wait_for(lambda: b"[stopped" in term.stderr and term.prompted(), "the prompt after the stop")
    shown = term.screen[start:]
    assert shown.startswith(echo) and shown.endswith(b"^C\r\n> "), shown
    partial = shown[len(echo):-len(b"^C\r\n> ")]
    assert partial and on_screen(whole).startswith(partial) and len(partial) < len(on_screen(whole))
    assert term.statuses() == []
    assert term.turn(line) == on_screen(f"{line}\n{ended(whole)}> ")
    assert term.statuses() == [(prompt_tokens + new_tokens, new_tokens)]
    term.type("half a li")
    term.wait_for(lambda: term.screen.endswith(b"> half a li") and term.asleep(), "the line's echo, and the wait")
    term.type("\x03")
    term.wait_for(lambda: term.screen.endswith(b"> half a li^C\r\n> "), "a new prompt after Ctrl-C")
    assert term.turn(line) == on_screen(f"{line}\n{ended(whole)}> ")  # "half a li" never reached the model
    term.type("\x04")
    assert term.exit_status() == 0
    assert "interrupted" not in term.stderr.decode(), term.stderr


def test_piped_lines_get_the_replies_alone_and_reset_forgets_the_history(reference, run_cli):
    """Lines from a pipe: no prompt, each reply on its own line(s); after /reset a line gets the reply it
    gets as a first turn; a blank line is nothing; the end of input ends the session with status 0."""
    model_dir, model, tokenizer = reference
    n = 16
    first, _, _ = greedy(model, tokenizer, chat_text(tokenizer, ["def add(a, b):"]), n)
    second, _, _ = greedy(model, tokenizer, chat_text(tokenizer, ["def add(a, b):", first, "print it"]), n)
    alone, _, _ = greedy(model, tokenizer, chat_text(tokenizer, ["print it"]), n)
    assert second != alone
    result = run_cli("--model", str(model_dir), "--interactive", "--temperature", "0", "--max-new-tokens", str(n),
                     stdin=b"def add(a, b):\n\nprint it\n  \n/reset\nprint it\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ended(first) + ended(second) + ended(alone)
    assert result.stderr.splitlines()[2] == "[history cleared]", result.stderr
    assert len(STATUS.findall(result.stderr.encode())) == 3, result.stderr


def test_exit_ends_the_session_with_status_0(reference, run_cli):
    model_dir, model, tokenizer = reference
    reply, _, _ = greedy(model, tokenizer, chat_text(tokenizer, ["x"]), 4)
    result = run_cli("--model", str(model_dir), "--interactive", "--temperature", "0", "--max-new-tokens", "4",
                     stdin=b"x\n/exit\ny\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ended(reply)  # y, after /exit, is not read


def test_a_mistyped_command_is_not_sent_and_help_lists_the_commands(reference, run_cli):
    """/exti or /RESET: one line naming it, nothing sent to the model; /help lists the commands;
    "//" sends a line that starts with "/" (one "/" less)."""
    model_dir, model, tokenizer = reference
    reply, _, _ = greedy(model, tokenizer, chat_text(tokenizer, ["/x"]), 4)
    result = run_cli("--model", str(model_dir), "--interactive", "--temperature", "0", "--max-new-tokens", "4",
                     stdin=b"/exti\n/RESET now\n/help\n//x\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ended(reply)  # the one line sent: "/x", as a first turn
    lines = result.stderr.splitlines()
    assert lines[:3] == [f"[unknown command /exti: {COMMANDS}]", f"[unknown command /RESET: {COMMANDS}]",
                          f"[{COMMANDS}]"], result.stderr


def test_qwen3_chat_has_its_own_help_and_names_itself_in_its_errors(capsys, monkeypatch):
    """qwen3-chat's --help describes the conversation and lists no prompt flags; one given anyway is
    refused in a line that does not name --interactive, a flag the user never typed."""
    from cli import output

    monkeypatch.setattr(output, "PROG", "qwen3-chat")
    with pytest.raises(SystemExit) as exit:
        generate.parse_args(["--help"], chat=True)
    shown = capsys.readouterr().out
    assert exit.value.code == 0 and shown.startswith("usage: qwen3-chat ") and "A conversation in the terminal" in shown
    assert "--prompt" not in shown and "--interactive" not in shown.split("\n\n")[0]
    with pytest.raises(SystemExit) as exit:
        generate.parse_args(["--prompt", "x"], chat=True)
    assert exit.value.code == 2 and capsys.readouterr().err == (
        "qwen3-chat: error: the chat reads its prompts from the terminal: drop --prompt and --prompt-file "
        "(see --help)\n")


@pytest.mark.parametrize("flags, why", [([], "{model} has no chat template"), (["--no-chat"], "--no-chat")])
def test_without_a_chat_template_each_line_continues_the_text_so_far(reference, base_model_dir, flags, why,
                                                                      run_cli):
    """A base model (no chat template), or --no-chat: a note, once, at the start; each turn's prompt is
    the lines and replies so far, each typed line starting a line of the text."""
    model_dir, model, tokenizer = reference
    directory = model_dir if flags else base_model_dir
    n = 12
    first, _, _ = greedy(model, tokenizer, "def add(a, b):", n)
    second, _, _ = greedy(model, tokenizer, "def add(a, b):" + ended(first) + "    return", n)  # a line starts a line
    result = run_cli("--model", str(directory), "--interactive", "--temperature", "0", "--max-new-tokens", str(n),
                     *flags, stdin=b"def add(a, b):\n    return\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ended(first) + ended(second)
    note, *rest = result.stderr.splitlines()
    assert note == (f"generate.py: note: {why.format(model=directory)}: each line continues the conversation's "
                    "text as a plain prompt")
    assert len(rest) == 2 and all(STATUS.fullmatch(line.encode()) for line in rest), result.stderr


def test_a_conversation_that_outgrows_the_context_drops_its_oldest_exchanges(reference, run_cli):
    """With 150 new tokens a turn, the third turn's prompt would not leave room in the context of 512:
    the oldest exchange goes (one line says so), and the reply is the one to the two exchanges left."""
    model_dir, model, tokenizer = reference
    n, context = 150, model.config.max_position_embeddings
    first, _, _ = greedy(model, tokenizer, chat_text(tokenizer, ["hello"]), n)
    second, _, _ = greedy(model, tokenizer, chat_text(tokenizer, ["hello", first, "x"]), n)
    everything = chat_text(tokenizer, ["hello", first, "x", second, "y"])
    assert len(tokenizer(everything, add_special_tokens=False).input_ids) + n > context  # the test's premise
    third, prompt_tokens, new_tokens = greedy(model, tokenizer, chat_text(tokenizer, ["x", second, "y"]), n)
    result = run_cli("--model", str(model_dir), "--interactive", "--temperature", "0", "--max-new-tokens", str(n),
                     stdin=b"hello\nx\ny\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ended(first) + ended(second) + ended(third)
    lines = result.stderr.splitlines()
    assert lines[2] == ("generate.py: note: the conversation outgrew the model's context of 512 tokens: dropped the "
                        "1 oldest exchange(s)"), result.stderr
    assert STATUS.fullmatch(lines[3].encode()).groups()[:2] == (str(prompt_tokens + new_tokens).encode(),
                                                             str(new_tokens).encode())


def test_a_line_that_cannot_fit_is_not_sent_and_a_reply_that_cannot_is_a_bad_flag(reference, run_cli):
    model_dir, _, _ = reference
    result = run_cli("--model", str(model_dir), "--interactive", "--max-new-tokens", "500", stdin=b"x " * 20 + b"\n")
    assert result.returncode == 0 and result.stdout == "", result.stderr
    assert result.stderr == ("generate.py: this line and --max-new-tokens 500 exceed the model's context of 512 "
                             "tokens: not sent; type a shorter one\n")
    result = run_cli("--model", str(model_dir), "--interactive", "--max-new-tokens", "512", stdin=b"x\n")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("generate.py: error: --max-new-tokens 512: leaves no room for a prompt in the model's "
                             "context of 512 tokens; at most 511 (see --help)\n")


def test_unreadable_input_or_unwritable_output_ends_in_one_line(reference, run_cli, capfd, monkeypatch):
    """Bytes that are not UTF-8 text, a closed stdin, a full disk: one line on stderr and status 1."""
    model_dir, _, _ = reference
    args = ["--model", str(model_dir), "--interactive", "--max-new-tokens", "4"]
    result = run_cli(*args, stdin=b"x\ny\xff\n")
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[-1] == ("generate.py: error: a line of standard input holds bytes that are not "
                                              "text in its encoding (UTF-8 as a rule)"), result.stderr
    monkeypatch.setattr(sys, "stdin", None)
    result = call_main(generate.main, args, capfd)
    assert (result.returncode, result.stderr) == (1, "generate.py: error: standard input is closed, so there are no "
                                                     "lines to read\n")
    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        result = run_cli(*args, stdin=b"x\n")
    assert (result.returncode, result.stderr) == (1, "generate.py: error: cannot write to standard output: No space "
                                                     "left on device\n")


# The reasoning splitter, fed a reply in pieces cut everywhere: (reply, prompt opened <think>, reasoning, answer).
# The newlines around the reasoning are Qwen3's format, not the reasoning's (its template strips them).
REPLIES = {
    "think block": ("<think>\nadd them\n</think>\n\nreturn a + b", False, "add them", "return a + b"),
    "no think block": ("return a + b\n", False, "", "return a + b\n"),
    "blank space first": ("\n <think>plan</think>done", False, "plan", "done"),
    "tags later are text": ("so <think>x</think> y", False, "", "so <think>x</think> y"),
    "never closed": ("<think>\nstill thinking when the tokens ran out", False,
                     "still thinking when the tokens ran out", ""),
    "a closing tag begun at the end": ("<think>a</thi", False, "a</thi", ""),
    "an opening tag begun at the end": ("<thi", False, "", "<thi"),
    "only blank space": ("\n\n", False, "", "\n\n"),
    "opened by the prompt": ("plan\n</think>\n\nanswer", True, "plan", "answer"),
}


def split(pieces: list[str], thinking: bool) -> list[tuple[Part, str]]:
    splitter = ReasoningSplitter(thinking)
    parts = [part for piece in pieces for part in splitter.feed(piece)] + splitter.finish()
    assert splitter.answer == "".join(text for part, text in parts if part is Part.ANSWER)
    return parts


@pytest.mark.parametrize("case", REPLIES)
def test_reasoning_and_answer_come_apart_however_the_reply_is_cut(case):
    reply, thinking, reasoning, answer = REPLIES[case]
    cuts = [[reply], list(reply)] + [[reply[:i], reply[i:j], reply[j:]] for i in range(len(reply) + 1)
                                     for j in range(i, len(reply) + 1)]
    for pieces in cuts:
        parts = split(pieces, thinking)
        assert "".join(text for part, text in parts if part is Part.REASONING) == reasoning, pieces
        assert "".join(text for part, text in parts if part is Part.ANSWER) == answer, pieces
        kinds = [part for part, _ in parts]
        assert kinds == sorted(kinds, key=lambda part: part is Part.ANSWER), pieces  # reasoning first, if at all


def show(terminal: bool, parts: list[tuple[Part, str]], stopped: bool = False) -> None:
    """Writes a reply's parts to stdout as the session does, ending it or stopping it."""
    view = ReplyView(generate.Stdout(), terminal)
    view.show(parts)
    view.close(stopped)


@pytest.mark.parametrize("terminal, shown", [
    (True, "\x1b[2madd them\n\x1b[0mreturn a + b\n"),
    (False, "[thinking]\nadd them\n[answer]\nreturn a + b\n"),
])
def test_reasoning_is_dimmed_on_a_terminal_and_labelled_elsewhere(terminal, shown, capsys):
    show(terminal, [(Part.REASONING, "add "), (Part.REASONING, "them"), (Part.ANSWER, "return a + b")])
    assert capsys.readouterr().out == shown
    show(terminal, [(Part.ANSWER, "return a + b")])
    assert capsys.readouterr().out == "return a + b\n"  # nothing to set apart


def test_a_reply_stopped_in_its_reasoning_ends_the_dimming_and_the_line(capsys):
    show(True, [(Part.REASONING, "add them")], stopped=True)
    assert capsys.readouterr().out == "\x1b[2madd them\x1b[0m\n"
    show(False, [(Part.REASONING, "add them")], stopped=True)
    assert capsys.readouterr().out == "[thinking]\nadd them\n"


class ScriptedModel:
    """Stands in for the model: its reply is the tokens of a given text, whatever the prompt."""

    def __init__(self, tokenizer, reply: str, context: int = 512):
        self.config = type("Config", (), {"max_position_embeddings": context, "eos_token_id": None})()
        self.generation_config = {}
        self.ids = tokenizer(reply, add_special_tokens=False).input_ids
        self.prompts: list[list[int]] = []

    def generate(self, input_ids, max_new_tokens, on_token, **sampling):
        self.prompts.append(input_ids[0].tolist())
        for token in self.ids[:max_new_tokens]:
            on_token(torch.tensor([token]))


@pytest.mark.parametrize("reply, stored", [("<think>\nadd them\n</think>\n\nreturn a + b", "return a + b"),
                                           ("<think>\nadd them, then", "")])
def test_the_history_keeps_the_answer_without_the_reasoning(reference, reply, stored, capsys):
    """What the next turn's prompt holds of a reply: its answer only, as Qwen3's template expects; none
    of a reply whose reasoning never ended."""
    model_dir, _, tokenizer = reference
    model = ScriptedModel(tokenizer, reply)
    args = generate.parse_args(["--interactive", "--model", str(model_dir), "--max-new-tokens", "64"])
    conversation = Conversation(tokenizer, chat=True, thinking=True)
    session = Session(model, tokenizer, args, generate.Stdout(), conversation, dim=False)
    session.turn("add a and b")
    assert conversation.exchanges == [("add a and b", stored)]
    assert capsys.readouterr().out.startswith("[thinking]\nadd them")
    session.turn("again")
    rendered = chat_text(tokenizer, ["add a and b", stored, "again"])
    assert model.prompts[1] == tokenizer(rendered, add_special_tokens=False).input_ids
