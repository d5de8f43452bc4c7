"""Models by name: a Hugging Face model as a :class:`~memsave_nb.workload.Workload` from a hub id,
a local folder or ``config.json``, a ``PretrainedConfig`` or a name from the offline catalogue.

Built from the config alone on the meta device (measure with ``mode="fake"``), with a synthetic
batch, LoRA (peft) and QLoRA (bitsandbytes' storage layout, :mod:`.quant`). Knows nothing of plans
or the UI. See docs/hub.md.
"""

from __future__ import annotations

from .configs import HubError, catalogue, catalogue_names, closest_names, resolve_config
from .load import TASKS, SyntheticBatch, from_pretrained, parse_dtype, pick_task
from .lora import lora_config, parse_lora
from .quant import QuantLinear, quantize_linears

__all__ = [
    "from_pretrained",
    "parse_lora",
    "lora_config",
    "resolve_config",
    "catalogue",
    "catalogue_names",
    "closest_names",
    "HubError",
    "TASKS",
    "SyntheticBatch",
    "pick_task",
    "parse_dtype",
    "QuantLinear",
    "quantize_linears",
]
