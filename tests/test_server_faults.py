"""The server under faults, as a client and an operator see them: scripts/serve.py on 127.0.0.1 (the
shipped model, the CPU) with clients that leave, bursts past the queue bound, fields it does not
implement, SIGINT and SIGTERM with requests open, a killed engine process, damaged checkpoints.

One server is shared by every fault it survives, and after each such fault a normal request must
still get the model's own answer; a fault that ends the server gets a server of its own. Damaged
checkpoints are checked through the function serve.py runs before it starts anything (the line a
user sees is its SystemExit's text), and one through the real command. Every wait is bounded."""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from servers import (
    ENV,
    REQUEST_TIMEOUT_S,
    ROOT,
    SERVE_PY,
    SERVING,
    SHIPPED,
    Reference,
    Served,
    completion,
    error_of,
    health,
    idle,
    load_serve_py,
    process_gone,
    serving,
    wait_for_health,
    wait_until_idle,
)

from runtime.text import load_tokenizer

MAX_BATCH, MAX_WAITING = 4, 2
NORMAL = ("import os", 6)  # the normal request that must still be answered right after a fault
LONG = 900  # tokens: a request that is still running when the fault comes
GRACE_S = 4  # a 24-token request finishes well within it on a loaded 2-core machine


@pytest.fixture(scope="module")
def reference():
    return Reference(SHIPPED, load_tokenizer(SHIPPED))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(SHIPPED, tmp_path_factory.mktemp("faults"), "--max-batch", str(MAX_BATCH),
                 "--max-waiting", str(MAX_WAITING)) as served:
        yield served.url


def assert_still_serving(url: str, reference: Reference) -> None:
    """A normal request gets the model's own greedy answer, and nothing is left running."""
    prompt, n = NORMAL
    r = completion(url, prompt, n)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference.text(reference.ids(prompt), n)
    assert idle(wait_until_idle(url, timeout_s=10))


def post_raw(url: str, path: str, body: dict) -> socket.socket:
    """A request sent on a socket of our own: closing the socket is a client that leaves."""
    address = urlparse(url)
    sock = socket.create_connection((address.hostname, address.port), timeout=10)
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_an_idle_connection_outlives_the_clients_own_idle_time(server):
    """httpx, and so the openai client, drops a pooled connection after 5 s idle. A server that
    closed it at 5 s as well would race a client reusing it, and the request would be lost (httpx's
    ReadError). Idle for 6 s, the connection is still open and answers its next request."""
    address = urlparse(server)
    request = f"GET /v1/models HTTP/1.1\r\nHost: {address.netloc}\r\n\r\n".encode()
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock, sock.makefile("rb") as r:

        def answer_status() -> bytes:
            sock.sendall(request)
            status, headers = r.readline(), list(iter(r.readline, b"\r\n"))
            r.read(next(int(h.split(b":")[1]) for h in headers if h.lower().startswith(b"content-length:")))
            return status

        assert answer_status().startswith(b"HTTP/1.1 200")
        time.sleep(6)
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing to read, and not closed (which reads b"")
            sock.recv(1, socket.MSG_PEEK)
        sock.setblocking(True)
        assert answer_status().startswith(b"HTTP/1.1 200")


def test_a_client_that_leaves_a_request_not_streamed_frees_its_blocks_within_a_second(server, reference):
    """curl -m 1 on a long completion: the request is cancelled as soon as its connection closes."""
    sock = post_raw(server, "/v1/completions", {"prompt": "import os", "max_tokens": LONG, "ignore_eos": True})
    try:
        running = wait_for_health(server, lambda h: h["running"] == 1 and h["free_blocks"] < h["total_blocks"])
        assert running["running"] == 1, running
    finally:
        sock.close()
    left = time.monotonic()
    h = wait_for_health(server, idle, timeout_s=10, every_s=0.02)
    assert idle(h) and time.monotonic() - left < 1.0, (time.monotonic() - left, h)
    assert_still_serving(server, reference)


