"""Seeded transformers Qwen3 models and their saved checkpoints: the references of the model tests.
Nothing is downloaded: every checkpoint is built here and written with save_pretrained."""

from pathlib import Path

import torch
import transformers

SMALL = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def hf_config(**overrides) -> transformers.Qwen3Config:
    config = transformers.Qwen3Config(**{**SMALL, **overrides})
    config._attn_implementation = "eager"  # the reference: plain matmul + softmax attention
    return config


def spread_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Weights large enough that every layer matters: projections ~N(0, 0.08), norm weights
    ~1 + N(0, 0.2) (HF's init leaves them all ones, which would hide a norm applied with the
    wrong weight; in a MoE, the router's logits then spread tokens over different experts)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.08)
    return model


def hf_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> transformers.Qwen3ForCausalLM:
    """A seeded transformers Qwen3 with spread weights."""
    torch.manual_seed(seed)
    return spread_weights(transformers.Qwen3ForCausalLM(hf_config(**overrides))).to(dtype).eval()


def prompts(lengths: list[int], vocab: int, seed: int = 0, low: int = 1) -> list[list[int]]:
    """Seeded random prompts of these lengths, token ids in [low, vocab) (0 is the test models' pad)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=gen).tolist() for n in lengths]


def save(model: transformers.PreTrainedModel, directory: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


# A Qwen3-style chat template (ChatML turns; enable_thinking=False pre-fills an empty think block).
CHAT_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
    "for i in range(10):\n    print(i * i)\n",
    "Hello, wörld! Grüße — naïve café, 你好, emoji 🙂\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 20


def save_tokenizer(directory: Path, vocab_size: int = SMALL["vocab_size"], chat: bool = True) -> Path:
    """A byte-level BPE trained here with `tokenizers`, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    if chat:
        wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(directory)
    return directory


def hub_cache(cache: Path, repo_id: str, checkpoint: Path, revisions: tuple[str, ...] = ("main",)) -> Path:
    """checkpoint's files laid out as huggingface_hub's cache holds a download of repo_id
    (models--ORG--NAME/refs/REVISION naming a commit, snapshots/COMMIT/ with the files), as if
    fetched at each of `revisions`; returns the snapshot directory."""
    import hashlib
    import shutil

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()  # any 40 hex digits: what refs/main names
    snapshot = repo / "snapshots" / commit
    shutil.copytree(checkpoint, snapshot, symlinks=False)
    (repo / "refs").mkdir()
    for revision in revisions:
        (repo / "refs" / revision).write_text(commit)
    return snapshot
