"""A standalone HTML report of a measured step (or a whole session): Bokeh figures and the
per-layer table in one file, BokehJS inlined so it opens offline.

    write_report(measurement, "report.html")
    write_report(session, "report.html", title="fine-tuning the CNN")

A session is duck-typed: anything with ``.baseline`` (a Measurement, or an entry holding one)
and ``.history`` (entries with ``.plan`` and ``.measurement``).
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .measure.result import Measurement
from .workload import DEFAULT_LOOP
from .ui.format import (
    format_bytes,
    format_delta_bytes,
    format_flops,
    format_seconds,
    format_share,
    layer_table,
    split_table,
)


@dataclass
class _Contents:
    measurement: Measurement  # the one shown in detail: the last run, else the baseline
    baseline: Measurement | None  # only for a session with a history
    entries: list[Any]  # baseline entry first, then the history (a session only)
    heading: str  # what ``measurement`` is
    loop: str = DEFAULT_LOOP  # the session workload's loop: the exported code is written for it


def _measurement(obj: Any) -> Measurement:
    return obj.measurement if hasattr(obj, "measurement") else obj


def _contents(obj: Any) -> _Contents:
    if isinstance(obj, Measurement) or not (hasattr(obj, "baseline") and hasattr(obj, "history")):
        if not hasattr(obj, "peak_split"):
            raise TypeError(f"write_report takes a Measurement or a Session, got {type(obj).__name__}")
        return _Contents(obj, None, [], "measured step")
    history = list(obj.history)
    base_entry = getattr(obj, "baseline_entry", None)
    baseline = _measurement(obj.baseline)
    if base_entry is None:
        base_entry = _BaselineEntry(baseline)
    if not history:
        return _Contents(baseline, None, [base_entry], "baseline")
    from .ui.figures import plan_label

    last = history[-1]
    return _Contents(
        _measurement(last),
        baseline,
        [base_entry, *history],
        f"last plan: {plan_label(last.plan)}",
        getattr(getattr(obj, "workload", None), "loop", DEFAULT_LOOP),
    )


@dataclass
class _BaselineEntry:
    measurement: Measurement
    plan: Any = None


MAX_BARS = 40  # a 7B decoder has hundreds of layers: the bars show the largest, the table all


def _figures(c: _Contents, top: int | None, max_points: int) -> list[tuple[str, Any]]:
    from .ui import figures as F

    leaves = sum(1 for m in c.measurement.modules if m.is_leaf)
    bars = top if top is not None else (MAX_BARS if leaves > MAX_BARS else None)
    bars_title = "Saved activations per layer"
    if bars is not None and bars < leaves:
        bars_title += f" (the {bars} largest of {leaves} layers)"
    out = [
        ("Peak memory", F.peak_split(c.measurement, c.baseline).figure),
        (bars_title, F.layer_bars(c.measurement, c.baseline, top=bars).figure),
        ("Memory over the step", F.timeline(c.measurement, max_points).figure),
    ]
    if c.measurement.reserved is not None and c.measurement.reserved.reserved:
        out.append(("Reserved beside allocated (allocator model)", _reserved_figure(c.measurement, max_points)))
    if len(c.entries) > 1:
        out.append(("Plans tried", F.history(c.entries).figure))
    sweep = [e for e in c.entries if getattr(getattr(e, "plan", None), "compile_budget", None) is not None]
    if len(sweep) > 1:
        out.append(("Compile memory budget", F.budget_sweep(sweep).figure))
    return out


def _reserved_figure(m: Measurement, max_points: int) -> Any:
    """The allocator model's reserved bytes beside the tracker's live bytes, event by event."""
    from bokeh.plotting import figure

    from .ui.figures import timeline_indices

    idx = timeline_indices(m, max_points)
    live, reserved = m.timeline.total(), m.reserved.reserved  # type: ignore[union-attr]
    fig = figure(
        width=760,
        height=260,
        x_axis_label="allocation event",
        y_axis_label="bytes",
        title=f"Predicted reserved (max {format_bytes(m.reserved.max_reserved_bytes)}) and allocated",  # type: ignore[union-attr]
    )
    fig.step(idx, [reserved[i] for i in idx], mode="after", color="#d62728", legend_label="reserved (allocator model)")
    fig.step(idx, [live[i] for i in idx], mode="after", color="#1f77b4", legend_label="allocated (tracker)")
    fig.legend.location = "top_left"
    return fig


def _table_html(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int, css_class: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            text = html.escape(str(cell))
            if i == 0:
                indent = len(cell) - len(cell.lstrip(" "))
                cells.append(f'<td style="padding-left:{0.4 + 0.6 * indent}em">{html.escape(cell.strip())}</td>')
            else:
                cells.append(f'<td class="num">{text}</td>' if i >= numeric_from else f"<td>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="{css_class}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _summary_html(m: Measurement, baseline: Measurement | None) -> str:
    items = [
        (
            "peak",
            format_bytes(m.peak_bytes)
            + f" ({m.peak_phase}"
            + (", steady state: training's step 2 on)" if m.steady_state else ", first training step)"),
        ),
        ("saved activations", format_bytes(m.saved_bytes)),
        ("outputs kept", format_bytes(m.output_bytes)),
        ("step time", format_seconds(m.step_seconds)),
        ("FLOPs", format_flops(m.flops)),
        ("mode", f"{m.mode} on {m.device}" + (" (compiled)" if m.compiled else "")),
    ]
    if m.steady_state and m.first_step_peak_bytes is not None:
        items.insert(1, ("first-step peak", format_bytes(m.first_step_peak_bytes)))
    if m.host is not None and m.host.to_host_bytes:  # offloaded activations (Measurement.host)
        items.append(("host memory (offloaded)", format_bytes(m.host.peak_bytes)))
        items.append(("moved each way per step", format_bytes(m.host.to_host_bytes)))
    if m.cuda_peak_bytes is not None:
        items.append(("CUDA allocator peak", format_bytes(m.cuda_peak_bytes)))
    if m.reserved is not None:  # the allocator model's replay (docs/allocator.md)
        items.append(("predicted reserved", format_bytes(m.reserved.max_reserved_bytes)))
        items.append(("fragmentation at the peak", format_bytes(m.reserved.fragmentation_bytes)))
    if baseline is not None:
        items.append(("peak vs baseline", format_delta_bytes(m.peak_bytes - baseline.peak_bytes)))
        items.append(("saved vs baseline", format_delta_bytes(m.saved_bytes - baseline.saved_bytes)))
    cells = "".join(f"<div><span>{html.escape(k)}</span><b>{html.escape(v)}</b></div>" for k, v in items)
    advice = "".join(f'<p class="advice">{html.escape(a)}</p>' for a in m.advice)
    return f'<div class="summary">{cells}</div>{advice}'


def _plans_html(c: _Contents) -> str:
    from .ui.figures import plan_label

    base = _measurement(c.entries[0])
    rows = []
    for i, e in enumerate(c.entries):
        m = _measurement(e)
        rows.append(
            [
                str(i),
                plan_label(getattr(e, "plan", None)) if i else "baseline",
                format_bytes(m.peak_bytes),
                format_delta_bytes(m.peak_bytes - base.peak_bytes),
                format_bytes(m.saved_bytes),
                format_share(m.saved_bytes / base.saved_bytes if base.saved_bytes else 0.0),
                format_seconds(m.step_seconds),
            ]
        )
    table = _table_html(["#", "plan", "peak", "vs baseline", "saved", "saved vs baseline", "step"], rows, 2, "plans")
    codes = []
    for i, e in enumerate(c.entries[1:], start=1):
        to_code = getattr(getattr(e, "plan", None), "to_code", None)
        if callable(to_code):
            codes.append(
                f"<details><summary>plan #{i} as code</summary><pre>{html.escape(to_code(loop=c.loop))}</pre></details>"
            )
    return table + "".join(codes)


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 980px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
.summary { display: flex; flex-wrap: wrap; gap: 0.6em 1.6em; margin: 1em 0; }
.summary div { display: flex; flex-direction: column; } .summary span { font-size: 0.8em; color: #666; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { padding: 0.15em 0.6em; border-bottom: 1px solid #eee; text-align: left; }
td.num, th:nth-child(n+4) { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.8em; }
.note { color: #666; font-size: 0.85em; }
.answer { border-left: 4px solid #2b6cb0; padding: 0.2em 1em; margin: 1em 0; font-size: 1.05em; }
.answer p { margin: 0.3em 0; } .answer .answer-line { font-weight: 600; } .answer .answer-note { color: #555; font-size: 0.9em; }
"""


