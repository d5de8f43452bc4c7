"""A model's config from what the user names: a ``PretrainedConfig``, a local folder or
``config.json``, a short name from the shipped catalogue, or a Hugging Face hub id.

Only ``config.json`` is ever read: no weights, no code. The hub is asked through ``huggingface_hub``
(its cache first, so a cached or offline copy answers without the network). A config file is read
only if it is a regular file of at most :data:`MAX_CONFIG_BYTES` (a FIFO would hang, a link to
``/dev/zero`` would fill memory); the keys that choose code (``attn_implementation``, ``auto_map``,
...) are dropped, and every failure is one :class:`HubError` line that quotes at most a short
piece of what it read.
"""

from __future__ import annotations

import difflib
import json
import os
import stat
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import WorkloadError

# the transformers release that added each config class people ask for (its release notes)
_ADDED_IN = {
    "qwen3": "4.51",
    "gemma2": "4.42",
    "phi3": "4.40",
    "qwen2": "4.37",
    "mistral": "4.34",
    "llama": "4.28",
    "gemma3": "4.50",
    "qwen3_moe": "4.51",
    "llama4": "4.51",
}


MAX_CONFIG_BYTES = 4 * 2**20  # the largest config.json we read; real ones are a few kB (ImageNet labels: ~70 kB)
# keys a config.json may hold that choose code or kernels, not sizes: never taken from a file
CODE_KEYS = frozenset(
    {
        "model_type",
        "transformers_version",
        "architectures",
        "auto_map",
        "attn_implementation",
        "_attn_implementation",
        "_attn_implementation_internal",
        "experts_implementation",
        "_experts_implementation",
        "_experts_implementation_internal",
        "use_kernels",
        "kernel_config",
        "quantization_config",
        "trust_remote_code",
    }
)


