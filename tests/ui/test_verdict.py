"""One verdict on every screen (issue 40): the explorer asks ``target.fit_of`` as the CLI, the
planner and notebook 09 do, shows predicted reserved memory beside the allocated peak (header,
Results table, a second timeline line), and says "80% rule" where a step has no replay.

Oracles: ``fit_of`` on a measurement taken outside the explorer the way notebook 09 takes it
(``measure_peak`` with ``Plan(optimizer="adamw_foreach")``), the CLI's ``--json`` verdict, and the
replay's own ``Measurement.reserved`` series."""

from __future__ import annotations

import dataclasses
import html
import math

import pytest

from memsave_nb import Plan, zoo
from memsave_nb.cli.json_out import verdict_of
from memsave_nb.hub import from_pretrained
from memsave_nb.session import Session
from memsave_nb.target import CUDA_CONTEXT_BYTES, GIB, Target, fit_of, measure_peak
from memsave_nb.ui import figures as F
from memsave_nb.ui.explorer import Explorer, explore
from memsave_nb.ui.format import format_bytes
from memsave_nb.ui.verdict import opening_gb, parts_html, rule_html

pytestmark = pytest.mark.timeout(300)
TINY_GPT = zoo.GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
SMALL = dict(
    overrides=dict(
        num_hidden_layers=2,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    ),
    seq_len=64,
)


def _edge(m) -> int:
    """The fewest bytes of GPU that ``fit_of`` says the step fits (bisection over whole bytes)."""
    lo, hi = CUDA_CONTEXT_BYTES, CUDA_CONTEXT_BYTES + m.reserved.max_reserved_bytes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fit_of(Target(mid / GIB), m, fixes=False).fits else (mid, hi)
    return hi


def test_explorer_and_notebook_09_give_one_answer_for_one_target():
    """Notebook 09's way (a model by name, AdamW's foreach step by hand, ``fit_of``) and
    ``explore(name, target_gb=...)`` on a small Qwen2.5 config: the same target, the same answer
    and the same figures on screen, on both sides of the boundary; the CLI's JSON agrees."""
    nb = measure_peak(
        from_pretrained("qwen2.5-0.5b", batch_size=1, **SMALL), Plan(optimizer="adamw_foreach"), mode="fake"
    )
    edge = _edge(nb)
    assert edge > CUDA_CONTEXT_BYTES + 2**20  # a step of some MiB, not a rounding artefact
    ex = explore("qwen2.5-0.5b", live=False, target_gb=edge / GIB, **SMALL)
    for total, word in ((edge, "fits"), (edge - 1, "does not fit")):
        target = Target(total / GIB)
        fit = fit_of(target, nb)
        assert fit.fits == (word == "fits") and fit.rule == "allocator replay"
        if total != edge:
            ex.tuner.set_target(total / GIB)
        assert ex.target == ex.tuner.target == target
        assert ex.measurement.peak_bytes == nb.peak_bytes
        assert ex.measurement.reserved.max_reserved_bytes == nb.reserved.max_reserved_bytes
        shown = fit.verdict(target)
        assert shown.startswith(f"{word} (") and format_bytes(fit.replay.total_bytes) in shown
        assert ex.target_verdict.value == ("✔ " if fit.fits else "✘ ") + shown  # the header
        assert html.escape(shown) in ex.tuner.verdict.value  # the Fit a GPU panel
        assert ("memsave-fits" if fit.fits else "memsave-nofit") in ex.tuner.verdict.value
        cli = verdict_of(target, nb)  # memsave-nb report --json
        assert (cli["fits"], cli["rule"], cli["total_bytes"]) == (fit.fits, "allocator replay", fit.replay.total_bytes)


def test_the_opening_target_is_the_smallest_preset_that_fits_by_the_replay():
    ex = Explorer(Session(zoo.gpt(TINY_GPT, batch_size=4), mode="fake", repeats=0), live=False)
    m = ex.measurement
    assert opening_gb(m) == 16.0 and ex.target == Target(16)
    assert fit_of(Target(16), m).fits
    # no replay (the compiled route, an old result): the 80% rule's choice, and the words say which rule
    plain = dataclasses.replace(m, reserved=None)
    assert opening_gb(plain) == 16.0
    fit = fit_of(Target(16), plain)
    assert fit.rule == "80% rule" and "no allocator replay" in fit.verdict(Target(16))
    assert "rule: <b>80% rule</b> (no allocator replay for this step)" in rule_html(Target(16), fit)
    assert "no allocator replay for this step, so the 80% rule" in parts_html(fit)


def test_reserved_beside_allocated_in_the_header_table_and_timeline():
    ex = Explorer(Session(zoo.gpt(TINY_GPT, batch_size=64), mode="fake", repeats=0), live=False)
    m = ex.measurement
    r = m.reserved
    assert r.max_reserved_bytes == 12 * 2**20 > m.peak_bytes  # 12 MiB of segments for 11.8 MB of tensors
    assert ex.reserved.value == (f"reserved {format_bytes(r.max_reserved_bytes)}")
    assert ex.reserved.layout.display == ""
    assert "memsave-row-reserved" in ex.results.table.value
    assert f"<td style='text-align:right'>{format_bytes(r.max_reserved_bytes)}</td>" in ex.results.table.value
    # the timeline's second line: the replay's series at the shown events, its maximum among them
    data = ex.results.timeline_plot.source.data
    assert list(data["reserved"]) == [r.reserved[i] for i in data["x"]]
    assert max(data["reserved"]) == r.max_reserved_bytes
    assert ex.results.timeline_plot.figure.select_one({"name": "reserved_line"}) is not None
    assert ex.results.timeline_plot.figure.y_range.end > r.max_reserved_bytes
    # a measurement without a replay draws no second line (NaN) and the header says nothing
    plain = dataclasses.replace(m, reserved=None)
    assert all(math.isnan(v) for v in F.timeline_data(plain)["reserved"])
    assert F.timeline_data(plain)["total"] == F.timeline_data(m)["total"]
