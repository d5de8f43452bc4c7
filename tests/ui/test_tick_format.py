"""The byte tick formatter (BokehJS, run here with node) tells close ticks apart."""

import json
import shutil
import subprocess

import pytest

from memsave_nb.ui.format import BYTES_TICK_JS

node = shutil.which("node")


def _labels(ticks: list[float]) -> list[str]:
    script = (
        f"const f = new Function('tick', 'index', 'ticks', {json.dumps(BYTES_TICK_JS)});"
        f"const t = {json.dumps(ticks)};"
        "console.log(JSON.stringify(t.map((x, i) => f(x, i, t))));"
    )
    return json.loads(subprocess.run([node, "-e", script], capture_output=True, text=True, check=True).stdout)


@pytest.mark.skipif(node is None, reason="node is not installed")
def test_close_peaks_get_distinct_labels():
    labels = _labels([12_420_000, 12_430_000, 12_440_000])
    assert len(set(labels)) == 3 and all(l.endswith("MiB") for l in labels)


@pytest.mark.skipif(node is None, reason="node is not installed")
def test_round_ticks_stay_short():
    assert _labels([0, 10 * 2**20, 20 * 2**20]) == ["0.0 MiB", "10.0 MiB", "20.0 MiB"]
    assert _labels([0, 200, 400]) == ["0 B", "200 B", "400 B"]
