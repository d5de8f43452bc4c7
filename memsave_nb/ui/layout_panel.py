"""The GPUs tab's "find a layout" row: the layout planner (``planner.plan_layout``) over the tab's
GPU count and a GPU kind, under the Fit-a-GPU target, on a worker thread.

It shows the planner's picture (``parallel_view.layout_figure``: every candidate, the front, the
chosen one, the usable line), the front as a table, the chosen layout in words with its per-rank
re-measurement, and its code. It holds no search logic; a newer search supersedes an older one.
The search starts from the explorer's current plan (``plan_fn``; ``planner/start_plan.py``): its
freezing, memory-saving layers, loss, optimizer and batch are kept on every candidate, and so are
its checkpointing and precision when it sets them (else the planner chooses them); the status line
says what was kept. The layout and the micro-batches are the planner's own choices.

Pipeline stages (``pipeline_parallel``): *auto* searches them only when no layout without them
fits; *also try 2, 4, 8* compares them with the rest; *only 2, 4, 8* searches pipelines alone;
*off* never. The chosen layout's re-measurement per rank (each stage's peak under a pipeline) is
the GPUs tab's per-rank table (``parallel_view.table_html``).

DOM hooks: ``.memsave-layout-gpu`` (GPU kind), ``.memsave-layout-stages`` (pipeline stages),
``.memsave-layout-find`` (button), ``.memsave-layout-status``, ``.memsave-layout-figure``,
``.memsave-layout-front`` (table, from ``layout_front_html``), ``.memsave-layout-ranks`` (the
chosen layout per rank), ``.memsave-layout-code``.
"""

from __future__ import annotations

import html
import threading
from typing import Any, Callable

import ipywidgets as W

from memsave_nb.errors import MemsaveError
from memsave_nb.planner import LayoutResult, plan_layout
from memsave_nb.planner.roofline import GPUS
from memsave_nb.target import Target

from .parallel_view import layout_figure, layout_front_html, table_html
from .plots import bokeh_widget


# the pipeline-stages choice: its words and the planner's pipeline_parallel
STAGES = (("auto", None), ("also try 2, 4, 8", (1, 2, 4, 8)), ("only 2, 4, 8", (2, 4, 8)), ("off", (1,)))


