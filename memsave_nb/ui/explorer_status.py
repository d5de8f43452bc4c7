"""The explorer's status bar: run, cancel and live-reruns controls, the progress bar and text, the
status word (``idle``, ``running``, ``done``, ``cancelled``, ``error``, ...) and the error box.
Built here; the explorer wires the buttons and says what state it is in."""

from __future__ import annotations

import html
from dataclasses import dataclass

import ipywidgets as W

_STATE_COLORS = {
    "running": "#1f77b4",
    "waiting": "#1f77b4",
    "error": "#d62728",
    "cancelled": "#b8860b",
    "done": "#2ca02c",
    "changed": "#b8860b",
}


def status_html(state: str, text: str = "") -> str:
    """The status line: the state's word in its colour (a spinner while it runs) and the text."""
    color = _STATE_COLORS.get(state, "#555")
    icon = "<span class='memsave-spinner'></span>" if state in ("running", "waiting") else ""
    return f"<span style='color:{color}'>{icon}<b>{html.escape(state)}</b></span> <small>{html.escape(text)}</small>"


@dataclass
class StatusBar:
    """The status bar's widgets (the explorer keeps each under the same name)."""

    run_button: W.Button
    cancel_button: W.Button
    live: W.Checkbox
    progress: W.IntProgress
    progress_text: W.HTML
    status: W.HTML
    box: W.HBox
    error_box: W.HTML

    @classmethod
    def build(cls, live: bool) -> "StatusBar":
        status = W.HTML("idle")
        status.add_class("memsave-status")
        progress = W.IntProgress(
            value=0, min=0, max=1, layout=W.Layout(width="160px", visibility="hidden", flex="0 0 auto")
        )
        progress.add_class("memsave-progress")
        progress_text = W.HTML("")
        progress_text.add_class("memsave-progress-text")
        # fixed widths that do not shrink: at 700 px the buttons keep their words
        cancel_button = W.Button(
            description="cancel",
            icon="stop",
            disabled=True,
            layout=W.Layout(width="100px", min_width="100px", flex="0 0 auto"),
        )
        cancel_button.add_class("memsave-cancel")
        run_button = W.Button(
            description="run",
            icon="play",
            layout=W.Layout(width="90px", min_width="90px", flex="0 0 auto"),
            tooltip="measure the current plan now",
        )
        run_button.add_class("memsave-run")
        live_box = W.Checkbox(
            value=live,
            description="live reruns",
            indent=False,
            layout=W.Layout(width="120px", min_width="110px", flex="0 0 auto"),
        )
        live_box.add_class("memsave-live")
        box = W.HBox(
            [run_button, cancel_button, live_box, progress, progress_text, status],
            layout=W.Layout(align_items="center", flex_flow="row wrap"),
        )
        error_box = W.HTML("", layout=W.Layout(display="none"))
        error_box.add_class("memsave-error")
        return cls(
            run_button=run_button,
            cancel_button=cancel_button,
            live=live_box,
            progress=progress,
            progress_text=progress_text,
            status=status,
            box=box,
            error_box=error_box,
        )
