"""bench/cuda_check.py's replay check (issue 40) in its CPU dry run: the code a GPU session runs
first time, checked here on what the CPU has (the tracker's events recorded through the model,
and a trace recorded on a real GPU, tests/data/gpu-traces)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


@pytest.fixture(scope="module")
def cc():
    spec = importlib.util.spec_from_file_location("cuda_check_under_test", ROOT / "bench" / "cuda_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod._small_batches(True)
    return mod


def _as_torch_gives_it(snap: dict) -> dict:
    """A plain snapshot dressed as ``torch.cuda.memory._snapshot()`` returns one: frames on every
    segment, block and event, a device key, a second device's segment to leave out, and an ``oom``
    entry (it has no address) at the end."""
    segs = [
        s
        | {
            "device": 0,
            "frames": [{"filename": "x.py", "line": 1}],
            "blocks": [b | {"frames": []} for b in s["blocks"]],
        }
        for s in snap["segments"]
    ]
    other = dict(segs[0], device=1, address=1 << 50)
    events = [e | {"frames": [], "time_us": i} for i, e in enumerate(snap["device_traces"][0])]
    events.append({"action": "oom", "size": 1 << 40, "device_free": 0, "stream": 0, "frames": []})  # no addr
    return {"segments": segs + [other], "device_traces": [events, []], "allocator_settings": {}}


def test_a_real_gpu_trace_goes_through_plain_snapshot_and_replays_exactly(cc):
    """The oracle: eor_nn.json was recorded on a real GPU; after the round trip through the
    converter the bench uses on a live ``_snapshot()`` its 7 segment_allocs come out to the byte."""
    from memsave_nb.measure.cuda_allocator import Settings

    snap = json.loads((ROOT / "tests" / "data" / "gpu-traces" / "eor_nn.json").read_text())
    plain = cc.plain_snapshot(_as_torch_gives_it(snap), 0)
    assert len(plain["segments"]) == len(snap["segments"])  # device 1 left out
    assert "frames" not in plain["device_traces"][0][0]
    rep = cc.replay_snapshot(plain, Settings())
    assert rep == {"max_reserved": rep["max_reserved"], "exact": True, "allocs": 1935, "segment_allocs": 7}
    assert rep["max_reserved"] >= 128 * MiB  # 128 MiB at the dump, never more freed than made


def test_the_dry_run_case_records_the_tracker_events_and_replays_them_exactly(cc):
    row = cc.replay_case("mlp", dry=True, quick=True)
    assert row["real_reserved"] is None and row["real_start_reserved"] is None  # no GPU here
    assert row["replay_exact"] is True
    # the recorded events (start state rebuilt from the dump) reserve what the model reserved
    assert row["trace_reserved"] == row["replay_reference"] == row["tracker_reserved"]
    assert row["tracker_allocs"] == row["trace_allocs"] > 0
    # parameters (784x1024 + 1024x1024 + ...), their AdamW state and the 32 MiB workspace of an H100
    assert row["fake_workspace_bytes"] == 32 * MiB
    assert 32 * MiB < row["predicted_start_reserved"] < row["tracker_reserved"]
    assert row["tracker_reserved"] % (2 * MiB) == 0 and row["fake_reserved"] % (2 * MiB) == 0
    assert row["why"][0].startswith("trace replay exact")
    assert json.loads(json.dumps(row)) == row  # what goes into bench/results/cuda_check.json


def test_a_failing_case_is_reported_and_the_others_run_and_expandable_runs_in_a_child(
    cc, monkeypatch, tmp_path, capsys
):
    monkeypatch.setattr(cc, "REPLAY_CASES", ("no such model", "mlp"))
    monkeypatch.setattr(cc, "EXPANDABLE_CASE", "mlp")
    rows, failures, info = cc.replay_section(dry=True, quick=True, tmp=tmp_path)
    out = capsys.readouterr()
    assert failures == 1 and "no such model" in out.out and "FAILED: WorkloadError" in out.out
    assert [r["case"] for r in rows] == ["mlp", "mlp"]
    plain, child = rows
    assert plain["alloc_conf"] == "" and child["alloc_conf"] == cc.EXPANDABLE  # read in the child's process
    assert child["trace_reserved"] is None and child["replay_exact"] is None  # said, not guessed
    assert child["tracker_reserved"] != plain["tracker_reserved"]  # pages of 2/20 MiB, one segment per pool
    assert info["shared_trace"].startswith("exact: 7 segment_allocs")


def test_the_gpu_only_lines_of_a_row_print(cc, capsys):
    """The explanations and the row as a GPU run fills them (real figures, the workspace seen or
    not), formatted here since no GPU is at hand: a typo there would only show on the GPU."""
    row = {
        "case": "gpt",
        "alloc_conf": "",
        "fake_reserved": 120 * MiB,
        "tracker_reserved": 122 * MiB,
        "trace_reserved": 140 * MiB,
        "real_reserved": 140 * MiB,
        "replay_reference": 140 * MiB,
        "replay_exact": True,
        "trace_allocs": 812,
        "tracker_allocs": 800,
        "real_start_reserved": 60 * MiB,
        "predicted_start_reserved": 58 * MiB,
        "workspace_live_at_start": True,
    }
    for col in ("fake", "tracker", "trace"):
        row[f"{col}_minus_real"] = row[f"{col}_reserved"] - row["real_reserved"]
    row["why"] = cc.explain(row, 32 * MiB)
    assert row["why"][0] == "trace replay exact (same segments, same max)"
    assert row["why"][1].startswith("+12 allocations below the dispatcher")
    assert row["why"][2].startswith("cuBLAS workspace 32 MiB live")
    assert row["why"][3].startswith("start state: real 60.0 MiB reserved vs 58.0 MiB")
    cc.print_replay_row(row)
    first = capsys.readouterr().out.splitlines()[0].split()
    assert first == ["gpt", "120.0", "122.0", "140.0", "140.0", "-20.0", "-18.0", "0.0"]
    no_ws = cc.explain(dict(row, workspace_live_at_start=False, trace_reserved=139 * MiB), 32 * MiB)
    assert no_ws[0].startswith("TRACE REPLAY DIFFERS") and any("outside the allocator" in w for w in no_ws)
