"""The HTTP server end to end: scripts/serve.py started on 127.0.0.1 (a free port, the shipped
model, the CPU) and talked to with the official `openai` client, as a user would.

Every wait is bounded: the server must answer /health within SERVER_START_S, and each request
has a client timeout."""

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from checkpoints import CHAT_TEMPLATE

from qwen3.text import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "weights" / "qwen3-stdlib-tiny"
NAME = "qwen3-stdlib-tiny"
SERVER_START_S = 180  # loading torch + transformers on a busy 2-core machine
REQUEST_TIMEOUT_S = 120
# One OpenMP thread: the model is tiny, and spinning threads on shared cores only slow it down.
ENV = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
MAX_BATCH, MAX_WAITING = 16, 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, log: Path, *args: str):
    port = free_port()
    cmd = [sys.executable, str(ROOT / "scripts" / "serve.py"), "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve.py exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"serve.py did not answer within {SERVER_START_S} s:\n{log.read_text()}")


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, url = start_server(SHIPPED, tmp_path_factory.mktemp("serve") / "server.log", "--max-batch", str(MAX_BATCH),
                             "--max-waiting", str(MAX_WAITING))
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """The shipped model with a Qwen3-style chat template added to its tokenizer."""
    path = tmp_path_factory.mktemp("chat-model")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (path / name).symlink_to(SHIPPED / name)
    tok = load_tokenizer(SHIPPED)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_server(chat_model, tmp_path_factory):
    proc, url = start_server(chat_model, tmp_path_factory.mktemp("serve-chat") / "server.log", "--served-model-name",
                             NAME)
    yield url
    stop_server(proc)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def async_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def wait_until_idle(url: str, timeout_s: float = 60) -> dict:
    """/health once nothing runs or waits and every block is free again (or the last one seen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        h = health(url)
        idle = h["running"] == 0 and h["waiting"] == 0 and h["free_blocks"] == h["total_blocks"]
        if idle or time.monotonic() > deadline:
            return h
        time.sleep(0.2)


def generate_py(model_dir: Path, prompt: str, max_new_tokens: int, *flags: str) -> str:
    """The text scripts/generate.py prints for this prompt, greedy (its trailing newline removed)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate.py"), "--model", str(model_dir), "--prompt", prompt,
         "--max-new-tokens", str(max_new_tokens), "--temperature", "0", "--device", "cpu", *flags],
        capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S, env=ENV, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n")
    return result.stdout[:-1]


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [NAME]
    h = health(server)
    assert h["status"] == "ok" and h["free_blocks"] == h["total_blocks"] > 0


