"""What every figure shares: the categories' colours, the :class:`Plot` bundle a builder returns,
the bytes axis, and the hover / tap / legend / pan-zoom setup the figures would otherwise each
repeat. Below every ``*_figure(s).py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from bokeh.models import ColumnDataSource, CustomJSTickFormatter, DataRange1d, HoverTool, TapTool
from bokeh.plotting import figure

from ..measure.result import Measurement
from .format import BYTES_TICK_JS

CATEGORY_COLORS = {
    "parameters": "#4c78a8",
    "inputs": "#9ecae9",
    "gradients": "#f58518",
    "optimizer_state": "#e45756",
    "activations": "#54a24b",
    "temporaries": "#b279a2",
    "outputs": "#a0d98f",  # outputs and caches the step keeps (not saved for backward)
}


def category_color(category: str) -> str:
    """The colour of a peak/timeline category (grey for one this module does not know yet)."""
    return CATEGORY_COLORS.get(category, "#bab0ac")


PHASE_COLORS = {"forward": "#dbe9f6", "backward": "#fde2cf", "optimizer": "#eadff2"}
OTHER_PHASE_COLOR = "#eeeeee"
BAR_COLOR = "#4c78a8"
MORE_COLOR = "#d62728"  # more memory than the baseline
LESS_COLOR = "#2ca02c"  # less memory than the baseline
MAX_TIMELINE_POINTS = 2000
ROOT_LABEL = "(model)"

Data = dict[str, list]


# -- the returned bundle ---------------------------------------------------------------------
@dataclass(eq=False)
class Plot:
    """A figure, its data sources by name (``"main"`` first) and how to refresh them in place."""

    figure: Any
    sources: dict[str, ColumnDataSource]
    data_fn: Callable[..., dict[str, Data]] = field(repr=False)
    after_update: Callable[["Plot", dict[str, Data]], None] | None = field(default=None, repr=False)

    @property
    def source(self) -> ColumnDataSource:
        return self.sources["main"]

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Recompute every source from new results (same arguments as the builder)."""
        datas = self.data_fn(*args, **kwargs)
        for name, data in datas.items():
            self.sources[name].data = data
        if self.after_update is not None:
            self.after_update(self, datas)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.figure, self.source))


def legend_below(fig: Any, rows: int = 1) -> None:
    """Put the legend under the plot (never over the data) in small type; ``rows=2`` for the seven
    categories, so a figure narrowed to a 700 px notebook keeps every entry in view."""
    legend = fig.legend[0]
    legend.orientation = "horizontal"
    legend.label_text_font_size = "8pt"
    if rows > 1:
        legend.nrows = rows
    fig.add_layout(legend, "below")


def legend_corner(fig: Any, location: str = "top_right", alpha: float = 0.4) -> None:
    """Keep the legend inside the plot, see-through, for a scatter whose corner is free."""
    fig.legend.location = location
    fig.legend.background_fill_alpha = alpha


Tooltips = Iterable[tuple[str, str]]


def add_hover(fig: Any, renderers: Iterable[Any], tooltips: Tooltips, **options: Any) -> None:
    """One hover tool over ``renderers`` (``options``: e.g. ``mode="vline"``)."""
    fig.add_tools(HoverTool(renderers=list(renderers), tooltips=list(tooltips), **options))


def add_pick_tools(fig: Any, points: Any, tooltips: Tooltips) -> None:
    """Click and hover on a scatter's points: a click selects (``source.selected.indices`` says which
    point, what the explorer and the tuner listen to) and the hover describes it."""
    fig.add_tools(TapTool(renderers=[points]))
    add_hover(fig, [points], tooltips)


def pan_zoom_figure(
    name: str, title: str, width: int, height: int, padding: float, *, y_start: float | None = None
) -> Any:
    """A scatter's figure: pan and zoom tools above it, both ranges following the data with
    ``padding`` (``y_start=0`` pins the y axis at zero)."""
    y_range = (
        DataRange1d(range_padding=padding) if y_start is None else DataRange1d(start=y_start, range_padding=padding)
    )
    return figure(
        width=width,
        height=height,
        title=title,
        tools="pan,wheel_zoom,box_zoom,save,reset",
        toolbar_location="above",
        x_range=DataRange1d(range_padding=padding),
        y_range=y_range,
        name=name,
    )


def _bytes_axis(axis: Any) -> None:
    axis.formatter = CustomJSTickFormatter(code=BYTES_TICK_JS)


def _measurement(obj: Any) -> Measurement:
    """A Measurement, or something holding one as ``.measurement`` (a session entry)."""
    return obj.measurement if hasattr(obj, "measurement") else obj
