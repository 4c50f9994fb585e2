"""The installed commands (pyproject's [project.scripts]: qwen3-generate, qwen3-chat, qwen3-serve) as a
user gets them from `pip install .`: the package built and installed by pip into a fresh venv, each
command run from outside the checkout. The fresh venv sees this environment's packages through a .pth
file (torch and the rest: nothing is downloaded), after its own, so that what it imports of this
project is the installed copy (checked)."""

import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest
from checkpoints import hf_model, save, save_tokenizer
from servers import ENV, REQUEST_TIMEOUT_S, start_server

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ["pyproject.toml", "README.md", "ops", "qwen3", "runtime", "serve", "cli"]  # what `pip install .` reads


@pytest.fixture(scope="module")
def venv_bin(tmp_path_factory) -> Path:
    """The bin/ of a fresh venv with this project installed by pip from a copy of its source."""
    import shutil

    tmp = tmp_path_factory.mktemp("commands")
    (tmp / "src").mkdir()
    for name in PACKAGE:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, tmp / "src" / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, tmp / "src" / name)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp / "venv"], check=True)
    venv_python = tmp / "venv" / "bin" / "python"
    site = subprocess.run([venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", venv_python, "install", "--no-deps",
                              "--no-build-isolation", "--no-index", "-q", tmp / "src"], capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    return tmp / "venv" / "bin"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("commands-model")
    save(hf_model(seed=21), path)
    return save_tokenizer(path)


def run(command: list, cwd: Path, stdin: str = "") -> subprocess.CompletedProcess:
    """command's run from cwd, with PYTHONPATH's entries that point into the checkout left out (a
    checkout on the path would shadow the installed copy; other entries, packages, stay)."""
    paths = [p for p in ENV.get("PYTHONPATH", "").split(os.pathsep) if p and not Path(p).resolve().is_relative_to(ROOT)]
    env = {**ENV, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=cwd, input=stdin)


def test_the_commands_run_the_installed_copy(venv_bin, tmp_path):
    where = run([venv_bin / "python", "-c", "import cli, qwen3; print(cli.__file__); print(qwen3.__file__)"], tmp_path)
    assert where.returncode == 0, where.stderr
    for line in where.stdout.splitlines():
        assert Path(line).is_relative_to(venv_bin.parent), line


def test_qwen3_generate_and_qwen3_chat_print_what_scripts_generate_py_prints(venv_bin, model_dir, run_cli, tmp_path):
    args = ["--model", str(model_dir), "--prompt", "def add(a, b):", "--temperature", "0", "--max-new-tokens", "12",
            "--device", "cpu"]
    installed, script = run([venv_bin / "qwen3-generate", *args], tmp_path), run_cli(*args)
    assert installed.returncode == 0, installed.stderr
    assert installed.stdout == script.stdout and installed.stdout.strip()
    chat_args = [a for a in args if a not in ("--prompt", "def add(a, b):")]
    chat = run([venv_bin / "qwen3-chat", *chat_args], tmp_path, stdin="def add(a, b):\n")  # one turn, piped
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == installed.stdout  # the same prompt through the same chat template


def test_each_command_names_itself_and_asks_for_a_model_outside_a_checkout(venv_bin, tmp_path):
    """Installed from a wheel, the shipped model (weights/, in the checkout) is not there: one line."""
    result = run([venv_bin / "qwen3-generate", "--prompt", "x"], tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("qwen3-generate: error: no --model given, and the shipped model "
                             "(weights/qwen3-stdlib-tiny) is only in a checkout of the repository: pass --model DIR, "
                             "or a Hugging Face repo id such as Qwen/Qwen3-0.6B (see --help)\n")
    for command in ("qwen3-generate", "qwen3-chat", "qwen3-serve"):
        result = run([venv_bin / command, "--help"], tmp_path)
        assert result.returncode == 0 and result.stdout.startswith(f"usage: {command} "), result.stdout[:200]


def test_qwen3_serve_serves_and_stops_on_ctrl_c(venv_bin, model_dir, tmp_path):
    served = start_server(model_dir, tmp_path / "server.log", command=(str(venv_bin / "qwen3-serve"),), cwd=tmp_path)
    try:
        r = httpx.post(f"{served.url}/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 4,
                                                              "temperature": 0}, timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        served.signal(signal.SIGINT)
        assert served.wait(60) == 0
        assert served.said()[-1].startswith("qwen3-serve: SIGINT"), served.said()
    finally:
        served.stop()
