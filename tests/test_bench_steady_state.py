"""Smoke test of bench/bench_steady_state.py's quick mode: it runs, its one-step and two-step
peaks agree (the bench exits otherwise), and it writes its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_steady_state.py"


def test_quick_mode_runs_and_writes_json(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_steady_state", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "steady.json"
    rows = bench.main(["--quick", "--out", str(out)])
    written = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in written] == [r["shape"] for r in rows] == ["gpt-tiny", "cnn"]
    assert all(r["one_step_s"] > 0 and r["two_steps_s"] > 0 and r["peak_bytes"] > 0 for r in written)
    assert all(r["first_step_peak_bytes"] is not None for r in written)
