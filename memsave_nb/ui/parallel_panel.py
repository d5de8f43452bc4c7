"""The "GPUs" panel: per-rank memory of the current plan under FSDP2 (with tensor parallel) or DDP on 1 to 1024 GPUs.

It builds a ``ParallelSpec`` from its controls and asks ``memsave_nb.parallel.measure_parallel``
(fake mode, PyTorch's own ``fully_shard`` / ``DistributedDataParallel``) for the per-rank table; it holds no measurement logic.
Changing a control re-sizes on a worker thread (a newer request supersedes an older one).

The result is a picture (``ui/parallel_view.py``): a stacked bar per distinct rank group, the
unseen lines hatched above it, the target GPU's usable line and a verdict (the target is the
"Fit a GPU" tab's, read through ``target_fn``), and a table with units per value.

DOM hooks: ``.memsave-gpus`` (number), ``.memsave-sharding`` (dropdown), ``.memsave-tp`` (tensor
parallel degree), ``.memsave-sp`` (checkbox: sequence parallel), ``.memsave-bf16`` (checkbox), ``.memsave-offload`` (checkbox: FSDP2 CPU offload), ``.memsave-parallel-size`` (button), ``.memsave-parallel-peak`` (worst rank),
``.memsave-parallel-verdict`` (fits / does not fit), ``.memsave-parallel-figure`` (the bars),
``.memsave-parallel-table`` (the table), ``.memsave-parallel-error``, ``.memsave-parallel-timeline``
(a replayed rank's allocated and reserved bytes over its step, ``ui/rank_timeline.py``) and
``.memsave-parallel-timeline-rank`` (which rank it shows; the deciding rank first).
"""

from __future__ import annotations

import html
import threading
from typing import Any, Callable

import ipywidgets as W

from memsave_nb.parallel import ParallelError, ParallelSpec, measure_parallel
from memsave_nb.target import Target

from .format import format_bytes
from .layout_panel import LayoutFinder
from .parallel_view import rank_figure, table_html, verdict_html
from .plots import bokeh_widget
from .rank_timeline import deciding_index, rank_choices, rank_timeline, show_rank

SHARDINGS = (
    ("FSDP2: fully_shard per block + root", "fsdp"),
    ("FSDP2, keep gathered params after forward", "fsdp-keep"),
    ("HSDP: 2 replica groups", "hsdp"),
    ("DDP: replicate, gradient buckets", "ddp"),
    ("DDP, gradients as bucket views", "ddp-view"),
)
MAX_GPUS = 1024
TP_DEGREES = (1, 2, 4, 8)  # within a node of 8


def spec_for(
    gpus: int, sharding: str, bf16: bool, offload: bool = False, tp: int = 1, sequence_parallel: bool = False
) -> ParallelSpec:
    """The ``ParallelSpec`` the controls describe (HSDP needs an even number of GPUs; TP combines with FSDP2)."""
    kw: dict[str, Any] = {"world_size": gpus}
    if tp > 1 or sequence_parallel:
        if sharding in ("ddp", "ddp-view"):
            raise ParallelError("tensor parallel combines with FSDP2 (as torchtitan does): pick an FSDP2 sharding")
        kw.update(tensor_parallel=tp, sequence_parallel=sequence_parallel)
    if offload:
        if sharding in ("ddp", "ddp-view"):
            raise ParallelError("CPU offload is FSDP2's CPUOffloadPolicy: pick an FSDP2 sharding")
        kw["cpu_offload"] = True
    if sharding == "fsdp-keep":
        kw["reshard_after_forward"] = False
    elif sharding == "hsdp":
        kw["replicate"] = 2
    elif sharding in ("ddp", "ddp-view"):
        if bf16:
            raise ParallelError(
                "bf16 params with fp32 reduce is FSDP2's MixedPrecisionPolicy; for DDP set the plan's precision instead"
            )
        return ParallelSpec(strategy="ddp", gradient_as_bucket_view=sharding == "ddp-view", **kw)
    if bf16:
        kw.update(param_dtype="bfloat16", reduce_dtype="float32")
    return ParallelSpec(**kw)


