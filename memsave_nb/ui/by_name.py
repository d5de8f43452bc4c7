"""``explore("llama-3.1-8b", lora=dict(r=16), seq_len=2048)``: a workload from a name, for the
explorer's front door. A demo name (``memsave_nb.zoo``) builds the demo on ``device``; any other
name, path or config goes to :func:`memsave_nb.hub.from_pretrained` (meta build, fake mode)."""

from __future__ import annotations

from typing import Any

from memsave_nb.errors import WorkloadError
from memsave_nb.workload import Workload


def workload_by_name(name: str, device: str, mode: str, hub_kwargs: dict[str, Any]) -> tuple[Workload, str]:
    """(workload, mode): models built from a config on the meta device are measured in fake mode."""
    from memsave_nb import zoo

    if name in zoo.NAMES:
        if hub_kwargs:
            raise WorkloadError(
                f"{', '.join(sorted(hub_kwargs))} apply to Hugging Face models by name; {name!r} is a demo model"
            )
        return zoo.make(name, device=device), mode
    from memsave_nb.hub import from_pretrained

    if mode == "real":  # the default: a meta-device build has no values to run
        mode = "fake"
    if mode != "fake":
        raise WorkloadError(f"{name!r} is built from its config on the meta device: it is measured with mode='fake'")
    return from_pretrained(name, **hub_kwargs), mode
