"""bench/edit_speed.py --quick (issue 42): runs in seconds, its before and after paths give equal
measurements (the bench exits otherwise), "before" really runs with every cut off, and the
switches are put back."""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("peft")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "edit_speed.py"


def _bench():
    spec = importlib.util.spec_from_file_location("edit_speed", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _switches(bench) -> list[bool]:
    return [getattr(importlib.import_module(m), a) for m, a in bench.CUTS.values()]


def test_before_is_every_cut_off_and_after_every_cut_on():
    bench = _bench()
    assert len(bench.CUTS) >= 2 and all(_switches(bench))
    with bench.cuts(False):
        assert not any(_switches(bench))
    only = next(iter(bench.CUTS))
    with bench.cuts(False, only):
        assert _switches(bench) == [name != only for name in bench.CUTS]
    assert all(_switches(bench))


def test_quick_mode_runs_and_writes_ratios(tmp_path):
    bench = _bench()
    out = tmp_path / "edit.json"
    result = bench.main(["--quick", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["edits"] == 3 and written["layers"] == 2 and written["quick"] is True
    for path in ("before", "after"):
        assert 0 < written[path]["cpu"]["median"] <= written[path]["cpu"]["max"]
    assert written["ratio"]["cpu_median"] == pytest.approx(
        written["before"]["cpu"]["median"] / written["after"]["cpu"]["median"]
    )
    assert written["floor_cpu_s"] > 0 and result["cuts"] == list(bench.CUTS)
    assert all(_switches(bench))