def test_greedy_completion_equals_generate_py_streaming_and_not(server):
    prompt, n = "def fibonacci(n):", 24
    expected = generate_py(SHIPPED, prompt, n, "--no-chat")
    c = client(server)
    done = c.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0)
    assert done.choices[0].text == expected
    prompt_tokens = len(load_tokenizer(SHIPPED)(prompt, add_special_tokens=False)["input_ids"])
    assert done.usage.prompt_tokens == prompt_tokens
    assert done.usage.completion_tokens == n and done.usage.total_tokens == prompt_tokens + n
    assert done.choices[0].finish_reason == "length"

    chunks = list(c.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert len(chunks) > 3 and chunks[-1].usage.completion_tokens == n  # streamed in pieces, usage last


def test_raw_stream_is_openai_sse_ending_with_done(server):
    with httpx.stream("POST", f"{server}/v1/completions", timeout=REQUEST_TIMEOUT_S,
                      json={"prompt": "import os", "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert '"object": "text_completion"' in events[0]


def test_chat_streaming_and_not_equal_generate_py(chat_server, chat_model):
    """Through the tokenizer's chat template, with enable_thinking off as vLLM takes it
    (chat_template_kwargs): the text generate.py --chat --no-thinking prints."""
    prompt, n = "Write a loop", 16
    expected = generate_py(chat_model, prompt, n, "--chat", "--no-thinking")
    c = client(chat_server)
    messages = [{"role": "user", "content": prompt}]
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    done = c.chat.completions.create(model=NAME, messages=messages, max_tokens=n, temperature=0, extra_body=extra)
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == expected
    assert done.usage.completion_tokens <= n
    stream = c.chat.completions.create(model=NAME, messages=messages, max_tokens=n, temperature=0, stream=True,
                                       extra_body=extra)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    thinking = c.chat.completions.create(model=NAME, messages=messages, max_tokens=n, temperature=0)
    assert thinking.usage.prompt_tokens < done.usage.prompt_tokens  # no pre-filled empty think block


def test_16_concurrent_streams_each_equal_the_request_alone(server):
    prompts = [f"def f{i}(x):\n    return" + " x +" * i for i in range(16)]
    max_tokens = [4 + 2 * i for i in range(16)]
    c = client(server)
    alone = [c.completions.create(model=NAME, prompt=p, max_tokens=m, temperature=0).choices[0].text
             for p, m in zip(prompts, max_tokens)]

    async def streamed(ac, prompt, n):
        stream = await ac.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream])

    async def all_at_once():
        ac = async_client(server)
        try:
            return await asyncio.gather(*(streamed(ac, p, m) for p, m in zip(prompts, max_tokens)))
        finally:
            await ac.close()

    together = asyncio.run(asyncio.wait_for(all_at_once(), REQUEST_TIMEOUT_S))
    assert together == alone
    h = wait_until_idle(server)
    assert h["free_blocks"] == h["total_blocks"]
    assert h["peak_running"] >= 8  # they were decoded together, not one after another


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    c = client(server)
    stream = c.completions.create(model=NAME, prompt="class Parser:", max_tokens=900, temperature=0, stream=True)
    pieces = [next(stream).choices[0].text for _ in range(3)]
    assert health(server)["running"] == 1 and health(server)["free_blocks"] < health(server)["total_blocks"]
    stream.close()
    h = wait_until_idle(server, timeout_s=30)
    assert h["running"] == 0 and h["free_blocks"] == h["total_blocks"], h
    assert len(pieces) == 3


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def test_bad_requests_get_openai_errors(server):
    url = f"{server}/v1/completions"
    r = httpx.post(url, content=b'{"prompt": "x", ', headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "Malformed JSON" in error_of(r)["message"]
    r = httpx.post(url, json={"prompt": "x", "temperature": "hot"}, timeout=30)
    assert r.status_code == 400 and error_of(r)["param"] == "temperature"
    r = httpx.post(url, json={"prompt": 42}, timeout=30)
    assert r.status_code == 400 and error_of(r)["param"].startswith("prompt")
    r = httpx.post(url, json=["not", "an", "object"], timeout=30)
    assert r.status_code == 400 and "JSON object" in error_of(r)["message"]
    # each refusal names the field it is about
    for body, param in (({"prompt": "x", "seed": -1}, "seed"), ({"prompt": ""}, "prompt"),
                        ({"prompt": [99999]}, "prompt"), ({"prompt": "x", "temperature": -1}, "temperature"),
                        ({"prompt": "x", "top_p": 2}, "top_p")):
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400 and error_of(r)["param"] == param, (body, r.text)

    c = client(server)
    with pytest.raises(openai.BadRequestError) as err:  # prompt + max_tokens over the context
        c.completions.create(model=NAME, prompt=[5] * 1000, max_tokens=100)
    assert err.value.status_code == 400
    assert "maximum context length is 1024 tokens" in str(err.value) and "1100 tokens" in str(err.value)
    assert "1000 in the prompt" in str(err.value)
    with pytest.raises(openai.NotFoundError) as err:
        c.completions.create(model="gpt-5", prompt="x", max_tokens=2)
    assert err.value.status_code == 404 and "gpt-5" in str(err.value)
    with pytest.raises(openai.BadRequestError, match="Only n=1"):
        c.completions.create(model=NAME, prompt="x", max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="temperature must be >= 0"):
        c.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="has no chat template"):
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert c.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=0).usage.completion_tokens >= 1


def test_an_unknown_path_or_method_gets_an_openai_error(server):
    """Not FastAPI's {"detail": "Not Found"}: the error shape of every other refusal, naming what was asked."""
    r = httpx.post(f"{server}/v1/complete", json={"prompt": "x"}, timeout=30)
    error = error_of(r)
    assert r.status_code == 404 and error["type"] == "invalid_request_error", r.text
    assert "POST /v1/complete)" in error["message"] and "POST /v1/completions" in error["message"], error
    r = httpx.get(f"{server}/v1/completions", timeout=30)
    error = error_of(r)
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
    assert "GET /v1/completions" in error["message"] and "takes POST" in error["message"], error
    with pytest.raises(openai.NotFoundError, match=r"Invalid URL \(POST /v1/embeddings\)"):  # what the client says
        client(server).embeddings.create(model=NAME, input="x")