def test_a_burst_past_the_queue_bound_gets_429_and_every_accepted_request_completes(server, reference):
    """MAX_BATCH run and MAX_WAITING wait; the requests past them get 429 with Retry-After, and every
    accepted one is answered in full, each as the model answers it alone."""
    prompt, n = "class Stack:", 160
    expected = reference.text(reference.ids(prompt), n, ignore_eos=True)
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    url = f"{server}/v1/completions"

    async def read(response: httpx.Response) -> tuple[str, list]:
        events = [line.removeprefix("data: ") async for line in response.aiter_lines() if line]
        chunks = [json.loads(e) for e in events[:-1]]
        return "".join(c["choices"][0]["text"] for c in chunks), [events[-1], chunks[-1]["choices"][0]["finish_reason"]]

    async def burst():
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=16)) as http:
            accepted = await asyncio.gather(*(http.send(http.build_request("POST", url, json=body), stream=True)
                                              for _ in range(MAX_BATCH + MAX_WAITING)))
            full = (await http.get(f"{server}/health")).json()
            refused = [await http.post(url, json={**body, "stream": False}) for _ in range(3)]
            answers = await asyncio.gather(*(read(r) for r in accepted))
            return [r.status_code for r in accepted], full, refused, answers

    statuses, full, refused, answers = asyncio.run(asyncio.wait_for(burst(), REQUEST_TIMEOUT_S))
    assert statuses == [200] * (MAX_BATCH + MAX_WAITING)
    assert full["running"] + full["waiting"] == MAX_BATCH + MAX_WAITING, full  # every place taken
    for r in refused:
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert error_of(r)["type"] == "rate_limit_error" and "the server is full" in error_of(r)["message"]
    assert answers == [(expected, ["[DONE]", "length"])] * (MAX_BATCH + MAX_WAITING)
    assert_still_serving(server, reference)


TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
CHAT = "/v1/chat/completions"
UNSUPPORTED = [  # (endpoint, fields, the field named): OpenAI's fields this server does not implement
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"suffix": "\n"}, "suffix"),
    ("/v1/completions", {"logit_bias": {"5": -100}}, "logit_bias"),
    ("/v1/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    (CHAT, {"functions": [TOOL["function"]]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (CHAT, {"logit_bias": {"5": 1}}, "logit_bias"),
    (CHAT, {"frequency_penalty": -1.0}, "frequency_penalty"),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"reasoning_effort": "low"}, "reasoning_effort"),
    (CHAT, {"verbosity": "low"}, "verbosity"),
    (CHAT, {"web_search_options": {}}, "web_search_options"),
    (CHAT, {"store": True}, "store"),
]
UNRECOGNIZED = [  # not in the API of the endpoint: OpenAI's "Unrecognized request argument"
    ("/v1/completions", {"tools": [TOOL]}, "tools"),
    ("/v1/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/completions", {"temprature": 0.5}, "temprature"),
    (CHAT, {"suffix": "x"}, "suffix"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "cache_control": {}}]}, "messages[0].cache_control"),
]


def request_body(endpoint: str, fields: dict) -> dict:
    base = {"prompt": "import os"} if endpoint != CHAT else {"messages": [{"role": "user", "content": "hi"}]}
    return {**base, "max_tokens": 4, **fields}


@pytest.mark.parametrize("endpoint, fields, param", UNSUPPORTED, ids=[f"{e[-16:]}-{p}" for e, _, p in UNSUPPORTED])
def test_a_field_the_server_does_not_implement_is_a_400_naming_it(server, reference, endpoint, fields, param):
    r = httpx.post(f"{server}{endpoint}", json=request_body(endpoint, fields), timeout=30)
    error = error_of(r)
    assert r.status_code == 400 and error["param"] == param, r.text
    assert error["message"].startswith(f"'{param}' is not supported by this server: "), error
    assert error["code"] == "unsupported_parameter"
    assert_still_serving(server, reference)


def test_a_field_refused_is_quoted_as_it_was_sent(server):
    audio = {"voice": "alloy", "format": "wav"}
    r = httpx.post(f"{server}{CHAT}", json=request_body(CHAT, {"audio": audio}), timeout=30)
    assert error_of(r)["message"].endswith(f"got {json.dumps(audio)}"), r.text


