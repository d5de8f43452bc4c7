"""A model's config from what the user names: a ``PretrainedConfig``, a local folder or
``config.json``, a short name from the shipped catalogue, or a Hugging Face hub id.

Only ``config.json`` is ever read: no weights. The hub is asked through ``huggingface_hub``
(its cache first, so a cached or offline copy answers without the network).
"""

from __future__ import annotations

import difflib
import json
import os
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import WorkloadError

# the transformers release that added each config class people ask for (its release notes)
_ADDED_IN = {"qwen3": "4.51", "gemma2": "4.42", "phi3": "4.40", "qwen2": "4.37", "mistral": "4.34",
             "llama": "4.28", "gemma3": "4.50", "qwen3_moe": "4.51", "llama4": "4.51"}


class HubError(WorkloadError):
    """A model name, path or config that cannot become a workload (one line, says what to do)."""


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
        raise HubError(f"this transformers ({transformers.__version__}) does not know the config class {model_type!r}{since}: "
                       "upgrade transformers, or give a config of a known model_type")
    return CONFIG_MAPPING[model_type]


def _from_dict(data: dict[str, Any], where: str):
    model_type = data.get("model_type")
    if not model_type:
        raise HubError(f"{where} has no 'model_type': not a Hugging Face config.json")
    fields = {k: v for k, v in data.items() if k not in ("model_type", "transformers_version", "architectures", "auto_map")}
    cfg = config_class(model_type)(**fields)
    if data.get("architectures"):
        cfg.architectures = list(data["architectures"])
    return cfg


def from_catalogue(name: str):
    entry = catalogue()[name.lower()]
    cfg = _from_dict({"model_type": entry["model_type"], **entry["config"]}, f"catalogue entry {name!r}")
    cfg.name_or_path = entry["source"]
    return cfg


def from_file(path: Path):
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise HubError(f"no config.json in {path.parent}: give the folder that holds the model's config.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise HubError(f"cannot read {path}: {exc}") from exc
    cfg = _from_dict(data, str(path))
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
            return from_file(Path(hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=local_only)))
        except HubError:
            raise
        except Exception as exc:  # noqa: BLE001 - every hub failure becomes the one-line error below
            last = exc
    near = closest_names(repo_id)
    hint = f"; or a catalogue name ({', '.join(near)})" if near else ""
    raise HubError(f"cannot get config.json of {repo_id!r} ({type(last).__name__}): no network and no local copy; "
                   f"pass a local folder or config.json path, or a transformers PretrainedConfig{hint}")


def resolve_config(name_or_path_or_config: Any, revision: str | None = None):
    """A ``PretrainedConfig`` (a copy: the caller's object is never changed) from any kind of name."""
    from transformers import PretrainedConfig

    source = name_or_path_or_config
    if isinstance(source, PretrainedConfig):
        return source.__class__.from_dict(source.to_dict())
    if isinstance(source, os.PathLike) or (isinstance(source, str) and (os.path.exists(source) or source.endswith(".json"))):
        return from_file(Path(source))
    if not isinstance(source, str) or not source.strip():
        raise HubError(f"give a model name, a path or a PretrainedConfig, not {type(source).__name__}")
    if source.lower() in catalogue():
        return from_catalogue(source)
    if "/" in source:
        return from_hub(source, revision)
    near = closest_names(source)
    raise HubError(f"unknown model {source!r}; closest catalogue names: {', '.join(near) or 'none'} "
                   "(or give a hub id like 'Qwen/Qwen2.5-7B', a local folder or a config.json)")
