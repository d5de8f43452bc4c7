"""What ``explore(...)`` was handed, turned into a :class:`~memsave_nb.session.Session`: a model and
its batch, a Workload, a Session, a demo or a model name (``ui/by_name.py``); each wrong mix is a
one-line :class:`~memsave_nb.errors.WorkloadError` before anything is measured, and the user's
model is never moved."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from memsave_nb.errors import WorkloadError
from memsave_nb.session import Session
from memsave_nb.workload import Workload


def _check_model_device(model: nn.Module, device: str, mode: str) -> None:
    """The model must already be where the step runs: the explorer never moves a user's model."""
    import torch

    from memsave_nb.workload import check_device

    device = check_device(device)  # an unavailable device is its own one-line error
    if mode == "fake":
        return  # fake mode makes fake twins of the parameters; the device only names the batch's
    want = torch.device(device)
    for p in model.parameters():
        have = p.device
        if have.type == "meta":
            return
        if have.type != want.type or (want.index is not None and have.index != want.index):
            raise WorkloadError(
                f"the model is on {have} but device={device!r}: move it first (model.to({device!r})) "
                "or pass the device it is on"
            )
        return


def session_for(
    model_or_workload: nn.Module | Workload | Session | str,
    batch: Any,
    loss: Callable[[Any], Any] | None,
    optimizer: Any,
    device: str,
    mode: str,
    *,
    repeats: int,
    hub_kwargs: dict[str, Any],
) -> Session:
    """The Session the explorer opens on (arguments as :func:`~memsave_nb.ui.explorer.explore`'s)."""
    if hub_kwargs and not isinstance(model_or_workload, str):
        raise WorkloadError(f"{', '.join(sorted(hub_kwargs))}: only with a model given by name")
    if isinstance(model_or_workload, Session):
        session = model_or_workload
    else:
        if isinstance(model_or_workload, str):
            from .by_name import workload_by_name

            if batch is not None or loss is not None:
                raise WorkloadError("a model name brings its own batch and loss; pass a model to use yours")
            workload, mode = workload_by_name(model_or_workload, device, mode, hub_kwargs)
        elif isinstance(model_or_workload, Workload):
            workload = model_or_workload
            if batch is not None or loss is not None:
                raise WorkloadError("a Workload brings its own batch and loss; pass the model to use other ones")
        elif isinstance(model_or_workload, nn.Module):
            if batch is None:
                raise WorkloadError(
                    "pass a batch: explore(model, batch) (a tensor, tuple, dict or a function making one)"
                )
            _check_model_device(model_or_workload, device, mode)
            workload = Workload(
                model_or_workload,
                batch,
                loss=loss,
                optimizer=optimizer,
                device=device,
                name=type(model_or_workload).__name__,
            )
        else:
            raise WorkloadError(
                f"explore() takes a torch.nn.Module, a Workload, a Session or a demo name, "
                f"got {type(model_or_workload).__name__}"
            )
        session = Session(workload, mode, repeats=repeats)
    return session
