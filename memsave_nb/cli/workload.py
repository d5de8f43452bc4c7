"""The command line's workload: a demo model (``memsave_nb.zoo``) or any model ``memsave_nb.hub``
knows (catalogue name, hub id, local folder or ``config.json``), with LoRA, QLoRA and a task.

A demo model's batch is real tensors even in fake mode (the zoo builds it), so its bytes are
checked against this machine's available memory before it is built; in real mode the step's
peak is checked too, from two fake-mode probes at batch 1 and 2. Either refusal is one line."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
from dataclasses import dataclass

from ..errors import MemsaveError
from ..workload import Workload


@dataclass(frozen=True)
class CliWorkload:
    workload: Workload
    name: str
    batch: int
    mode: str  # the measuring mode: the user's, else the model's default
    hub: bool  # built by memsave_nb.hub (meta device, fake mode only)


def is_demo(name: str) -> bool:
    from .. import zoo

    return name in zoo.NAMES


def check_model_flags(args: argparse.Namespace) -> None:
    """Flags that only a hub model takes, and modes a model cannot run: refused before building."""
    if is_demo(args.model):
        given = [f for f, v in (("--lora", args.lora), ("--quantize", args.quantize), ("--task", args.task)) if v]
        if given:
            raise MemsaveError(
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for Hugging Face models (catalogue names, hub ids, config.json); "
                f"{args.model!r} is a demo model"
            )
        if args.model == "gpt-7b" and args.mode == "real":
            raise MemsaveError("gpt-7b is built from fake tensors and only runs with --mode fake")
    elif args.mode == "real":
        raise MemsaveError(
            f"{args.model!r} is built from its config on the meta device (no weights): "
            "it is measured with --mode fake only"
        )


def build(args: argparse.Namespace, *, device: str = "cpu") -> CliWorkload:
    """The workload ``args`` names, at ``args.batch`` (and, for hub models, ``args.seq_len``)."""
    cw = _demo(args, device) if is_demo(args.model) else _hub(args)
    loop = getattr(args, "loop", None)
    if loop is not None:  # the loop the user runs: how long the output lives (Workload.loop)
        cw = dataclasses.replace(cw, workload=cw.workload.replace(loop=loop))
    if getattr(args, "one_shot", False):
        # a command's own process: what exists now (torch, transformers, the model) lives to its end
        # anyway; frozen, the garbage collector stops walking it in every collection the fake steps
        # trigger (about 1 s of the issue-26 command's 7). Not when main() is called with argv (a
        # test, a notebook): their cyclic garbage must stay collectable.
        gc.freeze()
    return cw


def _demo(args: argparse.Namespace, device: str) -> CliWorkload:
    from .. import zoo

    batch = args.batch or zoo.DEFAULT_BATCH[args.model]
    mode = args.mode or ("fake" if args.model == "gpt-7b" else "real")
    if args.model != "gpt-7b":
        check_fits_this_machine(args.model, batch, mode, device)
    return CliWorkload(zoo.make(args.model, batch, device=device), args.model, batch, mode, hub=False)


def _hub(args: argparse.Namespace) -> CliWorkload:
    from ..hub import HubError, catalogue
    from ..hub import from_pretrained as _from_pretrained
    from ..hub.lora import without_bitsandbytes

    def from_pretrained(name, **kwargs):
        with without_bitsandbytes():  # this process never hands peft a bitsandbytes layer: 1-2 s saved
            return _from_pretrained(name, **kwargs)

    kwargs = dict(
        task=args.task,
        batch_size=args.batch or 1,
        seq_len=getattr(args, "seq_len", None),
        lora=args.lora,
        quantize=args.quantize,
    )
    if getattr(args, "trainer_config", None) is not None:
        kwargs["dtype"] = loaded_dtype(args.model)  # the trainer's bf16/fp16 fields are autocast over it
    try:
        wl = from_pretrained(args.model, **kwargs)
    except HubError as exc:
        # a hub id the offline catalogue holds: its public numbers when the hub cannot be reached
        same = [n for n, e in catalogue().items() if e.get("source", "").lower() == args.model.lower()]
        if not same or "cannot get config.json" not in str(exc):
            if str(exc).startswith("unknown model"):
                raise HubError(f"{exc}; demo models: {', '.join(_demo_names())}") from None
            raise
        wl = from_pretrained(same[0], **kwargs)
    return CliWorkload(wl, args.model, args.batch or 1, "fake", hub=True)


def loaded_dtype(model: str):
    """The dtype a trainer's script loads ``model`` in: ``from_pretrained``'s default
    ``dtype="auto"`` reads config.json's ``dtype``, else float32."""
    import torch

    from ..hub import HubError, parse_dtype
    from ..hub.configs import resolve_config

    try:
        config = resolve_config(model)
    except HubError:
        return torch.float32  # from_pretrained reports the name itself
    dtype = getattr(config, "dtype", None)  # transformers reads an older file's torch_dtype into it
    try:
        return parse_dtype(dtype) if dtype is not None else torch.float32
    except HubError:
        return torch.float32


def _default_batch(name: str) -> int:
    from .. import zoo

    return zoo.DEFAULT_BATCH[name]


def _demo_names() -> tuple[str, ...]:
    from .. import zoo

    return zoo.NAMES


# -- this machine's memory ------------------------------------------------------------------------


def available_bytes() -> int | None:
    """Memory this machine can still give (Linux MemAvailable; else free pages; None if unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def batch_bytes_per_sample(name: str) -> int:
    """Bytes of one sample of a demo model's batch (inputs and the targets its loss holds)."""
    from .. import zoo
    from ..workload import iter_tensors

    wl = zoo.make(name, 1)
    tensors = list(iter_tensors(wl.batch))
    for cell in getattr(wl.loss, "__closure__", None) or ():
        tensors += list(iter_tensors(cell.cell_contents))
    return sum(t.numel() * t.element_size() for t in tensors)


def check_fits_this_machine(
    name: str, batch: int, mode: str, device: str = "cpu", available: int | None = None
) -> None:
    """Refuse, in one line and before anything is allocated, a demo batch this machine cannot hold
    (any mode: the zoo builds the batch for real) and a real-mode step it cannot run (CPU)."""
    from ..units import format_bytes

    available = available_bytes() if available is None else available
    if available is None:
        return
    need = batch_bytes_per_sample(name) * batch
    if need > available // 2:  # the batch and the copies a resize or a device move makes
        raise MemsaveError(
            f"batch {batch} of {name} holds {format_bytes(need)} of inputs alone; this machine has "
            f"{format_bytes(available)} available (at most half for inputs): use a smaller --batch"
        )
    if mode == "real" and device == "cpu" and batch > _default_batch(name):  # the defaults are sized to run
        peak = estimated_real_peak(name, batch)
        if peak > available:
            raise MemsaveError(
                f"batch {batch} of {name} needs about {format_bytes(peak)} in real mode (fake-mode estimate); "
                f"this machine has {format_bytes(available)} available: use --mode fake or a smaller --batch"
            )


def estimated_real_peak(name: str, batch: int) -> int:
    """The step's peak at ``batch`` from fake-mode probes at batch 1 and 2 (peaks grow linearly in
    the batch); a batch of 2 or less is measured directly."""
    from .. import zoo
    from ..measure import measure

    def peak(b: int) -> int:
        return measure(zoo.make(name, b), mode="fake", repeats=1, flops=False).peak_bytes

    if batch <= 2:
        return peak(batch)
    one, two = peak(1), peak(2)
    return one + (batch - 1) * max(two - one, 0)
