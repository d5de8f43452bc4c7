"""Bokeh figures inside ipywidgets layouts, with BokehJS carried by the widgets themselves (offline).

Figures go into layouts through :class:`jupyter_bokeh.BokehModel`; they are refreshed by
replacing ``ColumnDataSource.data`` (never ``push_notebook``, which breaks inside Output widgets
and Voila). BokehJS comes from the installed bokeh package (inline), never from the CDN: with no
network the CDN default makes the whole widget vanish.

Where BokehJS comes from. ``jupyter_bokeh``'s front end needs ``window.Bokeh`` the moment a
figure's view is made (``Bokeh.require`` in its constructor); it does not load BokehJS itself. A
cell output made by ``output_notebook()`` loads it once, in the page that ran that cell: a reloaded
tab, a second page (Voila, a colleague's view) or a Run All on a kernel that already published it
never gets it, and every figure shows "Cannot read properties of undefined (reading 'require')".
So every figure widget here is a small box whose first child is :func:`bokehjs_loader`: one
``Output`` widget per kernel holding a trusted ``application/javascript`` output that defines
``window.Bokeh`` from the inline bundle unless the page already has this version. Widget views are
made from the kernel's state on every page that shows them, children in order, and the output is
evaluated when its view renders, before the figure's own view is constructed; the script is in
the widget's state once per kernel (about 4 MB), whatever the number of figures.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import ipywidgets as W

_loader_lock = threading.Lock()
_loader: W.Output | None = None
_script: str | None = None


def in_kernel() -> bool:
    """True inside a Jupyter kernel (where display() reaches a front end)."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def bokehjs_script() -> str:
    """JavaScript that defines ``window.Bokeh`` from the installed bokeh's inline bundle, unless
    the page already has BokehJS of the same version (then it does nothing)."""
    global _script
    if _script is None:
        import bokeh
        from bokeh.resources import INLINE

        chunks = ",\n".join(f"function(Bokeh) {{\n{js}\n}}" for js in INLINE.js_raw)
        _script = (
            "(function(root) {\n"
            f"  const version = {json.dumps(bokeh.__version__)};\n"
            "  if (root.Bokeh !== undefined && root.Bokeh.require !== undefined && root.Bokeh.version === version) return;\n"
            f"  const chunks = [\n{chunks}\n  ];\n"
            "  for (const chunk of chunks) chunk.call(root, root.Bokeh);\n"
            "  root.memsave_bokehjs_loaded = (root.memsave_bokehjs_loaded || 0) + 1;\n"
            "})(window);\n"
        )
    return _script


def bokehjs_loader() -> W.Output:
    """The kernel's one BokehJS-carrying ``Output`` widget (hidden; put it before any figure)."""
    global _loader
    with _loader_lock:
        if _loader is None or getattr(_loader, "comm", None) is None:  # none yet, or closed
            out = W.Output(layout=W.Layout(display="none"))
            out.add_class("memsave-bokehjs")
            out.outputs = (
                {
                    "output_type": "display_data",
                    "data": {"application/javascript": bokehjs_script(), "text/plain": "BokehJS (inline)"},
                    "metadata": {},
                },
            )
            _loader = out
        return _loader


def load_bokehjs(force: bool = False) -> bool:
    """Publish BokehJS inline as a cell output (for notebooks that ``bokeh.io.show`` figures).

    Published on every call, not once per kernel: the page that runs the cell may be a reloaded
    tab that lost the BokehJS an earlier run published. True when it was published.
    """
    if not (force or in_kernel()):
        return False
    from bokeh.io import output_notebook
    from bokeh.resources import INLINE

    output_notebook(INLINE, hide_banner=True)
    return True


#: the narrowest a figure gets: below this its axis labels and legend no longer read
MIN_FIGURE_WIDTH = 300


def fit_width(fig: Any, min_width: int = MIN_FIGURE_WIDTH) -> tuple[int, int]:
    """Let ``fig`` follow its container's width, between ``min_width`` and the width it was built
    with (a 760 px figure in a 700 px notebook was clipped); returns (min, max) in px."""
    widest = int(fig.width or fig.min_width or min_width)
    if "sizing_mode" in fig.properties():
        fig.sizing_mode = "stretch_width"
        fig.min_width, fig.max_width = min(min_width, widest), widest
    return min(min_width, widest), widest


class BokehFigure(W.Box):
    """A Bokeh figure as a widget: the BokehJS loader, then :class:`jupyter_bokeh.BokehModel`.

    The figure stretches with the output area (see :func:`fit_width`), the box keeping the same
    bounds so a row of widgets gives it the room left. ``.model`` is the BokehModel; the figure's
    sources stay live (update ``source.data``)."""

    def __init__(self, fig: Any):
        from jupyter_bokeh import BokehModel

        narrowest, widest = fit_width(fig)
        self.model = BokehModel(fig)
        self.model.add_class("memsave-bokeh-figure")
        super().__init__(
            [bokehjs_loader(), self.model],
            layout=W.Layout(
                display="block", width="100%", min_width=f"{narrowest}px", max_width=f"{widest}px", flex="1 1 auto"
            ),
        )
        self.add_class("memsave-bokeh")


# Lab's dark theme marks the page (body[data-jp-theme-light="false"]); a Bokeh figure is drawn on
# a canvas with its own colours, white unless told otherwise. This runs in the page when the figure
# is first laid out (its inner_width is set then) and restyles it dark once. Voila's dark theme
# sets the same attribute.
DARK_THEME_JS = """
const dark = document.body && document.body.dataset && document.body.dataset.jpThemeLight === "false";
if (!dark || cb_obj.tags.includes("memsave-dark")) return;
cb_obj.tags = [...cb_obj.tags, "memsave-dark"];
cb_obj.background_fill_color = "#1b1b1b";
cb_obj.border_fill_color = "#111111";
cb_obj.outline_line_color = "#555555";
if (cb_obj.title) cb_obj.title.text_color = "#e0e0e0";
for (const m of [...cb_obj.left, ...cb_obj.right, ...cb_obj.above, ...cb_obj.below, ...cb_obj.center]) {
  if ("major_label_text_color" in m) {
    m.major_label_text_color = "#cccccc"; m.axis_label_text_color = "#cccccc";
    m.axis_line_color = "#888888"; m.major_tick_line_color = "#888888"; m.minor_tick_line_color = "#666666";
  } else if ("grid_line_color" in m) {
    m.grid_line_color = "#333333";
  } else if ("label_text_color" in m) {
    m.label_text_color = "#dddddd"; m.background_fill_color = "#1b1b1b"; m.border_line_color = "#555555";
  }
}
"""


def follow_theme(fig: Any) -> Any:
    """Make ``fig`` turn dark in a page with a dark Lab / Voila theme (see ``DARK_THEME_JS``)."""
    from bokeh.models import CustomJS

    if not hasattr(fig, "js_on_change") or "inner_width" not in fig.properties():
        return fig
    if not any(
        getattr(cb, "code", None) == DARK_THEME_JS for cb in fig.js_property_callbacks.get("change:inner_width", [])
    ):
        fig.js_on_change("inner_width", CustomJS(code=DARK_THEME_JS))
    return fig


def bokeh_widget(fig: Any) -> BokehFigure:
    """A widget showing a Bokeh figure, BokehJS included (see the module's docstring); the figure
    follows a dark page theme."""
    return BokehFigure(follow_theme(fig))
