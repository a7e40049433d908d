"""Where `--model` points: a local model directory, or a Hugging Face repo id.

A repo id (`mlx-community/Llama-3.2-1B-Instruct-4bit`) is resolved as mlx-lm resolves it, through
`huggingface_hub.snapshot_download` with mlx-lm's own file patterns: the local Hugging Face cache
first (no network at all when the snapshot is there), then a download when the hub is reachable.
`HF_HOME`, `HF_HUB_CACHE`, `HF_HUB_OFFLINE` and `HF_TOKEN` work as they do for mlx-lm. Every
failure becomes one line for the command line, never a traceback. This is an adapter: it may
import anything, and nothing in `statecore` or `effects` imports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# mlx-lm's DEFAULT_ALLOW_PATTERNS (mlx_lm.utils): what loading a model reads, nothing more. Kept
# here, not imported, so that resolving a name does not import mlx (the router never loads it).
MODEL_FILE_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)


class ModelNotFound(Exception):
    """`--model` names neither a directory nor a repo this machine has or can download."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved `--model`: the directory to load, and the name to serve it under (the repo
    id for a hub model; None: the directory's own name, as before)."""

    directory: Path
    served_name: str | None = None


_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


def looks_like_repo_id(given: str) -> bool:
    """`owner/name` in the characters the hub allows (`./m`, `/m/x` or `a/b/c` are paths)."""
    return bool(_REPO_ID.fullmatch(given)) and ".." not in given and "--" not in given


def resolve_model(given: str | Path, *, cache_dir: Path | None = None) -> ModelSource:
    """The directory `given` names: itself when it is one, else the snapshot of the Hugging Face
    repo `given` (from the cache, else downloaded). Raises ModelNotFound with the reason."""
    path = Path(given).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{given} is a directory but not a model: it has no config.json "
                                "(give an mlx-lm model directory: config.json, model*.safetensors and the "
                                "tokenizer's files; or a Hugging Face repo id such as "
                                "mlx-community/Qwen3-0.6B-4bit)")
        return ModelSource(path)
    text = str(given)
    if not looks_like_repo_id(text):
        raise ModelNotFound(f"model directory {text} does not exist (and it is not a Hugging Face "
                            "repo id such as mlx-community/Qwen3-0.6B-4bit)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = list(MODEL_FILE_PATTERNS)
    try:
        found = snapshot_download(text, allow_patterns=patterns, cache_dir=cache_dir,
                                  local_files_only=True)
        return ModelSource(Path(found), served_name=text)
    except LocalEntryNotFoundError:
        pass  # not cached: download it
    except Exception as exc:  # a damaged cache entry: say so rather than download over it
        raise ModelNotFound(f"{text}: the cached snapshot cannot be used: {exc}") from exc
    try:
        found = snapshot_download(text, allow_patterns=patterns, cache_dir=cache_dir)
    except LocalEntryNotFoundError as exc:  # offline (HF_HUB_OFFLINE, or no connection)
        raise ModelNotFound(f"{text} is not in the Hugging Face cache and cannot be downloaded "
                            f"now (offline): {_first_line(exc)}") from exc
    except Exception as exc:  # unknown repo, gated, no permission, network error, disk full
        raise ModelNotFound(f"cannot download {text} from the Hugging Face hub: "
                            f"{_first_line(exc)}") from exc
    return ModelSource(Path(found), served_name=text)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = ["MODEL_FILE_PATTERNS", "ModelNotFound", "ModelSource", "looks_like_repo_id", "resolve_model"]
