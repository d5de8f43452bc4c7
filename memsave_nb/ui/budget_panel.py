"""The torch.compile memory-budget panel: a budget slider and a sweep plotted as memory vs time.

``activation_memory_budget`` (0..1) makes the compiler's partitioner choose what to recompute:
0 behaves like full checkpointing, 1 like default compile. Ticking "compile" puts the slider's
budget into the plan; "sweep" measures the current plan compiled at each listed budget.

DOM hooks: ``.memsave-compile`` (checkbox), ``.memsave-budget`` (slider), ``.memsave-sweep``
(button), ``.memsave-sweep-budgets`` (text).
"""

from __future__ import annotations

import html
from typing import Callable

import ipywidgets as W

from memsave_nb.errors import MemsaveError, quoted

from . import figures
from .editor import PlanEditor
from .plots import bokeh_widget

DEFAULT_BUDGETS = (0.0, 0.25, 0.5, 0.75, 1.0)


def parse_budgets(text: str) -> list[float]:
    """``"0, 0.5, 1"`` -> ``[0.0, 0.5, 1.0]``; a value outside [0, 1] or not a number is a one-line error."""
    out = []
    for part in text.replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise MemsaveError(f"budget {quoted(part)} is not a number") from None
        if not 0.0 <= value <= 1.0:
            raise MemsaveError(f"budget {value:g} is outside [0, 1]")
        out.append(value)
    if not out:
        raise MemsaveError("list at least one budget between 0 and 1")
    return sorted(set(out))


class BudgetPanel(W.VBox):
    def __init__(self, editor: PlanEditor, on_sweep: Callable[[list[float]], None], *, disabled_reason: str = ""):
        """``disabled_reason``: why nothing here can run (fake mode); the controls are disabled
        and the reason shown."""
        self.editor = editor
        self.disabled_reason = disabled_reason
        self._on_sweep = on_sweep
        self._syncing = False
        self.enable = W.Checkbox(value=False, description="compile with a memory budget", indent=False)
        self.enable.add_class("memsave-compile")
        self.slider = W.FloatSlider(
            value=0.5, min=0.0, max=1.0, step=0.05, description="budget", continuous_update=False, readout_format=".2f"
        )
        self.slider.add_class("memsave-budget")
        self.budgets = W.Text(value=", ".join(f"{b:g}" for b in DEFAULT_BUDGETS), description="sweep at")
        self.budgets.add_class("memsave-sweep-budgets")
        self.sweep_button = W.Button(description="sweep", icon="line-chart", button_style="info")
        self.sweep_button.add_class("memsave-sweep")
        self.note = W.HTML(
            "<small>0 recomputes what it can (like full checkpointing), 1 is default compile. "
            "Compiling takes a while on the first run of each budget; real mode only.</small>"
        )
        self.message = W.HTML("")
        self.message.add_class("memsave-budget-error")
        self.reason = W.HTML(
            f"<div style='color:#8a6d3b'><b>Not available here:</b> {html.escape(disabled_reason)}</div>"
            if disabled_reason
            else ""
        )
        self.reason.add_class("memsave-budget-disabled")
        if disabled_reason:
            for w in (self.enable, self.slider, self.budgets, self.sweep_button):
                w.disabled = True
        self.plot = figures.budget_sweep([])
        self.points: list = []
        self.enable.observe(self._user_change, "value")
        self.slider.observe(self._user_change, "value")
        self.sweep_button.on_click(self._user_sweep)
        super().__init__(
            [
                self.reason,
                W.HBox([self.enable, self.slider]),
                W.HBox([self.budgets, self.sweep_button, self.message]),
                self.note,
                bokeh_widget(self.plot.figure),
            ]
        )
        self.add_class("memsave-budget-panel")

    def _user_change(self, _change) -> None:
        if self._syncing:
            return
        if self.disabled_reason and self.enable.value:
            self._syncing = True
            self.enable.value = False
            self._syncing = False
            self.message.value = f"<span style='color:#d62728'>{html.escape(self.disabled_reason)}</span>"
            return
        self.editor.set_compile_budget(float(self.slider.value) if self.enable.value else None)

    def _user_sweep(self, _button=None) -> None:
        if self.disabled_reason:
            self.message.value = f"<span style='color:#d62728'>{html.escape(self.disabled_reason)}</span>"
            return
        try:
            budgets = parse_budgets(self.budgets.value)
        except MemsaveError as exc:  # a callback's exception would vanish: say it here
            self.message.value = f"<span style='color:#d62728'>{html.escape(str(exc))}</span>"
            return
        self.message.value = ""
        self._on_sweep(budgets)

    def sync_controls(self) -> None:
        self._syncing = True
        try:
            budget = self.editor.compile_budget
            self.enable.value = budget is not None
            if budget is not None:
                self.slider.value = budget
        finally:
            self._syncing = False

    def show_sweep(self, points: list) -> None:
        """Plot the sweep so far: ``(budget, measurement)`` pairs or session BudgetPoint-like entries."""
        self.points = list(points)
        self.plot.update(self.points)
