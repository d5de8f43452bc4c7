"""The explorer's own tab contents (the panels have their own files): the Layers tab's whole-model
toolbar (plan presets, input requires grad, batch norm in eval mode, reset) and the "Plan as code"
tab (the plan as Python and as JSON)."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import ipywidgets as W


@dataclass
class Toolbar:
    """Whole-model controls above the layer table; ``presets`` maps each preset's name to its plan."""

    presets: dict[str, Any]
    preset: W.Dropdown
    input_grad: W.Checkbox
    bn_eval: W.Checkbox
    reset_button: W.Button

    @classmethod
    def build(cls, workload: Any) -> "Toolbar":
        try:
            from memsave_nb.presets import presets_for

            presets = presets_for(workload)  # the workload: no input-only preset for token-id batches
        except Exception:  # noqa: BLE001 - presets are a convenience; the explorer works without
            presets = {}
        preset = W.Dropdown(
            options=[("plan preset…", "")] + [(k, k) for k in presets], value="", layout=W.Layout(width="220px")
        )
        preset.add_class("memsave-preset")
        input_grad = W.Checkbox(
            value=bool(getattr(workload, "input_requires_grad", False)),
            description="input requires grad",
            indent=False,
            layout=W.Layout(width="160px"),
        )
        input_grad.add_class("memsave-input-grad")
        bn_eval = W.Checkbox(
            value=False, description="batch norm in eval mode", indent=False, layout=W.Layout(width="190px")
        )
        bn_eval.add_class("memsave-bn-eval")
        reset_button = W.Button(description="reset plan", icon="undo", layout=W.Layout(width="110px"))
        reset_button.add_class("memsave-reset")
        return cls(presets=presets, preset=preset, input_grad=input_grad, bn_eval=bn_eval, reset_button=reset_button)

    def layers_tab(self, table: Any) -> W.VBox:
        """The Layers tab: this toolbar (with the table's expand / collapse buttons) over the table."""
        row = W.HBox(
            [self.preset, self.input_grad, self.bn_eval, self.reset_button, table.expand_all, table.collapse_all],
            layout=W.Layout(flex_flow="row wrap"),
        )
        return W.VBox([row, table])


@dataclass
class CodeTab:
    """The plan as code (``code``, HTML) and as JSON (``plan_json``, editable text)."""

    code: W.HTML
    plan_json: W.Textarea
    tab: W.VBox

    @classmethod
    def build(cls) -> "CodeTab":
        code = W.HTML()
        code.add_class("memsave-plan-code")
        plan_json = W.Textarea(layout=W.Layout(width="100%", height="120px"))
        plan_json.add_class("memsave-plan-json")
        tab = W.VBox(
            [
                W.HTML("<small>Run this once after building the model (before building the optimizer):</small>"),
                code,
                W.HTML("<small>The plan as JSON (<code>Plan.from_json</code> reads it back):</small>"),
                plan_json,
            ]
        )
        return cls(code=code, plan_json=plan_json, tab=tab)

    def show(self, code: str, plan_json: str) -> None:
        self.code.value = (
            "<pre style='font-size:85%;background:var(--jp-layout-color2, #f7f7f7);color:var(--jp-content-font-color1, "
            "inherit);padding:6px;white-space:pre;overflow-x:auto'>"
            f"{html.escape(code)}</pre>"
        )
        self.plan_json.value = plan_json
