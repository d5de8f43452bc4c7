"""Issue 42: the HTML report leads with the answer stdout leads with (the title naming LoRA and the
sequence length, the peak, the verdict, the max batch), read back from the page in headless
Chromium; the figures themselves come from measure() / max_batch() run here."""

from __future__ import annotations

import memsave_nb
from memsave_nb import Plan, cli, measure
from memsave_nb.target import Target, max_batch
from memsave_nb.units import format_bytes


def test_html_report_leads_with_the_answer_stdout_leads_with(page, tmp_path, capsys, tiny):
    out_html = tmp_path / "x.html"
    argv = [
        "report",
        "--model",
        tiny,
        "--lora",
        "r=4",
        "--seq-len",
        "32",
        "--target-gb",
        "0.55",  # past the 500 MiB CUDA context and the 32 MiB cuBLAS workspace the verdict counts
        "--max-batch",
        "--out",
        str(out_html),
    ]
    assert cli.main(argv) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()

    # the oracle: the engine on the same model and plan
    wl = memsave_nb.from_pretrained(tiny, lora="r=4", seq_len=32, batch_size=1)
    with Plan().apply(wl) as w:
        m = measure(w, mode="fake")
    target = Target(0.55)
    r = max_batch(wl, Plan(), target)
    assert r.value >= 1

    page.goto(out_html.as_uri())
    title = page.locator("h1").inner_text()
    assert title == lines[0] == page.title()
    assert ", LoRA r=4, seq 32, batch 1," in title
    answer = [t.strip() for t in page.locator(".answer p").all_inner_texts()]
    assert answer[:3] == [lines[2], lines[3], lines[4]]  # the same lines, in the same order, as stdout
    assert answer[0].startswith(f"Peak memory: {format_bytes(m.peak_bytes)} during {m.peak_phase}")
    assert answer[1] == _verdict_line(target, m)
    assert answer[2].startswith(f"Max batch that fits: {r.value} (peak {format_bytes(r.peak_bytes)}")
    # the answer comes before anything else of the page's body text
    body = page.locator("body").inner_text()
    assert body.index(answer[1]) < body.index("Saved activations:") < body.index("Per-layer table")


def _verdict_line(target, m):
    """stdout's verdict: the allocator replay's where the step has one, else the 80% rule's."""
    from memsave_nb.target import reserved_verdict

    r = reserved_verdict(target, m)
    return r.lines()[0] if r else f"Target {target.label}: {target.verdict(m.peak_bytes)}"
