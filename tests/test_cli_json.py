"""``report --json`` / ``plan --json`` (issue 42): one JSON object on stdout whose figures are the
engine's, checked against measure() / max_batch() / the Plan re-measured here."""

from __future__ import annotations

import json

import pytest

import memsave_nb
from memsave_nb import Plan, cli, measure, zoo
from memsave_nb.target import Target, max_batch


def _json(capsys, argv, code=0):
    assert cli.main(argv) == code, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert err == ""
    return json.loads(out)  # stdout is the JSON object and nothing else


def test_report_json_is_the_measurement_and_the_target_answer(capsys):
    obj = _json(
        capsys,
        ["report", "--model", "mlp", "--mode", "fake", "--batch", "32", "--target-gb", "0.6", "--max-batch", "--json"],
    )
    m = measure(zoo.make("mlp", 32), mode="fake")
    assert obj["schema"] == "memsave_nb.report/1"
    assert obj["peak_bytes"] == m.peak_bytes and obj["peak_phase"] == m.peak_phase
    assert obj["split"] == m.peak_split.as_dict() and sum(obj["split"].values()) == m.peak_bytes
    assert obj["saved_bytes"] == m.saved_bytes
    target = Target(0.6)  # past the 500 MiB CUDA context the replay's verdict counts
    line = _verdict_line(target, m)
    assert obj["target"]["line"] == line and obj["target"]["verdict"] == line.split(": ", 1)[1]
    assert obj["target"]["fits"] == line.startswith("Target 0.6 GB: fits")
    assert (obj["target"]["gb"], obj["target"]["headroom"], obj["target"]["usable_bytes"]) == (
        0.6,
        0.8,
        target.usable_bytes,
    )
    r = max_batch(zoo.make("mlp", 32), Plan(), target)
    assert obj["max_batch"]["value"] == r.value > 0 and obj["max_batch"]["peak_bytes"] == r.peak_bytes
    assert obj["max_seq"] is None and obj["setup"]["batch"] == 32


def test_report_json_of_a_hub_model_names_lora_and_the_sequence(capsys, tiny):
    obj = _json(capsys, ["report", "--model", tiny, "--lora", "r=4", "--seq-len", "32", "--json"])
    wl = memsave_nb.from_pretrained(tiny, lora="r=4", seq_len=32, batch_size=1)
    m = measure(wl, mode="fake")
    assert obj["peak_bytes"] == m.peak_bytes
    assert (
        obj["setup"]["lora"] == "r=4" and obj["setup"]["seq_len"] == 32 and obj["setup"]["words"] == "LoRA r=4, seq 32"
    )
    assert obj["target"] is None
    assert 0 < len(obj["layers"]) <= 20  # a hub model's table: its top 20 layers


def test_plan_json_chosen_plan_remeasures_to_its_figure(capsys, tiny, tmp_path):
    save = tmp_path / "plan.json"
    obj = _json(
        capsys,
        [
            "plan",
            "--model",
            tiny,
            "--lora",
            "r=4",
            "--seq-len",
            "64",
            "--batch",
            "4",
            "--target-gb",
            "0.55",
            "--save",
            str(save),
            "--json",
        ],
    )
    assert obj["schema"] == "memsave_nb.plan/1" and obj["chosen"] is not None
    assert obj["front"] and obj["front"] == sorted(obj["front"], key=lambda c: c["est_peak_bytes"])
    plan = Plan.from_dict(obj["chosen"]["plan"])
    assert Plan.from_json(save.read_text()) == plan  # --save still writes the same plan
    with plan.apply(memsave_nb.from_pretrained(tiny, lora="r=4", seq_len=64, batch_size=4)) as w:
        peak = measure(w, mode="fake").peak_bytes
    assert obj["chosen"]["measured_peak_bytes"] == peak <= Target(0.55).usable_bytes


def test_plan_json_when_nothing_fits_lists_each_knob_alone(capsys):
    obj = _json(capsys, ["plan", "--model", "mlp", "--target-gb", "0.001", "--json"], code=1)
    assert obj["chosen"] is None and obj["fitting"] == 0
    knobs = obj["knobs_alone"]
    assert knobs and all(k["fits"] == Target(0.001).fits(k["peak_bytes"]) for k in knobs)


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "--model", "mlp", "--world-size", "2", "--json"],
        ["plan", "--model", "mlp", "--target-gb", "80", "--gpus", "2", "--json"],
    ],
)
def test_json_where_there_is_none_is_one_line(capsys, argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--json" in err


def test_knobs_that_do_not_fit_are_never_under_fit_on_their_own(capsys):
    """Issue 42: the CLI listed knobs that do not fit under "knobs that fit on their own"."""
    from memsave_nb.planner.what_fits import hint_lines, what_would_fit

    target = Target(0.545)  # past the CUDA context
    hints = what_would_fit(zoo.make("mlp", 256), Plan(), target, gpus=False)
    assert any(h.fits for h in hints) and any(not h.fits for h in hints)  # both kinds, else the test says nothing
    lines = hint_lines(hints, target)
    split = lines.index("knobs that do not fit on their own (closest first):")
    assert lines[0] == "knobs that fit on their own:"
    assert all(", fits (" in line for line in lines[1:split]) and all(
        "does not fit" in line for line in lines[split + 1 :]
    )
    assert len(lines) == len(hints) + 2


def _verdict_line(target, m):
    """stdout's verdict: the allocator replay's where the step has one, else the 80% rule's."""
    from memsave_nb.target import reserved_verdict

    r = reserved_verdict(target, m)
    return r.lines()[0] if r else f"Target {target.label}: {target.verdict(m.peak_bytes)}"