_TEMPLATE = """
{% block postamble %}<style>{{ css }}</style>{% endblock %}
{% block contents %}
{{ intro }}
{% for name in section_names %}
<h2>{{ name | e }}</h2>
{{ embed(roots[loop.index0]) }}
{% endfor %}
{{ outro }}
{% endblock %}
"""


def _teach_html(view: Any) -> str:
    """The teacher's view (``measure/rule_of_thumb.py``): the rule beside the measured bytes, the
    split at each phase's peak, and what the rule leaves out."""
    if view is None:
        return ""
    from .ui.teach_table import phase_table, rule_table, teach_lines

    rh, rr = rule_table(view)
    ph, pr = phase_table(view)
    lines = "".join(f'<p class="note">{html.escape(line)}</p>' for line in teach_lines(view))
    return (
        '<h2>Rule of thumb vs measured</h2><div class="teach">'
        + _table_html(rh, rr, 1, "teach-rule")
        + _table_html(ph, pr, 1, "teach-phases")
        + lines
        + "</div>"
    )


def _answer_html(answer: Sequence[str]) -> str:
    """The answer lines the CLI prints first (peak, verdict, max batch), first in the page too."""
    if not answer:
        return ""
    lines = "".join(
        f'<p class="{"answer-note" if a.startswith(" ") else "answer-line"}">{html.escape(a.strip())}</p>'
        for a in answer
    )
    return f'<div class="answer">{lines}</div>'


