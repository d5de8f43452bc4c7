"""The explorer's "Rule of thumb" tab (issue 42): the bytes-per-parameter rule that fine-tuning
guides quote, beside what the step measured per part, and what the rule leaves out at each phase's
peak. A tab of its own rather than a section of Results: students read it as a whole, beside the
other tabs, and Results is already a page of figures.

The numbers are ``measure/rule_of_thumb.py``'s (the one computation), the cells ``ui/teach_table.py``'s
(the CLI's and the HTML report's): the tab only lays them out."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import ipywidgets as W

from memsave_nb.measure import Measurement
from memsave_nb.measure.rule_of_thumb import TeacherView, teacher_view
from memsave_nb.plan import Plan

from .teach_table import phase_table, rule_table, teach_lines


def optimizer_name(plan: Plan, workload: Any) -> str | None:
    """The vocabulary name of the optimizer the step ran (the plan's knob, else the workload's own);
    None where it is not a name (a callable): the rule then has no state row."""
    from memsave_nb.vocabulary import OPTIMIZER_ALIASES

    name = plan.optimizer or getattr(workload, "optimizer", None)
    return OPTIMIZER_ALIASES.get(name.lower(), name.lower()) if isinstance(name, str) else None


def view_for(workload: Any, plan: Plan, m: Measurement) -> TeacherView:
    """The teacher's view of ``m``: the rule counts the model as the step ran it (the plan applied:
    its frozen parameters, casts and adapters), so the plan is applied again for that count and
    undone, under the model's lock as a run is."""
    from memsave_nb.measure.common import model_lock

    with model_lock(workload.model), plan.apply(workload) as applied:
        return teacher_view(m, applied.model, optimizer_name(plan, workload), master=plan.precision == "bf16_master")


def _table(headers: list[str], rows: list[list[str]], cls: str, keys: list[str]) -> str:
    """An HTML table of text cells (its look: ``styles.TEACH_CSS``); ``data-part`` names each row."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        f"<tr data-part='{html.escape(k)}'>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
        for k, row in zip(keys, rows)
    )
    return (
        f"<div class='memsave-teach-box'><table class='memsave-teach-table {cls}'>"
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
    )


@dataclass
class TeachTab:
    """The tab's widgets: ``rule`` (the rule beside the measured bytes), ``phases`` (each phase's
    peak split), ``notes`` (the sentences under them); ``view``: the TeacherView on display."""

    rule: W.HTML
    phases: W.HTML
    notes: W.HTML
    tab: W.VBox
    view: TeacherView | None = None

    @classmethod
    def build(cls) -> "TeachTab":
        rule, phases, notes = W.HTML(""), W.HTML(""), W.HTML("")
        rule.add_class("memsave-teach-rule")
        phases.add_class("memsave-teach-phases")
        notes.add_class("memsave-teach-notes")
        intro = W.HTML(
            "<p class='memsave-teach-intro'>The rule of thumb counts weights, gradients and optimizer "
            "state per parameter; the measured bytes are the most the step held of each. What the rule "
            "leaves out (activations kept for backward, outputs, temporaries) is in the phase table, at "
            "each phase's own peak.</p>"
        )
        tab = W.VBox([intro, rule, phases, notes])
        tab.add_class("memsave-teach")
        return cls(rule=rule, phases=phases, notes=notes, tab=tab)

    def show(self, view: TeacherView) -> None:
        """Lay out ``view`` (rows named by part and by phase, for tests and scripts)."""
        self.view = view
        rh, rr = rule_table(view)
        ph, pr = phase_table(view)
        self.rule.value = _table(rh, rr, "memsave-teach-rule-table", [p.part for p in view.parts] + ["total"])
        self.phases.value = _table(ph, pr, "memsave-teach-phase-table", [phase for phase, _ in view.phases])
        self.notes.value = "".join(
            f"<p class='memsave-teach-line'>{html.escape(line)}</p>" for line in teach_lines(view)
        )

    def show_error(self, message: str) -> None:
        """No view for this run (the count failed): say so in one line, keep nothing stale."""
        self.view = None
        self.rule.value = f"<small>no rule of thumb for this run: {html.escape(message[:200])}</small>"
        self.phases.value = self.notes.value = ""