def test_more_choices_than_the_server_holds_at_once_is_a_400_naming_n(server, reference):
    """n past --max-batch + --max-waiting could never be taken whole: not a 429 (try later), a 400."""
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": MAX_BATCH + MAX_WAITING + 1},
                   timeout=30)
    assert r.status_code == 400 and error_of(r)["param"] == "n" and "--max-batch" in error_of(r)["message"], r.text
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": MAX_BATCH + MAX_WAITING},
                   timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_BATCH + MAX_WAITING, r.text
    assert_still_serving(server, reference)


@pytest.mark.parametrize("endpoint, fields, param", UNRECOGNIZED, ids=[f"{e[-16:]}-{p}" for e, _, p in UNRECOGNIZED])
def test_a_field_not_in_the_api_is_a_400_naming_it(server, endpoint, fields, param):
    r = httpx.post(f"{server}{endpoint}", json=request_body(endpoint, fields), timeout=30)
    assert r.status_code == 400, r.text
    assert error_of(r)["message"] == f"Unrecognized request argument supplied: {param}" and \
        error_of(r)["param"] == param


def test_fields_that_ask_for_nothing_or_change_nothing_are_accepted(server, reference):
    """The "off" value of an unimplemented field (n 1, echo false, tools [] ...) and the fields that do
    not change the answer (user) are no reason to refuse: the answer is the model's own."""
    prompt, n = NORMAL
    r = completion(server, prompt, n, n=1, best_of=1, echo=False, logprobs=None, suffix="", logit_bias={},
                   frequency_penalty=0, user="ann")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference.text(reference.ids(prompt), n), r.text
    r = httpx.post(f"{server}{CHAT}", timeout=30, json=request_body(CHAT, {
        "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logprobs": False, "n": 1,
        "modalities": ["text"], "store": False, "user": "ann", "metadata": {"k": "v"}, "parallel_tool_calls": True}))
    assert "has no chat template" in error_of(r)["message"], r.text  # past the fields, to the base model's refusal


def test_a_chat_request_to_a_base_model_gets_a_400_pointing_to_completions(server, reference):
    """The shipped model has no chat template: no plain-text format is guessed for it."""
    r = httpx.post(f"{server}{CHAT}", json=request_body(CHAT, {}), timeout=30)
    assert r.status_code == 400 and error_of(r)["param"] == "messages", r.text
    assert "has no chat template (a base model): use /v1/completions" in error_of(r)["message"]
    assert_still_serving(server, reference)


def damaged_model(tmp_path, name: str, content: bytes | None):
    """The shipped model with one file replaced by content (None: removed)."""
    for file in SHIPPED.iterdir():
        if file.name != name:
            (tmp_path / file.name).symlink_to(file)
    if content is not None:
        (tmp_path / name).write_bytes(content)
    return tmp_path


