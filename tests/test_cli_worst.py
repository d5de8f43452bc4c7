"""Worst-sample sizing (issue 42): the step sized at the data's longest sample, from a list of
lengths, a file (lengths or a histogram) or a ``datasets.Dataset`` column; the peak printed is
measure()'s at that length, and larger than at the median length."""

from __future__ import annotations

import json

import pytest

import memsave_nb
from memsave_nb import cli, measure
from memsave_nb.errors import WorkloadError
from memsave_nb.hub.seq_lengths import dataset_lengths, read_lengths, worst_seq_len
from memsave_nb.units import format_bytes


def _peak(tiny, seq_len):
    return measure(memsave_nb.from_pretrained(tiny, lora="r=4", seq_len=seq_len, batch_size=2), mode="fake").peak_bytes


def test_worst_of_sizes_the_step_at_the_longest_sample(capsys, tiny):
    assert cli.main(["report", "--model", tiny, "--lora", "r=4", "--batch", "2", "--worst-of", "16,96,40,40"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert ", seq 96, batch 2," in lines[0]
    assert lines[2].startswith(f"Peak memory: {format_bytes(_peak(tiny, 96))} during ")
    assert lines[3] == "Sized at the worst sample 96 tokens (longest of 4 samples; median 40, 99th percentile 96)"
    assert _peak(tiny, 96) > _peak(tiny, 40)  # the median would have said less


def test_seq_lens_from_a_histogram_file_in_json(capsys, tiny, tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("# length count\n32 900\n64: 99\n128 1\n")
    assert (
        cli.main(["report", "--model", tiny, "--lora", "r=4", "--batch", "2", "--seq-lens-from", str(f), "--json"]) == 0
    )
    obj = json.loads(capsys.readouterr().out)
    assert obj["setup"]["seq_len"] == 128 and obj["peak_bytes"] == _peak(tiny, 128)
    assert obj["setup"]["worst_sample"] == {"seq_len": 128, "samples": 1000, "median": 32, "p99": 64}


def test_worst_seq_len_of_a_datasets_column():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {"input_ids": [[1] * 5, [2] * 300, [3] * 17], "n": [5, 300, 17], "text": ["a", "b", "c"]}
    )
    assert worst_seq_len(ds, "input_ids") == 300 == worst_seq_len(ds, "n")
    lengths = dataset_lengths(ds, "input_ids")
    assert lengths.samples == 3 and lengths.quantile(0.5) == 17
    with pytest.raises(WorkloadError, match="no column 'labels'; its columns: input_ids, n, text"):
        worst_seq_len(ds, "labels")
    with pytest.raises(WorkloadError, match="expected a length or a sequence of token ids"):
        worst_seq_len(datasets.Dataset.from_dict({"x": [1.5]}), "x")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "mlp", "--worst-of", "5"], "is a demo model"),
        (["--worst-of", "5", "--seq-len", "8"], "drop --seq-len"),
        (["--worst-of", "5", "--seq-lens-from", "x"], "not both"),
        (["--worst-of", "5,x" + "9" * 500], "expected numbers"),
    ],
)
def test_worst_flags_refused_in_one_line(capsys, tiny, argv, words):
    full = ["report", "--model", tiny, *argv] if "--model" not in argv else ["report", *argv]
    assert cli.main(full) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and len(err) < 260


def test_a_bad_lengths_file_is_one_line(tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("12\nabc " + "z" * 300 + "\n")
    with pytest.raises(WorkloadError, match="l.txt line 2: expected lengths") as e:
        read_lengths(f)
    assert len(str(e.value)) < 200
    f.write_text("0\n")
    with pytest.raises(WorkloadError, match="from 1 to"):
        read_lengths(f)


def test_plan_worst_of_plans_at_the_longest_sample(capsys, tiny):
    from memsave_nb import Plan

    assert (
        cli.main(
            [
                "plan",
                "--model",
                tiny,
                "--lora",
                "r=4",
                "--batch",
                "2",
                "--worst-of",
                "16,96",
                "--target-gb",
                "0.55",
                "--json",
            ]
        )
        == 0
    )
    obj = json.loads(capsys.readouterr().out)
    plan = Plan.from_dict(obj["chosen"]["plan"])
    with plan.apply(memsave_nb.from_pretrained(tiny, lora="r=4", seq_len=96, batch_size=2)) as w:
        assert obj["chosen"]["measured_peak_bytes"] == measure(w, mode="fake").peak_bytes
