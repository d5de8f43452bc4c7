"""``report --explain`` (issue 42): the peak explained as the answer's second paragraph; its figures
are measure()'s: the split at the peak, the layers' saved bytes, and the best knob's plan re-measured."""

from __future__ import annotations


import memsave_nb
from memsave_nb import Plan, cli, measure
from memsave_nb.planner.what_fits import what_would_fit
from memsave_nb.target import Target
from memsave_nb.units import format_bytes


def test_explain_says_what_is_held_who_saved_it_and_the_best_knob(capsys, tiny):
    assert (
        cli.main(["report", "--model", tiny, "--seq-len", "128", "--batch", "8", "--target-gb", "0.012", "--explain"])
        == 0
    )
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    why = next(i for i, line in enumerate(lines) if line.startswith("Why the peak: "))
    assert why > 2 and lines[2].startswith("Peak memory: ")  # the paragraph after the answer's first lines
    wl = memsave_nb.from_pretrained(tiny, seq_len=128, batch_size=8)
    m = measure(wl, mode="fake")
    big = max(m.peak_split.as_dict().items(), key=lambda kv: kv[1])
    assert lines[why].startswith(
        f"Why the peak: during {m.peak_phase} the step holds {big[0].replace('_', ' ')} "
        f"{format_bytes(big[1])} ({big[1] / m.peak_bytes:.0%})"
    )
    top = max((s for s in m.modules if s.name), key=lambda s: s.saved_bytes_own)
    assert f"{format_bytes(top.saved_bytes_own)}" in lines[why + 1] and lines[why + 1].startswith(
        "  saved for backward most by: "
    )
    target = Target(0.012)
    best = min(what_would_fit(wl, Plan(), target, gpus=False), key=lambda h: h.peak_bytes)
    with best.plan.apply(memsave_nb.from_pretrained(tiny, seq_len=128, batch_size=8)) as w:
        best_peak = measure(w, mode="fake").peak_bytes
    assert best_peak < m.peak_bytes
    assert lines[why + 2] == (
        f"  the single knob that frees the most: {best.knob}: {best.change} -> peak {format_bytes(best_peak)} "
        f"({format_bytes(m.peak_bytes - best_peak)} less), {target.verdict(best_peak)} (80% rule)"
    )
