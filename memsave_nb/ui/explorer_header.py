"""The explorer's header: the title, the memory and time lines (saved, peak, step time, the CUDA
peak, the host memory of offloaded regions, the target verdict), the advice and the loss note,
built once and filled from a Measurement against the baseline. No logic beyond formatting:
``ui/explorer.py`` decides what is shown."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import ipywidgets as W

from memsave_nb.measure import Measurement

from .explorer_text import _delta_text
from .format import format_bytes
from .verdict import show_reserved


def _label(value: str, cls: str, **layout: Any) -> W.Label:
    # as wide as the text (a Label's default inline width spreads the header over two lines)
    layout = {"width": "auto", "flex": "0 0 auto", "margin": "0 4px 0 0", **layout}
    w = W.Label(value=value, layout=W.Layout(**layout))
    w.add_class(cls)
    return w


def _bold(word: str, margin: str) -> W.HTML:
    return W.HTML(f"<b>{word}</b>", layout=W.Layout(flex="0 0 auto", margin=margin))


def _row(children: list) -> W.HBox:
    row = W.HBox(children, layout=W.Layout(flex_flow="row wrap", align_items="center"))
    row.add_class("memsave-summary-row")
    return row


@dataclass
class Header:
    """The header's widgets (the explorer keeps each under the same name, for tests and notebooks)."""

    title: W.HTML
    saved_total: W.Label
    saved_bytes: W.Label
    saved_delta: W.Label
    output_kept: W.Label
    peak_total: W.Label
    peak_bytes: W.Label
    peak_delta: W.Label
    first_step: W.Label
    reserved: W.Label  # the allocator model's, ui/verdict.py
    step_time: W.Label
    cuda_peak: W.Label
    host: W.Label  # host memory of offloaded regions (Measurement.host); hidden when nothing is offloaded
    target_verdict: W.Label  # fits / does not fit the "Fit a GPU" target, and its max batch when found
    summary: W.VBox
    advice: W.HTML
    loss_note: W.HTML

    @classmethod
    def build(cls, title_html: str, loss_note_html: str) -> "Header":
        labels = dict(
            saved_total=_label("-", "memsave-saved-total"),
            saved_bytes=_label("-", "memsave-saved-bytes"),
            saved_delta=_label("", "memsave-saved-delta"),
            output_kept=_label("", "memsave-output-bytes", display="none"),
            peak_total=_label("-", "memsave-peak-total"),
            peak_bytes=_label("-", "memsave-peak-bytes"),
            peak_delta=_label("", "memsave-peak-delta"),
            first_step=_label("", "memsave-first-step-peak", display="none"),
            reserved=_label("", "memsave-reserved", display="none"),
            step_time=_label("-", "memsave-step-time"),
            cuda_peak=_label("", "memsave-cuda-peak", display="none"),
            host=_label("", "memsave-host", display="none"),
            target_verdict=_label("", "memsave-target-verdict", display="none"),
        )
        title = W.HTML(title_html)
        title.add_class("memsave-title")
        # two designed lines (memory; time) rather than one that wraps anywhere
        memory_row = _row(
            [_bold("saved", "0 6px 0 0")]
            + [labels[k] for k in ("saved_total", "saved_bytes", "saved_delta", "output_kept")]
            + [_bold("peak", "0 6px 0 8px")]
            + [labels[k] for k in ("peak_total", "peak_bytes", "peak_delta", "first_step", "reserved")]
        )
        # the host label sits on the time line: the memory line is full at 1400 px, and moving
        # bytes to the host is paid in step time
        time_row = _row(
            [_bold("step", "0 6px 0 0")] + [labels[k] for k in ("step_time", "cuda_peak", "host", "target_verdict")]
        )
        summary = W.VBox([memory_row, time_row])
        summary.add_class("memsave-summary")
        advice = W.HTML("", layout=W.Layout(display="none"))
        advice.add_class("memsave-advice")
        loss_note = W.HTML(loss_note_html)
        loss_note.add_class("memsave-loss-note")
        return cls(title=title, summary=summary, advice=advice, loss_note=loss_note, **labels)

    def show(self, m: Measurement, base: Measurement, step_text: str, *, offloads: bool = False) -> None:
        """Fill the numbers of ``m`` against ``base``; ``step_text`` is the step-time line;
        ``offloads``: the measured plan offloads a region (the host label is shown)."""
        self.saved_total.value = format_bytes(m.saved_bytes)
        self.saved_bytes.value = f"{m.saved_bytes:,} B"
        self.saved_delta.value = _delta_text(m.saved_bytes, base.saved_bytes)
        self.peak_total.value = format_bytes(m.peak_bytes)
        self.peak_bytes.value = f"{m.peak_bytes:,} B"
        self.peak_delta.value = _delta_text(m.peak_bytes, base.peak_bytes)
        self.step_time.value = step_text
        self._show_outputs(m)
        self._show_first_step(m)
        self._show_advice(tuple(getattr(m, "advice", ()) or ()))
        self.cuda_peak.value = (
            f"CUDA allocator peak {format_bytes(m.cuda_peak_bytes)}" if m.cuda_peak_bytes is not None else ""
        )
        self.cuda_peak.layout.display = "" if m.cuda_peak_bytes is not None else "none"
        show_reserved(self.reserved, m)
        self._show_host(m, offloads)

    def _show_host(self, m: Measurement, offloads: bool) -> None:
        host = getattr(m, "host", None)
        if host is None or not (offloads or host.tensors > 0):
            self.host.layout.display = "none"
            self.host.value, self.host.tooltip = "", None
            return
        self.host.layout.display = ""
        from memsave_nb.offload import LINKS, transfer_seconds

        from .format import format_seconds

        self.host.value = f"host {format_bytes(host.peak_bytes)}, {format_bytes(host.to_host_bytes)} moved/step"
        self.host.tooltip = (
            f"host (CPU) memory: the activations offloaded regions copy out in forward and back in "
            f"backward, at most {host.peak_bytes:,} B at once ({host.tensors} copies; parameters, "
            f"gradients and optimizer state stay on the device); moved per step: {host.to_host_bytes:,} B "
            f"to the host, {host.to_device_bytes:,} B back, ~{format_seconds(transfer_seconds(host.to_host_bytes))} "
            f"over {LINKS['pcie5'].name} (the link assumed, {LINKS['pcie5'].bytes_per_second / 1e9:g} GB/s each way)"
        )

    def _show_outputs(self, m: Measurement) -> None:
        outputs = int(getattr(m, "output_bytes", 0) or 0)
        self.output_kept.value = f"+ {format_bytes(outputs)} outputs and caches" if outputs else ""
        self.output_kept.tooltip = (
            (
                f"outputs and caches the step keeps to the end of forward, not saved for "
                f"backward ({outputs:,} B); {m.saved_bytes + outputs:,} B kept in all"
            )
            if outputs
            else None
        )
        self.output_kept.layout.display = "" if outputs else "none"

    def _show_first_step(self, m: Measurement) -> None:
        first = getattr(m, "first_step_peak_bytes", None)
        show_first = first is not None and first != m.peak_bytes
        self.first_step.value = f"(step 1: {format_bytes(first)})" if show_first else ""
        self.first_step.tooltip = (
            (f"the peak of training's steady-state step; the first step peaks at {first:,} B") if show_first else None
        )
        self.first_step.layout.display = "" if show_first else "none"

    def _show_advice(self, advice: tuple) -> None:
        self.advice.value = (
            (
                "<ul style='margin:2px 0;font-size:90%;color:#8a6d3b'>"
                + "".join(f"<li>{html.escape(a)}</li>" for a in advice)
                + "</ul>"
            )
            if advice
            else ""
        )
        self.advice.layout.display = "" if advice else "none"
