"""Every script in bench/ runs in its quick mode and writes its JSON, so none can rot unseen
(issue 29: bench_engine.py had crashed for weeks on a changed private signature).

Each script runs as the user runs it, in a fresh process: ``python bench/X.py --quick --out F``.
Only the exit status and that F holds JSON are checked; what the numbers say is for the benches'
own tests (tests/test_bench_steady_state.py, tests/hub/test_bench_hub.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))
NEEDS = {
    "bench_hub.py": "accelerate",
    "bench_real_models.py": "transformers",
    "bench_planner_loop.py": "transformers",
    "bench_parallel.py": "transformers",
    "edit_speed.py": "peft",
}


def test_every_bench_script_is_listed():
    """A new script in bench/ is picked up here without anyone remembering to add it."""
    assert "bench_engine.py" in SCRIPTS and "cuda_check.py" in SCRIPTS and len(SCRIPTS) >= 12


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_quick_mode_runs_and_writes_json(script, tmp_path):
    needed = NEEDS.get(script)
    if needed and importlib.util.find_spec(needed) is None:
        pytest.skip(f"needs {needed}")
    out = tmp_path / f"{Path(script).stem}.json"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"{script} --quick exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert out.is_file(), f"{script} --quick wrote no {out.name}:\n{proc.stdout[-2000:]}"
    assert json.loads(out.read_text()), f"{script} --quick wrote an empty JSON"
