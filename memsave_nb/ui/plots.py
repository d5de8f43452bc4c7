"""Bokeh figures inside ipywidgets layouts, with BokehJS loaded inline (works offline).

Figures go into layouts through :class:`jupyter_bokeh.BokehModel`; they are refreshed by
replacing ``ColumnDataSource.data`` (never ``push_notebook``, which breaks inside Output widgets
and Voila). BokehJS comes from the installed bokeh package (``INLINE``), not from the CDN: with
no network the CDN default makes the whole widget vanish.
"""

from __future__ import annotations

import threading
from typing import Any

import ipywidgets as W

_loaded_lock = threading.Lock()
_loaded_for: Any = None


def in_kernel() -> bool:
    """True inside a Jupyter kernel (where display() reaches a front end)."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def load_bokehjs(force: bool = False) -> bool:
    """Publish BokehJS inline once per kernel, before the first figure is shown. True when it
    was published now."""
    global _loaded_for
    if not (force or in_kernel()):
        return False
    from IPython import get_ipython

    ip = get_ipython()
    with _loaded_lock:
        if _loaded_for is ip and not force:
            return False
        from bokeh.io import output_notebook
        from bokeh.resources import INLINE

        output_notebook(INLINE, hide_banner=True)
        _loaded_for = ip
        return True


def bokeh_widget(fig: Any) -> W.DOMWidget:
    """A widget showing a Bokeh figure; its sources stay live (update ``source.data``)."""
    from jupyter_bokeh import BokehModel

    widget = BokehModel(fig)
    widget.add_class("memsave-bokeh")
    return widget
