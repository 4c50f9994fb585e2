"""Where a checkpoint named on the command line or in from_pretrained is: a directory, or a Hugging
Face repo id resolved through huggingface_hub's cache.

    resolve_checkpoint("weights/qwen3-stdlib-tiny")   # a directory that exists: itself, always
    resolve_checkpoint("Qwen/Qwen3-8B")               # downloaded once into the hub cache, then read there

A repo id goes through `huggingface_hub.snapshot_download`, so the cache, `HF_HOME`,
`HF_HUB_CACHE`, `HF_HUB_OFFLINE`, `HF_TOKEN` and its progress bars are huggingface_hub's own, and
a model downloaded by `hf download` or by transformers is found where they put it. Only the files
the loader and the tokenizer read are fetched (SMALL_FILES, then the weights the index names), and
the weights only once config.json shows a Qwen3 this code runs.
"""

import os
from pathlib import Path

# What qwen3/loader.py and runtime/text.py read besides the weights: the config, the generation
# settings, the tokenizer (tokenizer.json; its config, special and added tokens, chat template) and
# the safetensors index. The weights are the files the index names (or model.safetensors), fetched
# once the config shows a model this code runs: never a repo's other copies (subfolders' checkpoints,
# adapters, original/ formats) nor gigabytes of a model it would refuse.
SMALL_FILES = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
    "special_tokens_map.json", "added_tokens.json", "model.safetensors.index.json",
]


def looks_like_repo_id(name: str) -> bool:
    """Whether `name` can be a Hugging Face repo id ("Qwen/Qwen3-8B", or a bare "gpt2"): one or two
    parts of letters, digits, '-', '_' and '.', not a path that starts at the root, home or here."""
    if name.startswith(("/", "~", "./", "../")) or name.count("/") > 1:
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_checkpoint(name: str | os.PathLike, revision: str | None = None) -> Path:
    """The checkpoint directory that `name` names. A directory that exists always wins over a repo
    id of the same spelling; else `name` is a repo id (at `revision`: a branch, tag or commit;
    default its main branch), found in the hub cache or downloaded into it.

    FileNotFoundError for a path that is no directory and cannot be a repo id; ValueError (one line
    that says what to do) for a repo id that resolves to nothing: no such repo, a revision it lacks,
    a repo not in the cache while offline (HF_HUB_OFFLINE=1, or no connection), or cached only in
    part, a gated or private repo without access, a model this code does not run (its config.json
    says so before any weights come), a revision given with a directory. OSError when a download
    fails."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {path} is a file, not a directory")
        if revision is not None:
            raise ValueError(f"revision {revision!r} names a version of a Hugging Face repo, and {name} is a "
                             "local directory")
        return path
    if not looks_like_repo_id(str(name)):
        raise FileNotFoundError(f"model directory {path} does not exist")
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"revision must be a branch, tag or commit name (a string), got {revision!r}")
    if revision is not None and (not revision.strip() or ".." in revision.split("/")):
        raise ValueError(f"revision {revision!r} is no branch, tag or commit name")
    snapshot = download(str(name), revision, SMALL_FILES)
    from .config import Qwen3Config

    Qwen3Config.from_json(snapshot)  # a model this code refuses is refused before its weights come
    weights = weight_files(snapshot)
    snapshot = download(str(name), revision, SMALL_FILES + weights)
    missing = [f for f in ["config.json", *weights] if not (snapshot / f).is_file()]
    if missing:  # a cache that a download cut short, or a tool that fetched some files only, offline
        raise ValueError(f"the cached Hugging Face model {name} lacks {', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''}: download it again with a connection")
    return snapshot


def weight_files(snapshot: Path) -> list[str]:
    """The safetensors files the loader reads: the shards the index names, else model.safetensors."""
    from .loader import SINGLE_FILE, index_shards

    shards = index_shards(snapshot)
    return sorted(shards) if shards is not None else [SINGLE_FILE]


def download(repo_id: str, revision: str | None, files: list[str]) -> Path:
    """The snapshot directory of repo_id at revision in the hub cache, with `files` (those the repo
    has) fetched first unless they are there. Each way it can fail is one line."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision}" if revision else ""
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=files))
    except LocalEntryNotFoundError:
        why, fix = (("HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE to download it once") if constants.HF_HUB_OFFLINE
                    else ("the Hugging Face hub cannot be reached", "download it once with a connection"))
        raise ValueError(f"no directory {repo_id}, and the Hugging Face model {repo_id}{at} is not in the cache "
                         f"({constants.HF_HUB_CACHE}) while {why}: {fix}, or pass a checkpoint directory") from None
    except GatedRepoError:
        raise ValueError(f"the Hugging Face model {repo_id} is gated: accept its terms on huggingface.co, then log in "
                         "(hf auth login, or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"no directory {repo_id}, and no Hugging Face model {repo_id} (a private one needs a log-in: "
                         "hf auth login, or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ValueError(f"the Hugging Face model {repo_id} has no revision {revision!r}") from None
    except Exception as err:  # HTTP errors, a connection dropped mid-file (httpx), a proxy's refusal, Xet's errors
        raise OSError(f"downloading {repo_id}{at} failed: {type(err).__name__}: {' '.join(str(err).split())}") from None
