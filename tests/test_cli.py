"""``memsave-nb report``: the printed table as a golden file, the HTML report, one-line errors.

Regenerate the golden files after a deliberate change with
``MEMSAVE_REGEN_GOLDEN=1 pytest tests/test_cli.py`` and review the diff.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memsave_nb import cli

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("MEMSAVE_REGEN_GOLDEN") == "1"


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if REGEN or not path.exists():
        if not REGEN:
            pytest.fail(f"missing golden file {path}; run with MEMSAVE_REGEN_GOLDEN=1 to create it")
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8"), f"output differs from {path} (MEMSAVE_REGEN_GOLDEN=1 to update)"


@pytest.mark.parametrize(
    "argv, golden",
    [
        (["report", "--model", "mlp", "--mode", "fake"], "report_mlp_fake.txt"),
        (["report", "--model", "mlp", "--mode", "fake", "--batch", "32", "--top", "3"], "report_mlp_fake_top3.txt"),
    ],
)
def test_report_table_golden(capsys, argv, golden):
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    _check_golden(golden, out)
    assert out.splitlines()[2].startswith("Peak memory: ")  # the answer leads (issue 28 item 7)


def test_report_numbers_match_the_engine(capsys):
    from memsave_nb import measure, zoo
    from memsave_nb.ui.format import format_bytes

    assert cli.main(["report", "--model", "mlp", "--mode", "fake", "--batch", "16"]) == 0
    out = capsys.readouterr().out
    m = measure(zoo.make("mlp", 16), mode="fake")
    assert f"Peak memory: {format_bytes(m.peak_bytes)} during {m.peak_phase}" in out
    assert f"Saved activations: {format_bytes(m.saved_bytes)}" in out
    table = out.split("Saved activations per layer\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    assert [line.split()[0] for line in table] == ["(model)"] + [r.name for r in m.modules[1:]]


def test_report_writes_html(tmp_path, capsys):
    out = tmp_path / "sub" / "report.html"
    assert cli.main(["report", "--model", "mlp", "--mode", "fake", "--batch", "8", "--out", str(out)]) == 0
    assert out.exists() and out.stat().st_size > 100_000
    assert f"Wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["report", "--model", "resnet9000"], "unknown model 'resnet9000'"),
        (["report", "--model", "mlp", "--batch", "0"], "--batch: expected a positive integer"),
        (["report", "--model", "mlp", "--batch", "many"], "--batch: expected a positive integer"),
        (["report", "--model", "mlp", "--mode", "imaginary"], "--mode: invalid choice"),
        (["report", "--model", "mlp", "--device", "tpu"], "device 'tpu'"),
        (["report", "--model", "gpt-7b", "--mode", "real"], "only runs with --mode fake"),
        (["report", "--nonsense"], "unrecognized arguments"),
    ],
)
def test_errors_are_one_line_exit_2(capsys, argv, message):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("memsave-nb: error: ")
    assert message in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is present")
def test_missing_cuda_is_one_line(capsys):
    assert cli.main(["report", "--model", "mlp", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not available" in err


def test_no_traceback_from_a_real_process():
    proc = subprocess.run(
        [sys.executable, "-m", "memsave_nb.cli", "report", "--model", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memsave-nb: error: unknown model 'nope'")
    assert lines[0].endswith("demo models: cnn, gpt, mlp, gpt-7b")


def test_help_exits_0(capsys):
    assert cli.main(["report", "--help"]) == 0
    assert "--model NAME" in capsys.readouterr().out
    assert cli.main([]) == 2


def test_top_table_lists_a_parents_own_ops_once():
    """--top ranks modules by what their own ops save: the zoo GPT's attention softmax/matmuls run
    in CausalSelfAttention.forward, not in a leaf, and were invisible in a leaves-only table."""
    from memsave_nb import measure, zoo
    from memsave_nb.ui.format import layer_table

    m = measure(zoo.make("gpt"), mode="fake")
    _, rows = layer_table(m, top=len(m.modules))
    names = [r[0] for r in rows]
    assert "blocks.0.attn (own ops)" in names[:4]
    # every byte appears in exactly one row: the rows add up to the whole saved total
    by_name = {x.name: x for x in m.modules}
    listed = sum(by_name[n.replace(" (own ops)", "").replace("(model)", "")].saved_bytes_own for n in names)
    assert listed == m.saved_bytes


@pytest.mark.slow
def test_plan_command_writes_a_plan_that_fits(tmp_path, capsys):
    """``memsave-nb plan``: the chosen plan, saved as a file and measured again independently,
    fits by the report's own verdict (``fit_of``: the allocator replay + CUDA context); the front is
    printed lowest peak first."""
    from memsave_nb import Plan, measure, zoo
    from memsave_nb.cli import main
    from memsave_nb.target import Target, fit_of

    path = tmp_path / "plan.json"
    # 0.54 GB: 53 MiB past the 500 MiB CUDA context; the stock step reserves 94 MiB
    rc = main(["plan", "--model", "gpt", "--target-gb", "0.54", "--save", str(path)])
    out = capsys.readouterr().out
    assert rc == 0 and "Pareto front" in out and "The chosen plan as code:" in out
    plan = Plan.from_json(path.read_text())
    workload = zoo.make("gpt")
    with plan.apply(workload) as applied:
        assert fit_of(Target(0.54), measure(applied, mode="fake")).fits
    assert not fit_of(Target(0.54), measure(workload, mode="fake")).fits  # the plan was needed
    peaks = [
        line.split()[0:2]
        for line in out.split("Pareto front")[1].splitlines()[2:]
        if line.strip().endswith(")") or "MiB" in line
    ]
    values = [float(p[0]) for p in peaks if len(p) == 2 and p[1] == "MiB"]
    assert values == sorted(values) and len(values) >= 2


def test_plan_command_refuses_bad_input_in_one_line(capsys):
    from memsave_nb.cli import main

    assert main(["plan", "--target-gb", "1", "--precisions", "fp8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "precisions are" in err


def test_plan_command_says_which_knob_would_fit_when_nothing_searched_does(capsys):
    """Issue 28 item 6 at the command line: "no candidate fits" comes with each knob's own figure;
    a knob said to fit is checked by measuring its plan independently."""
    from memsave_nb.cli import main
    from memsave_nb.planner.what_fits import what_would_fit
    from memsave_nb import Plan, zoo
    from memsave_nb.target import Target, fit_of, measure_peak

    # 0.58 GB: ~94 MB past the 500 MiB CUDA context (issue 40): batch 1 of the gpt (21 MB reserved)
    # fits, no plan the planner searches at batch 128 (171 MB and up, estimated) does
    target = Target(0.58)
    rc = main(["plan", "--model", "gpt", "--batch", "128", "--target-gb", "0.58"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "Nothing searched fits. Each knob on its own" in out
    hints = what_would_fit(zoo.make("gpt", 128), Plan(), target, gpus=False)
    fitting = [h for h in hints if h.fits]
    assert "smaller batch" in {h.knob for h in fitting}, "a smaller batch at least fits this target"
    for h in fitting:  # the oracle: the report's verdict on each such plan measured afresh
        assert h.line(target) in out
        assert fit_of(target, measure_peak(zoo.make("gpt", 128), h.plan, "fake")).fits