def half(name: str) -> bytes:
    data = (SHIPPED / name).read_bytes()
    return data[: len(data) // 2]


BAD_TEMPERATURE = json.dumps({**json.loads((SHIPPED / "generation_config.json").read_text()), "temperature": -1})
# (file, its new content, what the one line says after "cannot load DIR: ", DIR/ standing for DIR); a
# directory without config.json is no model at all, a flag's mistake (test_serve_flags.py)
DAMAGED = [
    ("config.json", half("config.json"), "DIR/config.json is not valid JSON: "),
    ("generation_config.json", half("generation_config.json"), "DIR/generation_config.json is not valid JSON: "),
    ("generation_config.json", BAD_TEMPERATURE.encode(),
     "DIR/generation_config.json: temperature must be >= 0 and finite (0 = greedy), got -1"),
    ("tokenizer.json", None, "no tokenizer.json in DIR: "),
    ("tokenizer.json", half("tokenizer.json"), "DIR/tokenizer.json is not valid JSON: "),
    ("tokenizer.json", b'{"version": "1.0"}',
     "DIR/tokenizer.json is not a tokenizer the tokenizers library can read: "),
    ("tokenizer_config.json", half("tokenizer_config.json"), "DIR/tokenizer_config.json is not valid JSON: "),
]


@pytest.mark.parametrize("name, content, says", DAMAGED, ids=[f"{n}-{'gone' if c is None else len(c)}"
                                                              for n, c, _ in DAMAGED])
def test_a_damaged_checkpoint_file_ends_serve_py_with_one_line_naming_it(tmp_path, name, content, says):
    """What serve.py checks in its own process (config.json and generation_config.json before the engine
    starts, the tokenizer while the engine loads): one line naming the file (and the key)."""
    model = damaged_model(tmp_path, name, content)
    serve = load_serve_py()
    args = serve.parse_args(["--model", str(model), "--device", "cpu"])
    with pytest.raises(SystemExit) as exit:
        serve.check_model(args)
        serve.tokenizer_of(args)
    line = exit.value.code
    assert isinstance(line, str) and "\n" not in line
    assert line.startswith(f"serve.py: error: cannot load {model}: {says.replace('DIR', str(model))}"), line


def test_damaged_weights_end_serve_py_with_one_line_naming_the_file(tmp_path):
    """The weights load in the engine process: their error comes back to serve.py as its one line."""
    model = damaged_model(tmp_path, "model.safetensors", half("model.safetensors"))
    serve = load_serve_py()
    args = serve.parse_args(["--model", str(model), "--device", "cpu"])
    engine = serve.start_engine(args, *serve.check_model(args))  # nothing to see before the weights
    with pytest.raises(SystemExit) as exit:
        serve.wait_for_engine(engine, model)
    assert process_gone(engine.pid)
    line = exit.value.code
    assert isinstance(line, str) and "\n" not in line
    assert line.startswith(f"serve.py: error: cannot load {model}: cannot read safetensors file "
                           f"{model / 'model.safetensors'}: "), line


def test_a_damaged_checkpoint_ends_the_real_command_with_one_line_and_status_1(tmp_path):
    model = damaged_model(tmp_path, "generation_config.json", BAD_TEMPERATURE.encode())
    result = subprocess.run([sys.executable, str(SERVE_PY), "--model", str(model), "--port", "0", "--device", "cpu"],
                            capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
    assert (result.returncode, result.stdout) == (1, ""), result.stderr
    assert result.stderr.splitlines() == [f"serve.py: error: cannot load {model}: {model}/generation_config.json: "
                                          "temperature must be >= 0 and finite (0 = greedy), got -1"]


def open_stream(http: httpx.Client, url: str, max_tokens: int):
    """A streamed completion, open, with its first event read: (response, its lines)."""
    response = http.send(http.build_request("POST", f"{url}/v1/completions", json={
        "prompt": "import os", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}),
        stream=True)
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    assert next(line for line in lines if line).startswith("data: {")
    return response, lines


def rest_of(lines) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line]


def test_a_killed_engine_process_ends_every_request_with_its_cause_and_the_server_with_status_1(tmp_path):
    with serving(SHIPPED, tmp_path) as served, httpx.Client(timeout=REQUEST_TIMEOUT_S) as http, \
            ThreadPoolExecutor(2) as pool:
        stream, lines = open_stream(http, served.url, LONG)
        waiting = pool.submit(completion, served.url, "import sys", LONG, ignore_eos=True)
        assert wait_for_health(served.url, lambda h: h["running"] == 2)["running"] == 2
        engine = served.engine_pid()
        os.kill(engine, signal.SIGSTOP)  # so that a /health is waiting for the engine when it dies
        asked = pool.submit(httpx.get, f"{served.url}/health", timeout=REQUEST_TIMEOUT_S)
        time.sleep(1.0)
        os.kill(engine, signal.SIGKILL)
        events = rest_of(lines)
        not_streamed, health_then = waiting.result(REQUEST_TIMEOUT_S), asked.result(REQUEST_TIMEOUT_S)
        status = served.wait(30)
    cause = "the engine process was killed by SIGKILL"
    says = "T" + cause[1:]  # a client's message is a sentence
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"].startswith(says), events[-3:]
    for r in (not_streamed, health_then):
        assert r.status_code == 503 and error_of(r)["message"].startswith(says), r.text
        assert error_of(r)["code"] == "engine_dead" and error_of(r)["type"] == "server_error"
    assert status == 1
    said = served.said()
    assert len(said) == 1 and re.fullmatch(rf"serve\.py: error: {cause}(; the last line of its stderr: .*)?; "
                                           r"the server exits so that its supervisor can restart it", said[0]), said


def refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=5)
    except httpx.ConnectError:
        return True
    return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_server_gracefully(tmp_path, sig):
    """Open requests get --shutdown-timeout to finish: one that does ends as usual, the others end with
    an error their clients read; new connections are refused; the engine process stops; exit 0, one line."""
    with serving(SHIPPED, tmp_path, "--shutdown-timeout", str(GRACE_S)) as served, \
            httpx.Client(timeout=REQUEST_TIMEOUT_S) as http, ThreadPoolExecutor(1) as pool:
        engine = served.engine_pid()
        not_streamed = pool.submit(completion, served.url, "import sys", LONG, ignore_eos=True)
        assert wait_for_health(served.url, lambda h: h["running"] == 1)["running"] == 1
        short, short_lines = open_stream(http, served.url, 24)  # may be done before the signal: 2 or 3 open
        long, long_lines = open_stream(http, served.url, LONG)
        served.signal(sig)
        time.sleep(0.5)
        assert refused(served.url)
        short_events, long_events = rest_of(short_lines), rest_of(long_lines)
        cut = not_streamed.result(REQUEST_TIMEOUT_S)
        status = served.wait(GRACE_S + 15)
    assert short_events[-1] == "[DONE]" and json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
    says = "The server shut down before this request finished"
    assert long_events[-1] == "[DONE]" and json.loads(long_events[-2])["error"]["message"].startswith(says)
    assert cut.status_code == 503 and error_of(cut)["message"].startswith(says), cut.text
    assert status == 0
    name = signal.Signals(sig).name
    said = served.said()
    assert len(said) == 1 and re.fullmatch(rf"serve\.py: {name}: shutting down; [23] open requests get up to "
                                           rf"{GRACE_S} s to finish \(a second {name} stops at once\)", said[0]), said
    assert process_gone(engine)


