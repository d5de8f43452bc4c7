"""The explorer's one-line texts: its title, which loss the step uses, a change against the
baseline."""

from __future__ import annotations

import html
from typing import Any

from memsave_nb.vocabulary import DEFAULT_LOOP, LOOPS

from .format import format_delta_bytes


def title_html(
    name: str,
    type_name: str,
    mode: str,
    device: str,
    loop: str = DEFAULT_LOOP,
    sized_for: str | None = None,
    shape: str = "",
    sized: str = "",
) -> str:
    """The explorer's title; the class name once when the workload is named after it; the batch
    and sequence sized (``shape``, from ``ui/sized.py``: a model by name's synthetic batch is
    otherwise invisible); the training loop measured (how long the output lives), with its meaning
    on hover; for a step sized as CUDA runs it (``Workload.sized_for``), that (``sized``: the words
    with the attention backend, from the baseline's notes), so a CPU twin's number is never read as
    the CPU's."""
    what = (
        html.escape(type_name)
        if name in ("", type_name, "workload")
        else f"{html.escape(name)}: {html.escape(type_name)}"
    )
    shape_html = f" <span class='memsave-sized'>({html.escape(shape)})</span>" if shape else ""
    cuda = sized or (", sized as CUDA runs it (foreach optimizer step)" if sized_for == "cuda" else "")
    return (
        f"<b>memsave explorer</b> &mdash; {what}{shape_html}, {html.escape(mode)} mode on {html.escape(device)}{cuda}, "
        f"<span title='{html.escape(LOOPS.get(loop, ''), quote=True)}'>loop {html.escape(loop)}</span>"
    )


def loss_note_html(workload: Any, mode: str) -> str:
    """Which loss the step uses, in one line; for a model returning a tuple or dict without a
    ``loss``, the rule that builds one (sum of every floating output) is named."""
    if getattr(workload, "loss", None) is not None:
        return ""
    kind = output_kind(workload, fake=mode == "fake")
    if kind == "loss":
        return "<small>loss: the model's own <code>loss</code> output</small>"
    if kind == "tensor":
        return "<small>loss: the sum of the model's output (pass <code>loss=...</code> for your own)</small>"
    if kind is None:  # the forward could not be run apart from the step: say the rule, not a guess
        return (
            "<small>loss: the model's own <code>loss</code> output when it returns one, else the sum of its "
            "output (pass <code>loss=...</code> for your own)</small>"
        )
    return (
        f"<small>loss: the model returns a {html.escape(kind)} without a <code>loss</code>; the step uses the sum "
        "of every floating-point tensor in it. Pass <code>loss=...</code> to use your own.</small>"
    )


def output_kind(workload: Any, *, fake: bool = False) -> str | None:
    """``"tensor"``, ``"loss"`` (an output with a loss), ``"tuple"``, ``"dict"``... from one forward
    without gradients (``fake``: on fake twins of the weights, as fake mode measures, so a model
    too large for this machine is asked too); None when it cannot be told."""
    import torch

    out = None
    # without gradients first (cheap); a model that needs autograd in its forward (a gradient
    # penalty, a physics-informed loss) fails there and is asked again with gradients on
    for grad in (False, True):
        try:
            out = _fake_forward(workload, grad) if fake else _real_forward(workload, grad)
            break
        except Exception:  # noqa: BLE001 - a note only; the measured step reports real errors
            continue
    if out is None:
        return None
    if isinstance(out, torch.Tensor):
        return "tensor"
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor):
        return "loss"
    return type(out).__name__


def _real_forward(workload: Any, grad: bool) -> Any:
    """One forward on the model itself; its buffers (running statistics) are put back."""
    import torch

    buffers = [(b, b.detach().clone()) for b in workload.model.buffers()]
    try:
        with torch.set_grad_enabled(grad):
            return workload.forward(workload.make_batch())
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _fake_forward(workload: Any, grad: bool = False) -> Any:
    """One forward on fake twins of the parameters and buffers (the model's own are untouched)."""
    import torch

    from memsave_nb.measure.common import model_lock
    from memsave_nb.measure.fake_model import _fake_model

    with model_lock(workload.model), _fake_model(workload.model, str(workload.device)) as fake_mode, fake_mode:
        with torch.set_grad_enabled(grad):
            return workload.forward(workload.make_batch())


def _delta_text(now: int, before: int) -> str:
    if now == before:
        return "(= baseline)"
    pct = f", {100.0 * (now - before) / before:+.1f}%" if before else ""
    return f"({format_delta_bytes(now - before)}{pct})"
