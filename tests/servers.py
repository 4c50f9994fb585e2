"""scripts/serve.py as a user runs it, for the server tests: started on 127.0.0.1 with --port 0 (the
port read from the line it prints), its output in a file, every wait bounded; and the text the
model itself generates for a prompt (model.generate, greedy), the reference a server's answer must
equal."""

import importlib.util
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from checkpoints import CHAT_TEMPLATE

from qwen3 import Qwen3ForCausalLM
from runtime.generate import resolve_eos

ROOT = Path(__file__).resolve().parent.parent
SERVE_PY = ROOT / "scripts" / "serve.py"
SHIPPED = ROOT / "weights" / "qwen3-stdlib-tiny"
NAME = "qwen3-stdlib-tiny"
SERVER_START_S = 120  # two interpreters import torch + transformers and load the model on a busy 2-core machine
REQUEST_TIMEOUT_S = 60
# One OpenMP thread: the model is tiny, and spinning threads on shared cores only slow it down.
ENV = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
SERVING = re.compile(r"^serving \S+ at (http://\S+) on ")


@dataclass
class Served:
    """A running serve.py: its process, its URL, and the file its stdout and stderr go to."""

    proc: subprocess.Popen
    url: str
    log: Path

    def said(self) -> list[str]:
        """The lines it printed after its "serving ... at" line."""
        lines = self.log.read_text().splitlines()
        start = next(i for i, line in enumerate(lines) if SERVING.match(line))
        return lines[start + 1 :]

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def engine_pid(self) -> int:
        """The engine process's id: the child started by multiprocessing's spawn (not its resource tracker)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in map(int, children):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        raise AssertionError(f"serve.py (pid {self.proc.pid}) has no engine process among {children}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(model_dir: Path, log: Path, *flags: str, command: tuple[str, ...] = (sys.executable, str(SERVE_PY)),
                 cwd: Path = ROOT) -> Served:
    """serve.py (or `command`, run in cwd) on 127.0.0.1, a port of the system's choice, the CPU; back
    once its "serving ... at" line is out and /health answers it 200 (the line's promise)."""
    cmd = [*command, "--model", str(model_dir), "--host", "127.0.0.1", "--port", "0", "--device", "cpu", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=cwd)
    deadline = time.monotonic() + SERVER_START_S
    url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve.py exited with {proc.returncode}:\n{log.read_text()}")
        if url is None:
            url = next((m.group(1) for line in log.read_text().splitlines() if (m := SERVING.match(line))), None)
        if url is not None:  # its line says it is ready: the first request is answered, not refused
            try:
                status = httpx.get(f"{url}/health", timeout=SERVER_START_S).status_code
            except httpx.ConnectError as err:
                proc.kill()
                raise RuntimeError(f"serve.py refused a connection after its 'serving at' line: {err}") from None
            if status != 200:
                proc.kill()
                raise RuntimeError(f"serve.py's /health answered {status} after its 'serving at' line")
            return Served(proc, url, log)
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"serve.py did not answer within {SERVER_START_S} s:\n{log.read_text()}")


@contextmanager
def serving(model_dir: Path, folder: Path, *flags: str):
    """A Served for the with block (its log in folder), stopped after it whatever happened to it."""
    served = start_server(model_dir, folder / "server.log", *flags)
    try:
        yield served
    finally:
        served.stop()


def with_chat_template(path: Path) -> Path:
    """The shipped model in path (linked) with a Qwen3-style chat template added to its tokenizer
    (the shipped model is a base model: tests/test_server_faults.py's server shows how it refuses
    chat requests)."""
    from runtime.text import load_tokenizer

    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (path / name).symlink_to(SHIPPED / name)
    tok = load_tokenizer(SHIPPED)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def load_serve_py():
    """cli/serve.py (what scripts/serve.py and qwen3-serve run): its checks run in this process, as
    the command runs them."""
    return importlib.import_module("cli.serve")


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def wait_for_health(url: str, ok, timeout_s: float = 30, every_s: float = 0.05) -> dict:
    """/health once ok(it) holds (or the last one seen, when timeout_s has passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        h = health(url)
        if ok(h) or time.monotonic() > deadline:
            return h
        time.sleep(every_s)


def idle(h: dict) -> bool:
    """Nothing runs or waits and every block is free again."""
    return h["running"] == 0 and h["waiting"] == 0 and h["free_blocks"] == h["total_blocks"]


def wait_until_idle(url: str, timeout_s: float = 60) -> dict:
    return wait_for_health(url, idle, timeout_s, every_s=0.2)


def error_of(response: httpx.Response) -> dict:
    """The error of a refusal in OpenAI's shape (asserted)."""
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def completion(url: str, prompt: str, max_tokens: int, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=REQUEST_TIMEOUT_S,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields})


class Reference:
    """The model in this process (float32, the CPU), greedy: the text a server must answer."""

    def __init__(self, model_dir: Path, tokenizer):
        self.model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, progress=False)
        self.tokenizer = tokenizer
        # The stop ids the server's engine and generate.py use: the tokenizer's and the checkpoint's.
        self.eos = {tokenizer.eos_token_id, *resolve_eos(None, self.model.generation_config, self.model.config)}
        self.eos.discard(None)
        self.texts: dict[tuple, str] = {}  # (ids, max_new_tokens, ignore_eos) -> text: each is generated once

    def ids(self, prompt: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def text(self, ids: tuple[int, ...], max_new_tokens: int, ignore_eos: bool = False) -> str:
        """The greedy continuation of ids, decoded; a stop token ends it and is not part of it."""
        key = (tuple(ids), max_new_tokens, ignore_eos)
        if key not in self.texts:
            self.texts[key] = self.generate(*key)
        return self.texts[key]

    def generate(self, ids: tuple[int, ...], max_new_tokens: int, ignore_eos: bool) -> str:
        eos = [] if ignore_eos else sorted(self.eos)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # beside a server on the same cores, more threads only wait for each other
        try:
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, temperature=0.0,
                                      eos_token_id=eos)
        finally:
            torch.set_num_threads(threads)
        new = out[0, len(ids) :].tolist()
        end = next((i for i, t in enumerate(new) if t in eos), len(new))
        return self.tokenizer.decode(new[:end], skip_special_tokens=True)


def process_gone(pid: int) -> bool:
    """Whether a process id is no longer a live process (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state == "Z"