def test_past_the_queue_bound_requests_get_429_and_the_rest_are_served(server):
    """MAX_BATCH run, MAX_WAITING wait, the rest are refused with 429; closing every stream
    cancels the accepted ones (waiting ones included) and the cache comes back full."""
    n = MAX_BATCH + MAX_WAITING + 4
    body = {"model": NAME, "prompt": "import sys", "max_tokens": 600, "temperature": 0, "stream": True}

    async def flood():
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=2 * n)) as http:
            responses = await asyncio.gather(*(
                http.send(http.build_request("POST", f"{server}/v1/completions", json=body), stream=True)
                for _ in range(n)))
            statuses = [r.status_code for r in responses]
            refused = [r for r in responses if r.status_code == 429]
            errors = [error_of(httpx.Response(429, content=await r.aread())) for r in refused]
            for r in responses:
                await r.aclose()
            return statuses, errors

    statuses, errors = asyncio.run(asyncio.wait_for(flood(), REQUEST_TIMEOUT_S))
    assert statuses.count(200) == MAX_BATCH + MAX_WAITING and statuses.count(429) == n - MAX_BATCH - MAX_WAITING
    assert all("already waiting" in e["message"] and e["type"] == "rate_limit_error" for e in errors)
    h = wait_until_idle(server, timeout_s=60)
    assert h["running"] == 0 and h["waiting"] == 0 and h["free_blocks"] == h["total_blocks"], h
    after = client(server).completions.create(model=NAME, prompt="import sys", max_tokens=3, temperature=0)
    assert after.choices[0].finish_reason in ("length", "stop")


def test_outputs_arriving_faster_than_the_loop_takes_them_merge_into_one_chunk():
    """The engine's thread appends outputs; the event loop, woken once for the burst, takes
    everything since its last look as one output (text and tokens joined in order, the last
    one's finish reason and counts), so a stream under load sends fewer, fuller chunks."""
    from qwen3.engine import Output
    from qwen3.server import Outbox, Outputs

    async def main():
        outbox = Outbox(asyncio.get_running_loop())
        outputs = Outputs(outbox)
        pieces = [Output("a", [1], None, 3, 1), Output("bc", [2], None, 3, 2), Output("", [3], "length", 3, 3)]
        thread = asyncio.to_thread(lambda: [outputs.put(out) for out in pieces])
        await thread
        merged = await asyncio.wait_for(outputs.take(), timeout=5)
        assert (merged.text, merged.token_ids, merged.finish_reason, merged.completion_tokens) == (
            "abc", [1, 2, 3], "length", 3)
        assert not outputs.items
        later = Output("d", [4], None, 3, 4)
        await asyncio.to_thread(outputs.put, later)
        assert await asyncio.wait_for(outputs.take(), timeout=5) == later  # one output: itself

    asyncio.run(main())


def test_a_directory_without_a_checkpoint_ends_serve_py_with_one_line(tmp_path):
    """The model loads in the engine's process: its error still reaches the user as one line."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((SHIPPED / name).read_bytes())
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve.py"), "--model", str(tmp_path),
                             "--port", str(free_port())], capture_output=True, text=True, timeout=SERVER_START_S,
                            env=ENV, cwd=ROOT)
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.splitlines() == [f"serve.py: error: cannot load {tmp_path}: no config.json at "
                                          f"{tmp_path / 'config.json'}"]


@pytest.mark.parametrize("flags, message", [
    (["--device", "tpu"], "serve.py: error: --device: unknown device 'tpu'; expected 'cpu', 'cuda' or 'cuda:N'"),
    (["--num-blocks", "0"], "serve.py: error: --num-blocks must be >= 1, got 0 (see --help)"),
])
def test_a_bad_flag_ends_serve_py_with_one_line(flags, message):
    """A user's mistake in a flag: one line naming it, before anything loads, and no server."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve.py"), "--port", str(free_port()), *flags],
                            capture_output=True, text=True, timeout=SERVER_START_S, env=ENV, cwd=ROOT)
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.splitlines() == [message]


def test_a_port_in_use_ends_serve_py_with_one_line():
    """Another program listens on the port: one line that says so, and no "serving" line before it."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        result = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve.py"), "--port", str(port),
                                 "--device", "cpu"], capture_output=True, text=True, timeout=SERVER_START_S,
                                env=ENV, cwd=ROOT)
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.splitlines() == [f"serve.py: error: port {port} on 127.0.0.1 is in use; "
                                          "pick another with --port"]