def test_a_signal_stops_a_server_whose_stderr_is_gone():
    """`serve.py ... 2>&1 | head -1`: once the reader has gone, the shutdown's line has nowhere to
    go; SIGTERM still stops the server (exit 0) and its engine process."""
    cmd = [sys.executable, str(SERVE_PY), "--model", str(SHIPPED), "--host", "127.0.0.1", "--port", "0",
           "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)
    try:
        url = next(m.group(1) for line in proc.stdout if (m := SERVING.match(line.decode())))
        proc.stdout.close()  # the reader leaves
        while refused(url):
            time.sleep(0.1)
        engine = Served(proc, url, None).engine_pid()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert process_gone(engine)
    finally:
        proc.kill()
        proc.wait()


def test_a_second_signal_stops_the_server_at_once(tmp_path):
    with serving(SHIPPED, tmp_path) as served, httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        engine = served.engine_pid()
        stream, lines = open_stream(http, served.url, LONG)  # 30 s of grace: the second signal cuts them short
        served.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not served.said() and time.monotonic() < deadline:
            time.sleep(0.05)
        second = time.monotonic()
        served.signal(signal.SIGTERM)
        status = served.wait(10)
        assert time.monotonic() - second < 5
        with pytest.raises(httpx.HTTPError):  # the connection ends without the stream's end
            rest_of(lines)
    assert status == 128 + signal.SIGTERM
    assert served.said() == [
        "serve.py: SIGTERM: shutting down; 1 open request gets up to 30 s to finish (a second SIGTERM stops at once)",
        "serve.py: second SIGTERM: stopped at once, 1 open request cut off"]
    assert process_gone(engine)


def test_a_signal_while_the_model_loads_stops_serve_py_in_one_line():
    """Ctrl-C once the engine process is loading the model: one line, status 0, no traceback, and the
    engine process ended with it."""
    proc = subprocess.Popen([sys.executable, str(SERVE_PY), "--port", "0", "--device", "cpu"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + 60
    while not (engine := [int(pid) for pid in children.read_text().split()
                          if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out, err) == (0, "", "serve.py: SIGINT while starting: stopped\n")
    assert process_gone(engine[0])


def test_the_shared_server_is_still_healthy(server, reference):
    """After every fault above that it survived."""
    h = health(server)
    assert h["status"] == "ok" and idle(h), h
    assert_still_serving(server, reference)
