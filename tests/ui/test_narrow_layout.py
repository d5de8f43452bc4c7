"""The explorer in a narrow (700 px) notebook, as the widgets and styles describe it (issue 28,
item 9); tests/browser/test_narrow_lab.py checks the same in a real JupyterLab page."""

from __future__ import annotations

import re

import pytest

from memsave_nb import zoo
from memsave_nb.session import Session
from memsave_nb.ui.explorer import Explorer
from memsave_nb.ui.layer_table import NAME_CELL_WIDTH, TABLE_CSS
from memsave_nb.ui.plots import MIN_FIGURE_WIDTH, BokehFigure, fit_width
from memsave_nb.ui.styles import EXPLORER_CSS

pytestmark = pytest.mark.timeout(300)


def walk(widget):
    yield widget
    for child in getattr(widget, "children", ()) or ():
        yield from walk(child)


def _rules(css: str, selector_part: str) -> str:
    """The declarations of every rule whose selector contains ``selector_part``."""
    return " ".join(body for sel, body in re.findall(r"([^{}]+)\{([^}]*)\}", css) if selector_part in sel)


@pytest.fixture(scope="module")
def cnn():
    return Explorer(Session(zoo.make("cnn", 2), repeats=0), debounce_s=0.05, live=False)


def test_the_name_column_is_one_sticky_cell_and_only_the_table_scrolls_sideways(cnn):
    row = cnn.table.row("layers.0")
    first = row.box.children[0]
    assert first is row.name_cell and list(first.children) == [row.expand, row.select]
    assert "memsave-name-cell" in first._dom_classes and first.layout.width == f"{NAME_CELL_WIDTH}px"
    head = cnn.table.header.children[0]
    assert "memsave-name-cell" in head._dom_classes and head.layout.width == f"{NAME_CELL_WIDTH}px"
    sticky = _rules(TABLE_CSS, ".memsave-name-cell")
    assert "position: sticky" in sticky and "left: 0" in sticky and "background:" in sticky
    # rows and the header are as wide as their content and do not scroll by themselves (an
    # ipywidgets box scrolls by default: each row was its own hidden scroller at 700 px)
    rows = _rules(TABLE_CSS, ".memsave-layer-table .memsave-row")
    assert "min-width: max-content" in rows and "overflow: visible" in rows
    assert re.search(r"\.memsave-layer-table \{ overflow-x: auto;", TABLE_CSS)
    assert cnn.table.layout.overflow == "auto hidden" and cnn.table.layout.max_width == "100%"


def test_tab_titles_keep_their_width_and_the_bar_wraps(cnn):
    style = [w for w in cnn.children if "memsave-explorer-style" in getattr(w, "_dom_classes", ())]
    assert len(style) == 1 and style[0].value == EXPLORER_CSS and style[0].layout.display == "none"
    assert "flex: 0 0 auto" in _rules(EXPLORER_CSS, ".lm-TabBar-tab ")
    assert "flex-wrap: wrap" in _rules(EXPLORER_CSS, ".lm-TabBar-content")
    body = EXPLORER_CSS.removeprefix("<style>").removesuffix("</style>")
    selectors = [rule.split("{")[0].strip() for rule in body.split("}") if "{" in rule]
    assert len(selectors) == 3 and all(sel.startswith(".memsave-explorer ") for sel in selectors)  # scoped


def test_every_figure_follows_the_container_between_a_floor_and_its_built_width(cnn):
    figs = [w for w in walk(cnn) if isinstance(w, BokehFigure)]
    assert len(figs) == 6
    for f in figs:
        fig = f.model._model  # the Bokeh figure inside jupyter_bokeh's widget
        lay = f.layout
        assert lay.width == "100%" and lay.flex == "1 1 auto"
        widest = int(lay.max_width.removesuffix("px"))
        assert lay.min_width == f"{min(MIN_FIGURE_WIDTH, widest)}px" and widest >= 500
        assert fig.sizing_mode == "stretch_width" and fig.max_width == widest
    # the Results tab's history plot goes under its table when the row is too narrow for both
    history_row = next(w for w in walk(cnn.results) if getattr(w, "children", None) and cnn.results.table in w.children)
    assert history_row.layout.flex_flow == "row wrap"


def test_fit_width_keeps_the_built_width_as_the_maximum():
    from bokeh.plotting import figure

    fig = figure(width=760, height=200)
    assert fit_width(fig) == (MIN_FIGURE_WIDTH, 760)
    assert fig.sizing_mode == "stretch_width" and (fig.min_width, fig.max_width) == (MIN_FIGURE_WIDTH, 760)
    small = figure(width=240, height=200)
    assert fit_width(small) == (240, 240)  # never stretched past what it was built for


def test_legends_of_the_categories_take_two_rows_and_the_zoom_buttons_keep_their_words(cnn):
    # one horizontal row of seven entries is ~640 px: cut at the right edge of a narrowed figure
    for plot in (cnn.results.peak_plot, cnn.results.timeline_plot):
        (legend,) = plot.figure.below[-1:]
        assert legend.nrows == 2 and legend.orientation == "horizontal"
        # the categories, and on the timeline the allocator model's reserved line
        assert len(legend.items) == (8 if plot is cnn.results.timeline_plot else 7)
    # the peak split's labels ("11.9 MiB (backward)") have room right of the longest bar
    assert cnn.results.peak_plot.figure.x_range.range_padding >= 0.8
    assert cnn.results.zoom.style.button_width == "110px"  # "whole step" was cut at 90 px