class LayoutFinder(W.VBox):
    def __init__(
        self,
        workload: Any,
        gpus_fn: Callable[[], int],
        target_fn: Callable[[], Target | None] = lambda: None,
        plan_fn: Callable[[], Any] = lambda: None,
    ):
        self.workload = workload
        self._plan_fn = plan_fn
        self._gpus_fn = gpus_fn
        self._target_fn = target_fn
        self.gpu = W.Dropdown(
            options=list(GPUS),
            value="H100",
            description="GPU kind",
            layout=W.Layout(width="200px"),
            style={"description_width": "initial"},
        )
        self.gpu.add_class("memsave-layout-gpu")
        self.stages = W.Dropdown(
            options=[words for words, _ in STAGES],
            value="auto",
            description="pipeline stages",
            layout=W.Layout(width="240px"),
            style={"description_width": "initial"},
            tooltip="auto: searched only when no layout without stages fits",
        )
        self.stages.add_class("memsave-layout-stages")
        self.find_button = W.Button(
            description="find a layout",
            icon="search",
            button_style="info",
            tooltip="search DDP, FSDP2, HSDP, TP x FSDP2, checkpointing and micro-batches; "
            "rank what fits by estimated step time",
        )
        self.find_button.add_class("memsave-layout-find")
        self.status = W.HTML()
        self.status.add_class("memsave-layout-status")
        self.figure_box = W.Box([], layout=W.Layout(width="100%"))
        self.figure_box.add_class("memsave-layout-figure")
        self.front = W.HTML(layout=W.Layout(width="100%", min_width="0", overflow="auto"))
        self.ranks = W.HTML(layout=W.Layout(width="100%", min_width="0", overflow="auto"))
        self.ranks.add_class("memsave-layout-ranks")
        self.code = W.Textarea(layout=W.Layout(width="100%", height="160px", display="none"))
        self.code.add_class("memsave-layout-code")
        self.result: LayoutResult | None = None
        self._generation = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.find_button.on_click(lambda _b: self.find(background=True))
        super().__init__(
            [
                W.HBox([self.gpu, self.stages, self.find_button], layout=W.Layout(flex_flow="row wrap")),
                self.status,
                self.figure_box,
                self.front,
                self.ranks,
                self.code,
            ]
        )

    def wait(self, timeout: float | None = None) -> None:
        t = self._thread
        if t is not None:
            t.join(timeout)

    def find(self, *, background: bool = False) -> None:
        """Search layouts for the tab's GPU count and this GPU kind (on a worker thread with ``background``)."""
        with self._lock:
            self._generation += 1
            generation = self._generation
        gpus, kind, plan = self._gpus_fn(), self.gpu.value, self._plan_fn()
        stages = dict(STAGES)[self.stages.value]
        self.status.value = (
            f"<i>searching layouts over {gpus} x {html.escape(kind)}{html.escape(_from_words(plan))}...</i>"
        )
        if background:
            self._thread = threading.Thread(target=self._job, args=(generation, gpus, kind, plan, stages), daemon=True)
            self._thread.start()
        else:
            self._job(generation, gpus, kind, plan, stages)

    def _job(self, generation: int, gpus: int, kind: str, plan: Any = None, stages: Any = None) -> None:
        try:
            result = plan_layout(self.workload, gpus, kind, self._target_fn(), plan=plan, pipeline_parallel=stages)
        except Exception as exc:  # noqa: BLE001 - shown in the panel, never printed
            if generation == self._generation:
                self.result = None
                self.status.value = f"<span style='color:#b00'>{html.escape(' '.join(str(exc).split()))}</span>"
                self.figure_box.children = []
                self.front.value = self.ranks.value = ""
                self.code.value, self.code.layout.display = "", "none"
            return
        if generation != self._generation:  # a newer search superseded this one
            return
        self.result = result
        lines = result.summary().splitlines()[:3] + [
            f"starting from the explorer's plan{_from_words(plan) or ' (empty)'}"
        ]
        # why layouts were left out (a layout the model cannot take, stages not searched): said, not hidden
        dropped = [f"note: {n}" for n in result.notes if _left_out(n)]
        self.status.value = "<br>".join(
            ("<b>" + html.escape(line) + "</b>") if line.startswith("chosen") else html.escape(line) for line in lines
        ) + "".join(f"<br><small>{html.escape(n)}</small>" for n in dropped)
        self.figure_box.children = [bokeh_widget(layout_figure(result))]
        self.front.value = layout_front_html(result)
        self.ranks.value = (
            ""
            if result.remeasured is None
            else ("<small>The chosen layout measured per rank at full depth:</small>" + table_html(result.remeasured))
        )
        if result.chosen is not None:
            try:
                code = result.to_code()
            except MemsaveError as exc:  # a layout to_code cannot write yet: said in its place
                code = f"# not written as code: {' '.join(str(exc).split())}"
            self.code.value, self.code.layout.display = code, None
        else:
            self.code.value, self.code.layout.display = "", "none"


# the planner's notes that say why a layout or a stage count was left out (the rest describe the search)
_LEFT_OUT = ("skipped (", "not searched", "do not both split", "does not split over", "micro-batches")


def _left_out(note: str) -> bool:
    return any(words in note for words in _LEFT_OUT)


def _from_words(plan: Any) -> str:
    """What the search keeps from the explorer's plan, as a clause (" (kept: ...)"; "" for none)."""
    if plan is None:
        return ""
    words = plan.replace(parallel=None).describe() if hasattr(plan, "replace") else ""
    return f" (kept: {words})" if words and words != "baseline (no changes)" else ""
