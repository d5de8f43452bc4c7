"""The small interface the "Fit a GPU" panel is handed (``ui/tuner_panel.py``): the explorer
satisfies it, the panel never imports the explorer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

from memsave_nb.target import Target

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.measure import Measurement
    from memsave_nb.plan import Plan


class TunerHost(Protocol):
    """What the panel is handed: the explorer satisfies it (the panel never imports the explorer),
    and so may any object a test builds."""

    session: Any  # .workload: the workload the panel sizes
    editor: Any  # .on_change(callback): the plan was loaded or edited
    _ui_lock: Any  # held while the panel reads and writes shared widgets
    target: Target | None

    @property
    def plan(self) -> "Plan": ...

    @property
    def measurement(self) -> "Measurement": ...

    def set_plan(self, plan: "Plan") -> None: ...

    def set_target(self, target: Target | None) -> None: ...

    def set_max_batch(self, plan: "Plan", target: Target, value: int | None) -> None: ...

    def max_batch_shown(self) -> int | None: ...

    def on_result(self, callback: Callable[[Any], None]) -> None: ...
