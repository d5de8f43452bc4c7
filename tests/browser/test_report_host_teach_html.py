"""Issue 42: the HTML report of ``report --offload`` shows the host memory stdout shows (in the
answer and the summary) and the teacher's table, read back in headless Chromium; the figures come
from measure() and the rule computed here."""

from __future__ import annotations

import memsave_nb
from memsave_nb import Plan, cli, measure
from memsave_nb.planner.depth import blocks_of
from memsave_nb.units import format_bytes


def test_html_report_shows_host_memory_and_the_rule_of_thumb(page, tmp_path, capsys, tiny):
    out_html = tmp_path / "h.html"
    argv = ["report", "--model", tiny, "--seq-len", "32", "--offload", "--out", str(out_html)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()

    wl = memsave_nb.from_pretrained(tiny, seq_len=32)
    n = sum(p.numel() for p in wl.model.parameters())
    with Plan(regions={b: "offload" for b in blocks_of(wl.model).names}).apply(wl) as w:
        m = measure(w, mode="fake")

    page.goto(out_html.as_uri())
    answer = [t.strip() for t in page.locator(".answer p").all_inner_texts()]
    assert answer[:2] == lines[2:4]
    assert answer[1].startswith(f"Host memory: {format_bytes(m.host.peak_bytes)} at most")
    summary = page.locator(".summary").inner_text()
    assert "host memory (offloaded)" in summary and format_bytes(m.host.to_host_bytes) in summary
    rows = [r.split("\t") for r in page.locator("table.teach-rule tbody tr").all_inner_texts()]
    assert [r[0] for r in rows] == ["weights", "gradients", "optimizer state", "rule total"]
    assert rows[1][1] == f"{n:,}" and rows[1][3] == format_bytes(2 * n)  # bf16 gradients: 2 B each
    assert rows[3][2] == "8 B"  # bf16 AdamW: 2 + 2 + 4
    phases = [r.split("\t")[0] for r in page.locator("table.teach-phases tbody tr").all_inner_texts()]
    assert phases == ["forward", "backward", "optimizer"]
    body = page.locator("body").inner_text()
    assert body.index("Rule of thumb vs measured") < body.index("Per-layer table")
    assert "The rule leaves out" in body
