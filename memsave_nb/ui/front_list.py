"""The planner's Pareto front as a list one can read: rows keep their height and the box scrolls
(53 rows in a 380 px box were squeezed to 7 px each), near-duplicates fold under one row, and
the module path every row shares is said once in the heading, not cut off in each row.

Near-duplicates are the same plan at different offload counts (the front holds "offload the first
n blocks" for many n): by default the list shows each group's first (lowest-peak) row with a
"+N like it" note; "show all" shows every row. A front of at most 12 rows is shown whole.

DOM hooks: ``.memsave-front-list`` (the scrolling box), one ``.memsave-front-row`` per front plan
(``.memsave-fits`` / ``.memsave-nofit``, ``.memsave-front-picked``, ``.memsave-front-folded`` when
hidden), ``.memsave-front-text``, ``.memsave-front-load``, ``.memsave-front-all`` (the toggle).
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Callable, Sequence

import ipywidgets as W

from .format import format_bytes
from .pareto_figure import FITS_COLOR, MISS_COLOR

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.planner import Candidate

ROW_HEIGHT = "34px"
FOLD_ABOVE = 12  # a front this short is read whole: a trade-off curve, nothing folded


def group_key(c: "Candidate") -> str:
    """What a front entry is without its offloaded regions: entries sharing it differ only in how
    many blocks they offload."""
    kept = {r: k for r, k in c.plan.active_regions.items() if getattr(k, "kind", k) != "offload"}
    return c.config + "|" + c.plan.replace(regions=kept, name="").to_json()


def shared_prefix(front: Sequence["Candidate"]) -> str:
    """The dotted path every region of the front sits under, up to its container's parent
    (``"base_model.model.model."`` for a LoRA-wrapped Llama): each row drops it, so rows say what
    differs ("offload layers.0-3") instead of all reading "offload base_model.model.model.la…"."""
    parents = [name.split(".")[:-1] for c in front for name in c.plan.active_regions]
    if not parents:
        return ""
    common: list[str] = []
    for parts in zip(*parents):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    common = common[:-1]  # keep the container's own name ("layers")
    return ".".join(common) + "." if common else ""


def row_label(c: "Candidate", prefix: str) -> str:
    """``c.label`` without the front's shared prefix (only where a region name starts with it)."""
    if not prefix:
        return c.label
    return " ".join(w[len(prefix) :] if w.startswith(prefix) else w for w in c.label.split(" "))


def groups(front: Sequence["Candidate"]) -> list[int]:
    """For each front entry, the position of the first entry of its group."""
    first: dict[str, int] = {}
    return [first.setdefault(group_key(c), k) for k, c in enumerate(front)]


class FrontList(W.VBox):
    """One row per front plan (``rows[k]`` is ``front[k]``), each with a "load" button."""

    def __init__(self, on_load: Callable[[int], None]):
        self.on_load = on_load
        self.rows: list[W.HBox] = []
        self.leaders: list[int] = []
        self.show_all = W.ToggleButton(
            value=False,
            description="show all",
            layout=W.Layout(width="auto", flex="0 0 auto"),
            tooltip="show every plan of the front, near-duplicates too",
        )
        self.show_all.add_class("memsave-front-all")

        def refold(_change: object) -> None:  # "show all" flipped: fold again, then redraw
            self._fold()
            self.show(self._front, self._picked)

        self.show_all.observe(refold, "value")
        self._front: Sequence["Candidate"] = ()
        self._picked: int | None = None
        self.prefix = ""  # the dotted path every row's regions share, left out of the rows (heading says it)
        self.heading = W.HTML("", layout=W.Layout(flex="0 0 auto"))
        super().__init__(
            [],
            layout=W.Layout(
                min_width="300px",
                max_height="380px",
                overflow="auto",
                flex="1 1 300px",
                display="flex",
                flex_flow="column",
            ),
        )
        self.add_class("memsave-front-list")

    def set_front(self, front: Sequence["Candidate"], indices: Sequence[int]) -> None:
        """New rows for a new front (``indices``: each entry's candidate index, passed to ``on_load``)."""
        self.leaders = groups(front) if len(front) > FOLD_ABOVE else list(range(len(front)))
        self.rows = []
        for index in indices:
            text = W.HTML("", layout=W.Layout(flex="1 1 auto"))
            text.add_class("memsave-front-text")
            load = W.Button(
                description="load",
                icon="upload",
                layout=W.Layout(width="80px", flex="0 0 auto"),
                tooltip="load this plan into the explorer",
            )
            load.add_class("memsave-front-load")
            load.on_click(lambda _b, i=index: self.on_load(i))
            row = W.HBox([load, text], layout=W.Layout(align_items="center", flex="0 0 auto", min_height=ROW_HEIGHT))
            row.add_class("memsave-front-row")
            self.rows.append(row)
        distinct = len(set(self.leaders))
        folded = len(front) - distinct
        self.prefix = shared_prefix(front)
        under = f"; modules under <code>{html.escape(self.prefix)}</code>" if self.prefix else ""
        self.heading.value = (
            f"<b>Pareto front</b> <small>({len(front)} plans, {distinct} distinct, "
            f"lowest estimated peak first{under})</small>"
        )
        self.show_all.description = f"show all {len(front)}"
        self.show_all.layout.display = "" if folded else "none"
        self.children = [
            W.HBox(
                [self.heading, self.show_all],
                layout=W.Layout(flex="0 0 auto", align_items="center", flex_flow="row wrap"),
            )
        ] + self.rows
        self._fold()

    def _fold(self) -> None:
        for k, row in enumerate(self.rows):
            hidden = not self.show_all.value and self.leaders[k] != k
            row.layout.display = "none" if hidden else ""
            (row.add_class if hidden else row.remove_class)("memsave-front-folded")

    def show(self, front: Sequence["Candidate"], picked_row: int | None) -> None:
        """Each row's text and fits / does not fit class (after a search, a new target, a pick)."""
        self._front, self._picked = front, picked_row
        members = {k: self.leaders.count(k) - 1 for k in set(self.leaders)}
        for k, (row, c) in enumerate(zip(self.rows, front)):
            for cls in ("memsave-fits", "memsave-nofit", "memsave-front-picked"):
                row.remove_class(cls)
            row.add_class("memsave-fits" if c.fits else "memsave-nofit")
            picked = k == picked_row
            if picked:
                row.add_class("memsave-front-picked")
            color = FITS_COLOR if c.fits else MISS_COLOR
            more = members.get(k, 0)
            alike = f" · <i>+{more} like it with other offload counts</i>" if more and not self.show_all.value else ""
            row.children[1].value = (
                f"<span title='{html.escape(c.label + ' · ' + c.config, quote=True)}' style='overflow-wrap:anywhere'>"
                f"{'<b>' if picked else ''}{html.escape(row_label(c, self.prefix))}{'</b>' if picked else ''}</span><br>"
                f"<small>est. peak <b>{format_bytes(c.est_peak_bytes)}</b> · {c.est_seconds * 1e3:.2f} ms · "
                f"<span style='color:{color}'>{'fits' if c.fits else 'does not fit'}</span>{alike}</small>"
            )