def render_report(
    obj: Any,
    title: str = "memsave_nb report",
    *,
    top: int | None = None,
    max_points: int = 2000,
    answer: Sequence[str] = (),
    teach: Any = None,
) -> str:
    """The report as an HTML string (see :func:`write_report`)."""
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    c = _contents(obj)
    m = c.measurement
    named = _figures(c, top, max_points)
    headers, rows = layer_table(m, baseline=c.baseline)
    split_headers, split_rows = split_table(m)
    notes = "".join(f'<p class="note">{html.escape(n)}</p>' for n in m.notes)
    intro = f"""<h1>{html.escape(title)}</h1>
{_answer_html(answer)}
<p class="note">{html.escape(c.heading)}. Saved activations: bytes created in a module's forward and still
alive when the forward of the step ends (kept for backward), parameters and inputs excluded.</p>
{_summary_html(m, c.baseline)}
{notes}
{_table_html(split_headers, split_rows, 1, "split")}
{_teach_html(teach)}"""
    plans = f"<h2>Plans</h2>{_plans_html(c)}" if len(c.entries) > 1 else ""
    outro = f"<h2>Per-layer table</h2>\n{_table_html(headers, rows, 3, 'layers')}\n{plans}"
    # file_html bundles only the BokehJS parts these figures use, inline: no CDN, opens offline.
    return file_html(
        [fig for _, fig in named],
        INLINE,
        title,
        template=_TEMPLATE,
        template_variables={"css": _CSS, "intro": intro, "outro": outro, "section_names": [n for n, _ in named]},
    )


def write_report(
    obj: Any,
    path: str | os.PathLike,
    title: str = "memsave_nb report",
    *,
    top: int | None = None,
    max_points: int = 2000,
    answer: Sequence[str] = (),
    teach: Any = None,
) -> Path:
    """Write a standalone HTML report of ``obj`` (a Measurement, or a session with ``.baseline`` and
    ``.history``) to ``path``: peak split, per-layer bars, the memory timeline, for a session also
    the plans tried (and a compile-budget sweep when there is one), and the per-layer table.
    ``answer``: lines shown first under the title, as the CLI prints them (peak, verdict, max batch).
    ``teach``: a ``TeacherView`` (``measure.rule_of_thumb.teacher_view``), shown after the split.
    BokehJS is inlined: the file opens with no network. Returns the path written."""
    out = Path(path)
    text = render_report(obj, title, top=top, max_points=max_points, answer=answer, teach=teach)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out


__all__ = ["write_report", "render_report"]