class HubError(WorkloadError):
    """A model name, path or config that cannot become a workload (one line, says what to do)."""


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` on one line and at most ``limit`` characters: hostile values are quoted in part."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails is still named
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reason(exc: BaseException, limit: int = 90) -> str:
    """The first line of an exception's message, shortened (library messages quote values whole)."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@lru_cache(maxsize=1)
def catalogue() -> dict[str, dict[str, Any]]:
    """The offline catalogue: ``{short name: {"source", "model_type", "config"}}``."""
    text = resources.files(__package__).joinpath("catalogue.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def catalogue_names() -> list[str]:
    return sorted(catalogue())


def closest_names(name: str, n: int = 3) -> list[str]:
    """Catalogue names nearest to ``name`` (by spelling), for the unknown-name error."""
    key = name.lower().split("/")[-1]
    names = catalogue_names()
    found = difflib.get_close_matches(key, names, n=n, cutoff=0.4)
    return found or [k for k in names if k.split("-")[0] in key][:n]


def config_class(model_type: str):
    """The ``PretrainedConfig`` subclass of ``model_type``; a type this transformers lacks is a one-line error."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        added = _ADDED_IN.get(model_type)
        since = f" (added in transformers {added})" if added else ""
        raise HubError(
            f"this transformers ({transformers.__version__}) does not know the config class {short(model_type, 40)}{since}: "
            "upgrade transformers, or give a config of a known model_type"
        )
    return CONFIG_MAPPING[model_type]


def _from_dict(data: Any, where: str):
    if not isinstance(data, dict):
        raise HubError(f"{where} holds a JSON {type(data).__name__}, not an object: not a Hugging Face config.json")
    model_type = data.get("model_type")
    if not model_type:
        raise HubError(f"{where} has no 'model_type': not a Hugging Face config.json")
    if not isinstance(model_type, str) or len(model_type) > 100:
        raise HubError(f"{where}: 'model_type' must be a short string, got {short(model_type, 40)}")
    cls = config_class(model_type)
    fields = {k: v for k, v in data.items() if k not in CODE_KEYS and not k.startswith("_")}
    try:
        cfg = cls(**fields)
    except Exception as exc:  # noqa: BLE001 - a config class's checks raise anything; the user gets one line
        raise HubError(f"{where}: not a valid {model_type} config ({type(exc).__name__}: {reason(exc)})") from exc
    archs = data.get("architectures")
    if isinstance(archs, list) and all(isinstance(a, str) for a in archs):
        cfg.architectures = [a[:100] for a in archs[:8]]
    return cfg


def from_catalogue(name: str):
    entry = catalogue()[name.lower()]
    cfg = _from_dict({"model_type": entry["model_type"], **entry["config"]}, f"catalogue entry {name!r}")
    cfg.name_or_path = entry["source"]
    return cfg


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()  # follows links: a link to /dev/zero is a character device
    except (OSError, ValueError):
        return None


def read_json(path: Path) -> Any:
    """The JSON in ``path``: a regular file of at most :data:`MAX_CONFIG_BYTES`, UTF-8; else one line."""
    where = short(str(path), 80)
    info = _stat(path)
    if info is None or not stat.S_ISREG(info.st_mode):
        raise HubError(f"{where} is not a regular file: give a config.json file or the folder that holds it")
    if info.st_size > MAX_CONFIG_BYTES:
        raise HubError(f"{where} is {info.st_size:,} bytes; a config.json is read up to {MAX_CONFIG_BYTES:,}")
    try:
        # non-blocking, and checked again on the open file: a path swapped for a FIFO after the stat cannot hang us
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise HubError(f"{where} is not a regular file: give a config.json file or the folder that holds it")
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise HubError(f"{where} is over {MAX_CONFIG_BYTES:,} bytes: the limit of a config.json")
        return json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        if isinstance(exc, HubError):
            raise
        raise HubError(f"cannot read {where} as JSON ({type(exc).__name__}: {reason(exc)})") from exc


def from_file(path: Path):
    info = _stat(path)
    path = path / "config.json" if info is not None and stat.S_ISDIR(info.st_mode) else path
    if _stat(path) is None:
        raise HubError(f"no config.json at {short(str(path), 80)}: give the folder that holds the model's config.json")
    cfg = _from_dict(read_json(path), short(str(path), 80))
    cfg.name_or_path = str(path.parent)
    return cfg


def from_hub(repo_id: str, revision: str | None = None):
    """``config.json`` of a hub repository: from the local cache first, then the network."""
    from huggingface_hub import hf_hub_download

    last: Exception | None = None
    for local_only in (True, False):
        if not local_only and os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
            break
        try:
            return from_file(
                Path(hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=local_only))
            )
        except HubError:
            raise
        except Exception as exc:  # noqa: BLE001 - every hub failure becomes the one-line error below
            last = exc
    near = closest_names(repo_id[:100])
    hint = f"; or a catalogue name ({', '.join(near)})" if near else ""
    raise HubError(
        f"cannot get config.json of {short(repo_id, 50)} ({type(last).__name__}): no network and no local copy; "
        f"pass a local folder or config.json path, or a transformers PretrainedConfig{hint}"
    )


def _exists(path: str) -> bool:
    try:
        return os.path.lexists(path)
    except (OSError, ValueError):
        return False


def resolve_config(name_or_path_or_config: Any, revision: str | None = None):
    """A ``PretrainedConfig`` (a copy: the caller's object is never changed) from any kind of name."""
    from transformers import PretrainedConfig

    source = name_or_path_or_config
    if isinstance(source, PretrainedConfig):
        return source.__class__.from_dict(source.to_dict())
    if revision is not None and (not isinstance(revision, str) or not revision or len(revision) > 256):
        raise HubError(f"revision must be a branch, tag or commit name, got {short(revision, 40)}")
    if isinstance(source, os.PathLike) or (isinstance(source, str) and (_exists(source) or source.endswith(".json"))):
        try:
            return from_file(Path(source))
        except TypeError as exc:  # a PathLike whose __fspath__ is not a path
            raise HubError(f"cannot use {short(source, 40)} as a path: {reason(exc)}") from exc
    if not isinstance(source, str) or not source.strip():
        raise HubError(f"give a model name, a path or a PretrainedConfig, not {type(source).__name__}")
    if "\x00" in source or len(source) > 1000:
        raise HubError(f"not a model name or path: {short(source, 40)} (too long, or holds a NUL)")
    if source.lower() in catalogue():
        return from_catalogue(source)
    if "/" in source:
        return from_hub(source, revision)
    near = closest_names(source[:100])
    raise HubError(
        f"unknown model {short(source, 50)}; closest catalogue names: {', '.join(near) or 'none'} "
        "(or give a hub id like 'Qwen/Qwen2.5-7B', a local folder or a config.json)"
    )
