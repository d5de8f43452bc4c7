"""The "Fit a GPU" panel's controls, built and read here: the target row (size, headroom, the GPU
the times are for), the workload knobs of the plan on display, and the search buttons with their
answers. No logic beyond widget <-> plan: ``ui/tuner_panel.py`` wires them."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import ipywidgets as W

from memsave_nb.plan import Plan
from memsave_nb.target import DEFAULT_HEADROOM, HEADROOM_SOURCE, MAX_GB, PRESETS_GB

FREE = "other…"
# Dropdown values are strings: ipywidgets shows a None value as an empty menu, not as "as given"
AS_GIVEN = ""
ZERO_GRAD_CHOICES = (("as given", AS_GIVEN), ("set to None", "none"), ("zero in place", "zero"))
_ZERO_GRAD = {AS_GIVEN: None, "none": True, "zero": False}


def _classed(widget: Any, cls: str) -> Any:
    widget.add_class(cls)
    return widget


@dataclass
class TargetControls:
    """The GPU the question is about: a preset menu, its free size, the headroom, the timing GPU."""

    menu: W.Dropdown
    gb: W.BoundedFloatText
    headroom: W.BoundedFloatText
    device: W.Dropdown

    @classmethod
    def build(cls, start_gb: float, device: str) -> "TargetControls":
        from memsave_nb.planner import GPUS

        options = [(f"{g:g} GB", float(g)) for g in PRESETS_GB] + [(FREE, 0.0)]
        return cls(
            menu=_classed(
                W.Dropdown(options=options, value=start_gb, description="my GPU", layout=W.Layout(width="200px")),
                "memsave-target",
            ),
            gb=_classed(
                W.BoundedFloatText(
                    value=start_gb, min=1e-6, max=MAX_GB, step=1.0, description="GB", layout=W.Layout(width="160px")
                ),
                "memsave-target-gb",
            ),
            headroom=_classed(
                W.BoundedFloatText(
                    value=DEFAULT_HEADROOM,
                    min=0.05,
                    max=1.0,
                    step=0.05,
                    description="headroom",
                    layout=W.Layout(width="170px"),
                ),
                "memsave-headroom",
            ),
            device=W.Dropdown(options=list(GPUS), value=device, description="time on", layout=W.Layout(width="200px")),
        )

    def row(self) -> W.HBox:
        return W.HBox([self.menu, self.gb, self.headroom, self.device], layout=W.Layout(flex_flow="row wrap"))


def _menu(description: str, choices: Any) -> W.Dropdown:
    return W.Dropdown(
        options=[("as given", AS_GIVEN)] + [(k, k) for k in choices],
        value=AS_GIVEN,
        description=description,
        layout=W.Layout(width="220px"),
    )


@dataclass
class KnobControls:
    """The workload knobs (memsave_nb.knobs) of the plan on display; 0 / "as given" keeps the
    workload's own. ``show(plan)`` sets them from a plan, ``plan_from(plan)`` reads them back."""

    batch: W.BoundedIntText
    seq: W.BoundedIntText
    precision: W.Dropdown
    optimizer: W.Dropdown
    accumulate: W.BoundedIntText
    zero_grad: W.Dropdown
    loss: W.Dropdown
    apply: W.Button

    @classmethod
    def build(cls) -> "KnobControls":
        from memsave_nb.vocabulary import LOSSES, OPTIMIZERS, PRECISIONS

        small = W.Layout(width="150px")
        knobs = cls(
            batch=W.BoundedIntText(value=0, min=0, max=1 << 20, description="batch", layout=small),
            seq=W.BoundedIntText(value=0, min=0, max=1 << 24, description="seq len", layout=small),
            precision=_menu("precision", PRECISIONS),
            optimizer=_menu("optimizer", OPTIMIZERS),
            accumulate=W.BoundedIntText(value=1, min=1, max=1024, description="accumulate", layout=small),
            zero_grad=W.Dropdown(
                options=ZERO_GRAD_CHOICES, value=AS_GIVEN, description="zero_grad", layout=W.Layout(width="220px")
            ),
            loss=_menu("loss", LOSSES),
            apply=W.Button(description="apply knobs", icon="check", layout=W.Layout(width="120px")),
        )
        for name, w in (
            ("batch", knobs.batch),
            ("seq", knobs.seq),
            ("precision", knobs.precision),
            ("optimizer", knobs.optimizer),
            ("accumulate", knobs.accumulate),
            ("zero-grad", knobs.zero_grad),
            ("loss", knobs.loss),
        ):
            w.add_class(f"memsave-knob-{name}")
        knobs.apply.add_class("memsave-knobs-apply")
        return knobs

    def row(self) -> W.HBox:
        widgets = [self.batch, self.seq, self.precision, self.optimizer, self.accumulate, self.zero_grad, self.loss]
        return W.HBox([*widgets, self.apply], layout=W.Layout(flex_flow="row wrap"))

    def show(self, plan: Plan) -> None:
        """Set every knob control from ``plan``'s knobs."""
        self.batch.value = plan.batch_size or 0
        self.seq.value = plan.seq_len or 0
        self.precision.value = plan.precision or AS_GIVEN
        self.optimizer.value = plan.optimizer or AS_GIVEN
        self.accumulate.value = plan.accumulation_steps or 1
        self.zero_grad.value = {None: AS_GIVEN, True: "none", False: "zero"}[plan.set_to_none]
        self.loss.value = plan.loss or AS_GIVEN

    def plan_from(self, plan: Plan) -> Plan:
        """``plan`` with the knobs the controls show (a bad mix raises the plan's one-line error)."""
        return plan.replace(
            batch_size=self.batch.value or None,
            seq_len=self.seq.value or None,
            precision=self.precision.value or None,
            optimizer=self.optimizer.value or None,
            accumulation_steps=self.accumulate.value if self.accumulate.value > 1 else None,
            set_to_none=_ZERO_GRAD[self.zero_grad.value],
            loss=self.loss.value or None,  # the chunk stays the plan's while the loss is chunked
            loss_chunk=plan.loss_chunk if self.loss.value == "chunked" else None,
        )


