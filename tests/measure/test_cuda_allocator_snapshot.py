"""Snapshots both ways: the predicted step opens in torch's own memory viewer code, and a user's
snapshot pickle is read as plain data only."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch.cuda._memory_viz as viz

from memsave_nb.errors import WorkloadError
from memsave_nb.measure import measure
from memsave_nb.measure.cuda_trace import replay
from memsave_nb.measure.snapshot import export_snapshot, load_snapshot

from .test_cuda_allocator_measure import _workload

MiB = 1 << 20
PWNED = Path("/tmp/memsave_nb_allocator_test_pwned")
DATA = Path(__file__).resolve().parents[1] / "data" / "gpu-traces"


@pytest.fixture(scope="module")
def predicted():
    m = measure(_workload(), "fake", repeats=1, flops=False)
    return m, export_snapshot(m.reserved.ops, conf="")


def test_export_opens_in_torch_memory_viz(predicted):
    m, snap = predicted
    assert sum(s["total_size"] for s in snap["segments"]) == 22 * MiB  # what the step left reserved
    summary = viz.segsum(snap)  # torch's own segment summary
    assert "total_reserved: 22.0MiB" in summary
    text = viz.trace(snap)
    assert f"\n{len(snap['device_traces'][0])} entries\n" in text and "cudaMalloc(" in text
    assert "stream_0" in viz.segments(snap, format_flamegraph=lambda s: s)
    assert "snapshot.pickle" in viz.trace_plot(snap)  # the HTML viewer, snapshot embedded
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert len(allocs) == sum(1 for _, n, _ in m.reserved.ops if n)


def test_exported_snapshot_round_trips_through_the_importer(predicted):
    _, snap = predicted
    back = load_snapshot(pickle.dumps(snap))
    assert back == snap
    r = replay(back, trace_addresses=True)
    assert r.model_segment_allocs == r.trace_segment_allocs == [20 * MiB, 2 * MiB]
    assert r.model_segments == r.dump_segments


def test_import_a_real_snapshot_pickle(tmp_path):
    data = json.loads((DATA / "eor_nn.json").read_text())
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(data))
    snap = load_snapshot(path)
    assert snap == data and replay(snap, trace_addresses=True).model_segments == replay(data).dump_segments


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("touch " + str(PWNED),))


@pytest.mark.parametrize(
    "payload, words",
    [
        (pickle.dumps({"x" * 300: 1, "segments": [_Evil()]}), "names a class"),
        (b"\x80\x04junk", "not a memory snapshot"),
        (pickle.dumps([1, 2]), "no 'segments' list"),
    ],
)
def test_hostile_or_wrong_files_are_refused_in_one_line(payload, words):
    with pytest.raises(WorkloadError, match=words) as e:
        load_snapshot(payload)
    msg = str(e.value)
    assert len(msg) <= 200 and "\n" not in msg and "xxx" not in msg
    assert not PWNED.exists()
