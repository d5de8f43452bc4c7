"""``report --compare`` (issue 42): one table across full / LoRA / QLoRA x precisions x sequence
lengths; each row's peak is measure()'s on the model built that way here, its max batch max_batch()'s."""

from __future__ import annotations

import json

import pytest

import memsave_nb
from memsave_nb import Plan, cli, measure
from memsave_nb.target import Target, max_batch
from memsave_nb.units import format_bytes


def _measured(tiny, seq, precision=None, **kw):
    with Plan(precision=precision).apply(memsave_nb.from_pretrained(tiny, seq_len=seq, **kw)) as w:
        return measure(w, mode="fake")


def _peak(tiny, seq, precision=None, **kw):
    return _measured(tiny, seq, precision, **kw).peak_bytes


def test_compare_prints_one_table_of_measured_rows(capsys, tiny):
    argv = [
        "report",
        "--model",
        tiny,
        "--compare",
        "full,lora,qlora",
        "--lora",
        "r=4",
        "--compare-precisions",
        "fp32,bf16",
        "--compare-seq-lens",
        "32,64",
        "--target-gb",
        "0.55",
    ]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"memsave_nb compare: {tiny}, fake mode") and "plans must stay under" in lines[0]
    table = lines[2:]
    assert table[0].split()[:5] == ["setup", "precision", "seq", "batch", "peak"] and len(table) == 2 + 12
    want = {
        ("full", None, None): {},
        ("lora", "r=4", None): {"lora": "r=4"},
        ("qlora", "r=4", "nf4"): {"lora": "r=4", "quantize": "nf4"},
    }
    rows = iter(table[2:])
    for (setup, lora, quant), kw in want.items():
        for seq in (32, 64):
            for precision in ("fp32", "bf16"):
                row = next(rows)
                m = _measured(tiny, seq, precision, **kw)
                peak = m.peak_bytes
                name = " ".join(w for w in (setup, quant, lora) if w)
                assert row.startswith(name) and f" {precision} " in row and f" {seq} " in row
                assert f" {format_bytes(peak)} " in row and _verdict_line(Target(0.55), m).split(": ", 1)[1] in row
    assert _peak(tiny, 64, "bf16", lora="r=4") < _peak(tiny, 64, "bf16")  # the table has something to say


def test_compare_json_rows_and_max_batch(capsys, tiny):
    argv = [
        "report",
        "--model",
        tiny,
        "--compare",
        "full,lora",
        "--seq-len",
        "64",
        "--target-gb",
        "0.56",
        "--max-batch",
        "--json",
    ]
    assert cli.main(argv) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["schema"] == "memsave_nb.compare/1" and [r["setup"] for r in obj["rows"]] == ["full", "lora"]
    for row, kw in zip(obj["rows"], ({}, {"lora": "r=16"})):
        wl = memsave_nb.from_pretrained(tiny, seq_len=64, **kw)
        assert row["peak_bytes"] == measure(wl, mode="fake").peak_bytes and row["seq_len"] == 64
        assert row["max_batch"] == max_batch(wl, Plan(), Target(0.56)).value > 0


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "mlp", "--compare", "lora"], "is a demo model"),
        (["--compare", "full,lorra"], "setups are full, lora, qlora"),
        (["--compare", "full", "--out", "x.html"], "drop --out"),
        (["--compare-precisions", "bf16"], "need --compare"),
        (["--compare", "full", "--compare-seq-lens", ",".join(str(i) for i in range(1, 40))], "at most 36"),
    ],
)
def test_compare_refusals_are_one_line(capsys, tiny, argv, words):
    full = ["report", *argv] if "--model" in argv else ["report", "--model", tiny, *argv]
    assert cli.main(full) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err


def _verdict_line(target, m):
    """stdout's verdict: the allocator replay's where the step has one, else the 80% rule's."""
    from memsave_nb.target import reserved_verdict

    r = reserved_verdict(target, m)
    return r.lines()[0] if r else f"Target {target.label}: {target.verdict(m.peak_bytes)}"