class ParallelPanel(W.VBox):
    def __init__(
        self,
        workload: Any,
        plan_fn: Callable[[], Any],
        *,
        live: bool = True,
        target_fn: Callable[[], Target | None] = lambda: None,
    ):
        self.workload = workload
        self._plan_fn = plan_fn
        self._target_fn = target_fn
        self.live = live
        self.gpus = W.BoundedIntText(value=8, min=1, max=MAX_GPUS, description="GPUs", layout=W.Layout(width="160px"))
        self.gpus.add_class("memsave-gpus")
        self.sharding = W.Dropdown(
            options=SHARDINGS, value="fsdp", description="sharding", layout=W.Layout(width="380px")
        )
        self.sharding.add_class("memsave-sharding")
        self.tp = W.Dropdown(
            options=[(f"TP {d}" if d > 1 else "no TP", d) for d in TP_DEGREES],
            value=1,
            description="tensor parallel",
            layout=W.Layout(width="220px"),
            style={"description_width": "initial"},
        )
        self.tp.add_class("memsave-tp")
        self.sp = W.Checkbox(value=False, description="sequence parallel", indent=False)
        self.sp.add_class("memsave-sp")
        self.bf16 = W.Checkbox(value=False, description="bf16 params, fp32 reduce", indent=False)
        self.bf16.add_class("memsave-bf16")
        self.offload = W.Checkbox(
            value=False, description="CPU offload (params, grads, optimizer on host)", indent=False
        )
        self.offload.add_class("memsave-offload")
        self.size_button = W.Button(description="size per rank", icon="server", button_style="info")
        self.size_button.add_class("memsave-parallel-size")
        self.peak = W.HTML()
        self.peak.add_class("memsave-parallel-peak")
        self.verdict = W.HTML()
        self.verdict.add_class("memsave-parallel-verdict")
        self.figure_box = W.Box([], layout=W.Layout(width="100%"))
        self.figure_box.add_class("memsave-parallel-figure")
        self.figure = None  # the Bokeh figure of the last result
        self.timeline_rank = W.Dropdown(
            options=[], description="timeline of", layout=W.Layout(width="320px", display="none")
        )
        self.timeline_rank.add_class("memsave-parallel-timeline-rank")
        self.timeline_box = W.Box([], layout=W.Layout(width="100%"))
        self.timeline_box.add_class("memsave-parallel-timeline")
        self.timeline = None  # the rank timeline's Plot of the last result (None: no rank replayed)
        self._timeline_result: Any = None
        self._quiet = False  # the selector being refilled: its changes are not a user's pick
        self.table = W.HTML(layout=W.Layout(width="100%", min_width="0"))
        self.table.add_class("memsave-parallel-table")
        self.error = W.HTML()
        self.error.add_class("memsave-parallel-error")
        self.result = None
        self._generation = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.layouts = LayoutFinder(workload, lambda: self.gpus.value, target_fn, plan_fn)
        layouts_title = W.HTML(
            "<b>Which layout for these GPUs?</b> <small>Starting from the current plan (its freezing, "
            "layers, loss, optimizer; its checkpointing and precision if set), the layout planner sizes "
            "each layout per rank (on the model cut to 3 and 4 blocks, extrapolated) and ranks what fits "
            "by estimated step time; the chosen one is re-measured at full depth.</small>"
        )
        note = W.HTML(
            "<small>Per-rank memory in fake mode with PyTorch's own <code>fully_shard</code> "
            "(and <code>parallelize_module</code> for tensor parallel) or DDP "
            "on a fake process group; the plan's freezing and checkpointing apply.</small>"
        )
        super().__init__(
            [
                note,
                W.HBox(
                    [self.gpus, self.sharding, self.tp, self.sp, self.bf16, self.offload, self.size_button],
                    layout=W.Layout(flex_flow="row wrap"),
                ),
                self.peak,
                self.verdict,
                self.error,
                self.figure_box,
                self.timeline_rank,
                self.timeline_box,
                self.table,
                layouts_title,
                self.layouts,
            ]
        )
        for w in (self.gpus, self.sharding, self.tp, self.sp, self.bf16, self.offload):
            w.observe(lambda _ch: self._changed(), "value")
        self.size_button.on_click(lambda _b: self.refresh(background=True))
        self.timeline_rank.observe(lambda _ch: self._show_timeline_rank(), "value")

    def spec(self) -> ParallelSpec:
        return spec_for(
            self.gpus.value, self.sharding.value, self.bf16.value, self.offload.value, self.tp.value, self.sp.value
        )

    def _changed(self) -> None:
        if self.live:
            self.refresh(background=True)

    def wait(self, timeout: float | None = None) -> None:
        t = self._thread
        if t is not None:
            t.join(timeout)

    def refresh(self, *, background: bool = False) -> None:
        """Size the current plan per rank (on a worker thread with ``background=True``)."""
        with self._lock:
            self._generation += 1
            generation = self._generation
        if background:
            self.peak.value = "<i>sizing...</i>"
            self._thread = threading.Thread(target=self._job, args=(generation,), daemon=True)
            self._thread.start()
        else:
            self._job(generation)

    def _job(self, generation: int) -> None:
        try:
            spec = self.spec()
            result = measure_parallel(self.workload, spec, self._plan_fn())
        except Exception as exc:  # noqa: BLE001 - shown in the panel, never printed
            if generation == self._generation:
                self.error.value = f"<span style='color:#b00'>{html.escape(' '.join(str(exc).split()))}</span>"
                # nothing of an older result stays under a new error
                self.result = None
                self.peak.value = self.verdict.value = self.table.value = ""
                self.figure_box.children = []
                self.figure = None
                self._clear_timeline()
            return
        if generation != self._generation:  # a newer request superseded this one
            return
        self.result = result
        self.error.value = ""
        counted = result.device_peak_bytes
        where, host = "", ""
        if result.host_peak_bytes is not None:
            where = " on the GPU"
            host = f"; host memory {format_bytes(result.host_peak_bytes)} per rank"
        self.peak.value = (
            f"<b>worst rank {result.worst.rank}: {format_bytes(counted)} counted{where}</b>, "
            f"up to {format_bytes(counted + result.unseen_high_bytes)} with the unseen lines{host} "
            f"({html.escape(spec.describe())})"
        )
        self.table.value = table_html(result)
        self.show_target()

    def show_target(self) -> None:
        """The verdict and the usable line for the current target (a new target redraws them)."""
        result = self.result
        if result is None:
            return
        target = self._target_fn()
        self.verdict.value = verdict_html(result, target)
        self.figure = rank_figure(result, target)
        self.figure_box.children = [bokeh_widget(self.figure)]
        self._show_timeline(result, target)

    def _show_timeline(self, result: Any, target: Target | None) -> None:
        """The deciding rank's allocated / reserved timeline, the selector listing every replayed rank."""
        index = deciding_index(result, target)
        if index is None:  # no replay (the cross-check's rebuilt ranks, shallow twins): nothing to draw
            self._clear_timeline()
            return
        self.timeline = rank_timeline(result, index, target)
        self._timeline_result = result
        self._quiet = True
        try:
            self.timeline_rank.options = rank_choices(result)
            self.timeline_rank.value = index
        finally:
            self._quiet = False
        self.timeline_rank.layout.display = "" if len(self.timeline_rank.options) > 1 else "none"
        self.timeline_box.children = [bokeh_widget(self.timeline.figure)]

    def _show_timeline_rank(self) -> None:
        if not self._quiet and self.timeline is not None and self.timeline_rank.value is not None:
            show_rank(self.timeline, self._timeline_result, self.timeline_rank.value)

    def _clear_timeline(self) -> None:
        self.timeline = None
        self.timeline_box.children = []
        self.timeline_rank.layout.display = "none"