@dataclass
class SearchControls:
    """The buttons that start a search and the lines their answers go to."""

    max_batch_button: W.Button
    max_batch_result: W.HTML
    max_seq_button: W.Button
    max_seq_result: W.HTML
    search_button: W.Button

    @classmethod
    def build(cls) -> "SearchControls":
        return cls(
            max_batch_button=_classed(
                W.Button(description="max batch", icon="arrows-v", layout=W.Layout(width="120px")), "memsave-max-batch"
            ),
            max_batch_result=_classed(W.HTML(""), "memsave-max-batch-result"),
            max_seq_button=_classed(
                W.Button(description="max seq len", icon="arrows-h", layout=W.Layout(width="120px")), "memsave-max-seq"
            ),
            max_seq_result=_classed(W.HTML(""), "memsave-max-seq-result"),
            search_button=_classed(
                W.Button(
                    description="find plans that fit",
                    icon="search",
                    button_style="info",
                    layout=W.Layout(width="180px"),
                ),
                "memsave-plan-search",
            ),
        )

    def disable_seq(self, why: str) -> None:
        """The max-seq button stays, greyed, and says why (a workload without token sequences)."""
        self.max_seq_button.disabled = True
        self.max_seq_button.tooltip = why
        self.max_seq_result.value = f"<small style='color:#888'>{html.escape(why)}</small>"


def fit_note() -> W.HTML:
    """What "fits" means, under the scatter."""
    return W.HTML(
        "<small>Fits means the step's allocations, replayed through a model of PyTorch's CUDA caching "
        "allocator, plus the CUDA context stay within the GPU's memory (docs/allocator.md); a step "
        f"without a replay is held to 80% of it ({html.escape(HEADROOM_SOURCE)}). The same test "
        "answers the CLI, the searches and the planner. The planner's points are estimates (under the "
        "GPU less the CUDA context) until re-measured. The planner works in fake mode; click a point, "
        "or <i>load</i> in the list, to load that plan into the explorer.</small>"
    )
