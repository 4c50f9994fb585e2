"""--model and from_pretrained take a Hugging Face repo id besides a directory (qwen3/hub.py): tested
offline, on a hub cache laid out on disk from a test checkpoint (nothing is downloaded)."""

import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from checkpoints import hf_model, hub_cache, save, save_tokenizer
from servers import load_serve_py

from qwen3 import Qwen3ForCausalLM
from qwen3.hub import looks_like_repo_id, resolve_checkpoint

ROOT = Path(__file__).resolve().parent.parent
REPO = "tester/qwen3-tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hub-model")
    save(hf_model(seed=5), path)
    return save_tokenizer(path)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch, model_dir):
    """A hub cache holding REPO (at main and at tag v1), read as HF_HUB_OFFLINE=1 reads it: huggingface_hub
    looks these up when it is called, so they stand for the environment a user sets."""
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, REPO, model_dir, revisions=("main", "v1"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_a_repo_id_loads_the_same_model_as_its_directory(offline_cache, model_dir):
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    from_hub = Qwen3ForCausalLM.from_pretrained(REPO, progress=False)
    from_dir = Qwen3ForCausalLM.from_pretrained(model_dir, progress=False)
    with torch.no_grad():
        assert torch.equal(from_hub(ids), from_dir(ids))
    assert resolve_checkpoint(REPO) == resolve_checkpoint(REPO, revision="v1") == offline_cache


def test_generate_py_with_a_repo_id_prints_what_the_directory_gives(offline_cache, model_dir, run_cli):
    args = ("--prompt", "def add(a, b):", "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu")
    from_hub, from_dir = run_cli("--model", REPO, *args), run_cli("--model", str(model_dir), *args)
    assert from_hub.returncode == 0, from_hub.stderr
    assert from_hub.stdout == from_dir.stdout and from_hub.stdout.strip()


def test_a_directory_wins_over_a_repo_id_spelled_the_same(offline_cache, tmp_path, monkeypatch):
    local = tmp_path / "here" / REPO
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "here")
    assert resolve_checkpoint(REPO) == Path(REPO)


def test_what_resolves_to_nothing_is_one_line_that_says_what_to_do(offline_cache, tmp_path):
    with pytest.raises(ValueError, match=r"tester/absent is not in the cache \(.*\) while HF_HUB_OFFLINE is set: "
                                         "unset HF_HUB_OFFLINE to download it once, or pass a checkpoint directory"):
        resolve_checkpoint("tester/absent")
    with pytest.raises(ValueError, match=f"{REPO} at revision v2 is not in the cache"):
        resolve_checkpoint(REPO, revision="v2")
    with pytest.raises(ValueError, match="revision 'main' names a version of a Hugging Face repo, and .* is a local"):
        resolve_checkpoint(offline_cache, revision="main")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nowhere")  # a path, never a repo id
    with pytest.raises(TypeError, match="revision must be a branch, tag or commit name"):
        resolve_checkpoint(REPO, revision=1)


def test_a_sharded_repo_resolves_to_the_shards_its_index_names_and_a_partial_cache_is_one_line(
        tmp_path, monkeypatch, model_dir):
    sharded = save(hf_model(seed=5), tmp_path / "sharded", max_shard_size="100KB")
    save_tokenizer(sharded)
    snapshot = hub_cache(tmp_path / "hub", "tester/sharded", sharded)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    ids = torch.tensor([[3, 14, 15]])
    with torch.no_grad():
        assert torch.equal(Qwen3ForCausalLM.from_pretrained("tester/sharded", progress=False)(ids),
                           Qwen3ForCausalLM.from_pretrained(model_dir, progress=False)(ids))
    shard = sorted(snapshot.glob("model-*.safetensors"))[1]
    shard.unlink()  # a download cut short
    with pytest.raises(ValueError, match=f"the cached Hugging Face model tester/sharded lacks {shard.name}: "
                                         "download it again with a connection"):
        resolve_checkpoint("tester/sharded")


def test_a_model_this_code_does_not_run_is_refused_by_its_config_before_its_weights(tmp_path, monkeypatch):
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    hub_cache(tmp_path / "hub", "tester/llama", other)  # its config alone: no weights were ever needed
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="unsupported model: architectures=\\['LlamaForCausalLM'\\]"):
        resolve_checkpoint("tester/llama")


@pytest.mark.parametrize("name, is_id", [
    ("Qwen/Qwen3-8B", True), ("gpt2", True), ("org/name.v2_x", True),
    ("/abs/dir", False), ("./rel", False), ("../up", False), ("~/home", False), ("a/b/c", False),
    ("bad--name/x", False), ("org/", False),
])
def test_which_names_can_be_repo_ids(name, is_id):
    assert looks_like_repo_id(name) is is_id


def test_serve_py_resolves_a_repo_id_and_serves_it_under_that_name(offline_cache):
    serve = load_serve_py()
    args = serve.parse_args(["--model", REPO, "--device", "cpu"])
    serve.check_model(args)
    assert args.checkpoint == offline_cache
    assert serve.served_name(args.model, args.checkpoint) == REPO
    args = serve.parse_args(["--model", "tester/absent", "--device", "cpu"])
    with pytest.raises(SystemExit) as exit:
        serve.check_model(args)
    assert exit.value.code == 2


def test_an_uncached_repo_id_offline_ends_the_command_with_one_line_and_status_2(tmp_path):
    """As a user runs it: HF_HUB_OFFLINE=1 and HF_HOME in the environment, the real command."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--model", "tester/absent",
                             "--prompt", "x"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "generate.py: error: --model: no directory tester/absent, and the Hugging Face model tester/absent is not in "
        f"the cache ({tmp_path / 'hf' / 'hub'}) while HF_HUB_OFFLINE is set: unset HF_HUB_OFFLINE to download it "
        "once, or pass a checkpoint directory (see --help)"]
