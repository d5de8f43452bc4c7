"""PyTorch memory snapshots both ways.

Export: the predicted step as the dict ``torch.cuda.memory._snapshot()`` returns (segments with
their blocks, one device trace), so ``torch.cuda._memory_viz`` and pytorch.org/memory_viz open
it (``pickle.dump`` it to a file). Import: a user's ``_dump_snapshot`` pickle read by an
unpickler that builds containers only and refuses every class, so a hostile file runs nothing;
``cuda_trace.replay`` then checks the model against it.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from typing import Any

from ..errors import WorkloadError
from .cuda_allocator import CachingAllocator, Settings
from .reserved import settings_of

MAX_SNAPSHOT_BYTES = 2 << 30


def _segments(alloc: CachingAllocator) -> list[dict]:
    out = []
    for seg in sorted(alloc.segments, key=lambda g: g.addr):
        blocks: list[dict[str, Any]] = [
            {
                "address": b.addr,
                "size": b.size,
                "requested_size": b.requested if b.allocated else b.size,
                "state": "active_allocated" if b.allocated else "inactive",
                "frames": [],
            }
            for b in seg.blocks()
        ]
        used = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        out.append(
            {
                "device": 0,
                "address": seg.addr,
                "total_size": seg.size,
                "allocated_size": used,
                "active_size": used,
                "requested_size": sum(b["requested_size"] for b in blocks if b["state"] == "active_allocated"),
                "stream": seg.stream,
                "segment_type": "small" if seg.small else "large",
                "segment_pool_id": (0, 0),
                "is_expandable": seg.expandable,
                "frames": [],
                "blocks": blocks,
            }
        )
    return out


def export_snapshot(ops, conf: str | None = None) -> dict:
    """Replay allocator calls (``Measurement.reserved.ops``) and return a snapshot dict: the
    trace of every call and the segments at the end of the step."""
    settings: Settings = settings_of(conf)[0]
    alloc = CachingAllocator(settings)
    alloc.trace = []
    blocks = {}
    for key, n, _ in ops:
        if n:
            blocks[key] = alloc.malloc(n)
        else:
            alloc.free(blocks.pop(key))
    for t, e in enumerate(alloc.trace):
        e["time_us"] = t
    return {
        "segments": _segments(alloc),
        "device_traces": [alloc.trace],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": settings_of(conf)[1]},
    }


class _ContainersOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError("the file names a class; a memory snapshot holds only plain data")


def load_snapshot(source: str | os.PathLike | bytes) -> dict:
    """A ``_dump_snapshot`` pickle (or this project's JSON of one), from a path or bytes, read as
    plain data only. Bad input raises ``WorkloadError`` in one line."""
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    else:
        try:
            if os.path.getsize(source) > MAX_SNAPSHOT_BYTES:
                raise WorkloadError("memory snapshot over 2 GiB: not loaded")
            with open(source, "rb") as f:
                data = f.read()
        except OSError as e:
            raise WorkloadError(f"cannot read the memory snapshot ({type(e).__name__})") from None
    try:
        snap = json.loads(data) if data[:1] in (b"{", b"[") else _ContainersOnly(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, IndexError, KeyError, AttributeError) as e:
        why = str(e)[:80] if isinstance(e, pickle.UnpicklingError) else type(e).__name__
        raise WorkloadError(f"not a memory snapshot: {why}") from None
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list):
        raise WorkloadError("not a memory snapshot: no 'segments' list (expected torch.cuda.memory._snapshot()'s dict)")
    if not isinstance(snap.get("device_traces", []), list):
        raise WorkloadError("not a memory snapshot: 'device_traces' is not a list")
    return snap
