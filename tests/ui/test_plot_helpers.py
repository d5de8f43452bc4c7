"""The hover / tap / pan-zoom setup the history, budget-sweep and planner figures share
(``ui/plot_base.py``, issue 39): each clickable scatter has exactly one tap tool and one hover, both
bound to its points and nothing else, with the same tooltips as before the helpers existed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from bokeh.models import DataRange1d, HoverTool, TapTool

from memsave_nb import measure, zoo
from memsave_nb.plan import Plan
from memsave_nb.planner import Candidate
from memsave_nb.ui import figures as F
from memsave_nb.ui.pareto_figure import pareto


@pytest.fixture(scope="module")
def mlp():
    return measure(zoo.make("mlp"), mode="fake")


def _tools(fig, kind):
    return [t for t in fig.tools if isinstance(t, kind)]


def _one_pickable(fig, points_name):
    points = fig.select_one({"name": points_name})
    taps, hovers = _tools(fig, TapTool), _tools(fig, HoverTool)
    assert len(taps) == 1 and len(hovers) == 1
    assert list(taps[0].renderers) == [points] and list(hovers[0].renderers) == [points]
    assert fig.toolbar_location == "above"
    assert {type(t).__name__ for t in fig.tools} >= {"PanTool", "WheelZoomTool", "BoxZoomTool", "SaveTool"}
    return [label for label, _ in hovers[0].tooltips]


def test_history_and_pareto_points_are_clicked_and_hovered_the_same_way(mlp):
    history = F.history([SimpleNamespace(plan=None, measurement=mlp)])
    assert _one_pickable(history.figure, "history_points") == ["plan", "peak", "saved", "step"]
    assert history.figure.x_range.range_padding == 0.15

    c = Candidate(Plan(), "as given, as given", 5 * 2**20, 0.002, True)
    plot = pareto([c], [c], 4 * 2**20)
    assert _one_pickable(plot.figure, "pareto_points") == ["plan", "config", "peak", "step", "plans here", ""]
    assert isinstance(plot.figure.y_range, DataRange1d) and plot.figure.y_range.range_padding == 0.1
    assert plot.figure.legend[0].location == "top_right" and plot.figure.legend[0].background_fill_alpha == 0.4


def test_budget_sweep_hovers_both_series_and_keeps_its_y_axis_at_zero(mlp):
    plot = F.budget_sweep([SimpleNamespace(plan=SimpleNamespace(compile_budget=0.5), measurement=mlp)])
    fig = plot.figure
    (hover,) = _tools(fig, HoverTool)
    assert [r.name for r in hover.renderers] == ["sweep_peak", "sweep_saved"]
    assert not _tools(fig, TapTool)  # a sweep point is read, not picked
    assert fig.y_range.start == 0
    assert fig.legend[0] in fig.below  # the legend under the plot, never over the data
