"""One short check for a machine with a CUDA GPU: the tracker's peak against the allocator's.

    python bench/cuda_check.py            # about a minute; writes bench/results/cuda_check.json
    python bench/cuda_check.py --cpu      # dry run of the same code paths on the CPU (no allocator figures)
    python bench/cuda_check.py --quick --out /tmp/cuda_check.json   # the dry run as a smoke test: a failed run exits 1

For each demo model (cnn, gpt, mlp) on CUDA, ``measure()`` runs the baseline and two plans:
full activation checkpointing of every GPT block and training only the head (through
``memsave_nb.plan`` / ``memsave_nb.presets`` when they exist, else the same changes made by
hand on the modules). Printed per run: the tracker's peak, the allocator's peak made comparable,
their difference, saved activations and the median step time.

The comparison. ``torch.cuda.max_memory_allocated()`` counts every block the caching allocator
hands out, from a baseline taken (``cuda_baseline_bytes``) after parameters and batch already
sit on the device; the tracker counts tensor storages and includes parameters and batch. So
the allocator's side is

    allocator = cuda_peak_bytes - cuda_baseline_bytes + (tracker's parameters + inputs at peak)

and we print ``allocator - tracker``. Expected: a small positive gap, from the allocator's
512-byte rounding of every block and from cuBLAS/cuDNN workspaces that no dispatch mode sees.
Then the explorer runs headless on CUDA (if ``memsave_nb.ui.explorer`` exists).

Last, the replay check (issue 40; ``--no-replay`` skips it): per case (the demo models, a bf16
Llama from a config with and without checkpointing, and that one again under
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in a child process) the predicted
``max_memory_reserved`` of the fake-mode CPU twin, of ``measure()`` on the GPU, and of the real
step's recorded allocator events replayed through the model, beside the real one, each
difference explained where known. docs/cuda_step.md, "Running the GPU check", says what each
column means. Each case runs on its own: a failure prints its traceback, the rest go on, and the
exit status is 1 at the end. Without CUDA the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memsave_nb import measure, zoo  # noqa: E402
from memsave_nb.workload import Workload  # noqa: E402

BATCH = {"cnn": 64, "gpt": 8, "mlp": 512}
MiB = 2**20


# -- plans: through memsave_nb.plan when present, else by hand ----------------------------------------
def _plan_context(kind: str, wl: Workload) -> Callable[[], contextlib.AbstractContextManager]:
    try:
        from memsave_nb.plan import Plan
        from memsave_nb import presets
    except ImportError:
        return lambda: _manual(kind, wl)
    if kind == "checkpoint blocks":
        blocks = [n for n, _ in wl.model.named_modules() if n.startswith("blocks.") and n.count(".") == 1]
        if not blocks:
            return None  # type: ignore[return-value]
        plan = Plan(name=kind, regions={b: "full" for b in blocks})
    else:
        plan = presets.head_only(wl.model)
    return lambda: plan.apply(wl)


@contextlib.contextmanager
def _manual(kind: str, wl: Workload) -> Iterator[Workload]:
    model = wl.model
    if kind == "checkpoint blocks":
        from torch.utils.checkpoint import checkpoint

        blocks = getattr(model, "blocks", None)
        if blocks is None:
            raise LookupError("no blocks")
        originals = [b.forward for b in blocks]
        for b, f in zip(blocks, originals):
            b.forward = lambda *a, _f=f, **k: checkpoint(_f, *a, use_reentrant=False, **k)
        try:
            yield wl
        finally:
            for b in blocks:
                del b.forward
    else:
        flags = {n: p.requires_grad for n, p in model.named_parameters()}
        head = "head" if hasattr(model, "head") else list(dict(model.named_children()))[-1]
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith(head + "."))
        try:
            yield wl
        finally:
            for n, p in model.named_parameters():
                p.requires_grad_(flags[n])


# -- one run ---------------------------------------------------------------------------------------
def run(name: str, plan: str, wl: Workload, ctx: Callable[[], Any] | None, repeats: int = 3) -> dict[str, Any]:
    with ctx() if ctx is not None else contextlib.nullcontext(wl) as planned:
        m = measure(planned, repeats=repeats)
    pre = m.peak_split.parameters + m.peak_split.inputs
    if m.cuda_peak_bytes is None:  # --cpu dry run
        allocator = m.peak_bytes
    else:
        allocator = m.cuda_peak_bytes - m.cuda_baseline_bytes + pre
    return {
        "model": name,
        "plan": plan,
        "tracker_peak_bytes": m.peak_bytes,
        "allocator_peak_bytes": allocator,
        "cuda_peak_bytes": m.cuda_peak_bytes,
        "cuda_baseline_bytes": m.cuda_baseline_bytes,
        "gap_bytes": allocator - m.peak_bytes,
        "gap_percent": 100.0 * (allocator - m.peak_bytes) / m.peak_bytes,
        "saved_bytes": m.saved_bytes,
        "peak_phase": m.peak_phase,
        "step_ms": 1e3 * m.step_seconds if m.step_seconds else None,
    }


def explorer_check(device: str, batch: int | None = None) -> str:
    """The explorer headless on the GPT demo (at ``batch``, else the zoo's default)."""
    try:
        from memsave_nb.ui.explorer import explore
    except ImportError:
        return "skipped: memsave_nb.ui.explorer not importable"
    start = time.perf_counter()
    ex = explore(zoo.make("gpt", batch, device=device) if batch else "gpt", device=device, live=False, repeats=1)
    ex.run_now(raise_errors=True)
    m = ex.measurement
    return (
        f"ok: explorer on {m.device}: peak {m.peak_bytes / MiB:.1f} MiB, allocator "
        f"{(m.cuda_peak_bytes or 0) / MiB:.1f} MiB, {time.perf_counter() - start:.1f} s"
    )


# -- replay check (issue 40): the allocator model against max_memory_reserved ---------------------
REPLAY_CASES = ("mlp", "cnn", "gpt", "llama bf16", "llama bf16 ckpt")
EXPANDABLE = "expandable_segments:True"
EXPANDABLE_CASE = "llama bf16 ckpt"  # rerun in a child process under EXPANDABLE (read once per process)
SHARED_TRACE = ROOT / "tests" / "data" / "gpu-traces" / "eor_nn.json"


def _gpu_key(dry: bool) -> str | None:
    """The ``SIZED_GPUS`` key of this GPU (by name, else by compute capability); None: the H100 default."""
    from memsave_nb.workload import SIZED_GPUS

    if dry:
        return None
    name = torch.cuda.get_device_name(0).lower().replace(" ", "")
    named = [k for k in SIZED_GPUS if k in name]
    if named:
        return named[0]
    cap = torch.cuda.get_device_capability(0)
    return next((k for k, v in SIZED_GPUS.items() if v == cap), None)


def _llama(device: str, checkpoint: bool, small: bool) -> Workload:
    """A Llama built from a config (random weights, nothing downloaded), in bf16, its batch made
    on ``device``; HF's own non-reentrant checkpointing of every layer when ``checkpoint``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d, layers, vocab, batch, seq = (64, 2, 1000, 1, 32) if small else (512, 4, 32000, 4, 512)
    cfg = LlamaConfig(
        hidden_size=d,
        intermediate_size=3 * d,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=vocab,
        max_position_embeddings=max(512, seq),
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device(device):  # initialised where it runs: the CPU's init of 45M weights takes seconds
            model = LlamaForCausalLM(cfg).to(dtype=torch.bfloat16).train()
        ids = torch.randint(0, vocab, (batch, seq), device=device)
    if checkpoint:  # transformers 5.25 renamed gradient_checkpointing_enable (the old name warns)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    return Workload(model, {"input_ids": ids, "labels": ids}, device=device, name="llama")


def _replay_workload(case: str, device: str, small: bool) -> Workload:
    if case.startswith("llama"):
        return _llama(device, checkpoint=case.endswith("ckpt"), small=small)
    return zoo.make(case, BATCH.get(case), device=device)


def real_step(wl: Workload, record: bool) -> dict[str, Any]:
    """The steady step as ``measure()`` tracks it (optimizer state made, grads None, batch on the
    device), run for real after two warm steps (optimizer state, cuBLAS workspace, cuDNN's
    choices), from a known start: ``empty_cache()`` then ``reset_peak_memory_stats()``. On CUDA
    with ``record`` the step's allocator events are recorded (``_record_memory_history``)."""
    from memsave_nb.measure.training_step import training_step

    cuda = torch.device(wl.device).type == "cuda"
    opt = wl.make_optimizer()

    def step() -> None:
        left = training_step(wl, lambda last: wl.make_batch(), opt, runner="cuda_check")
        del left
        if opt is not None:
            opt.zero_grad(set_to_none=wl.set_to_none)

    out: dict[str, Any] = {"max_reserved": None, "start_reserved": None, "start_allocated": None, "snapshot": None}
    try:
        step()
        step()
        if cuda:
            gc.collect()  # earlier cases' cycles (HF models) hold blocks until collected
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            out["start_reserved"] = torch.cuda.memory_reserved()
            out["start_allocated"] = torch.cuda.memory_allocated()
            if record:
                torch.cuda.memory._record_memory_history("all", context=None, stacks="python", clear_history=True)
        try:
            step()
            if cuda:
                torch.cuda.synchronize()
                out["max_reserved"] = torch.cuda.max_memory_reserved()
                if record:
                    out["snapshot"] = plain_snapshot(torch.cuda.memory._snapshot(), torch.cuda.current_device())
        finally:
            if cuda and record:
                torch.cuda.memory._record_memory_history(None)
    finally:
        for p in wl.model.parameters():
            p.grad = None
    return out


def plain_snapshot(raw: dict[str, Any], device: int = 0) -> dict[str, Any]:
    """A ``_snapshot()`` as ``tests/data/gpu-traces`` holds one (no frames; no ``oom`` entries, which
    carry no address), for ``cuda_trace.replay``."""
    seg_keys = ("device", "address", "total_size", "allocated_size", "stream", "segment_type", "is_expandable")
    traces = raw["device_traces"]
    traces = traces[device] if len(traces) > device else traces[-1]  # one list per device, or the one asked for
    return {
        "segments": [
            {k: s[k] for k in seg_keys if k in s}
            | {
                "blocks": [
                    {k: b[k] for k in ("address", "size", "requested_size", "state") if k in b} for b in s["blocks"]
                ]
            }
            for s in raw.get("segments", [])
            if s.get("device", device) == device
        ],
        "device_traces": [
            [{k: e[k] for k in ("action", "addr", "size", "stream") if k in e} for e in traces if "addr" in e]
        ],
    }


def model_snapshot(ops, settings, workspace: int = 0) -> tuple[dict[str, Any], int]:
    """The dry run's stand-in for a recorded step: the tracker's allocator calls run through the
    model with recording switched on after the preexisting ones and the cuBLAS workspace (the real
    recording starts after the model, its state and the warm steps' workspace exist). Returns the
    snapshot and the max reserved from there."""
    from memsave_nb.measure.cuda_allocator import CachingAllocator

    start = _start_ops(ops, workspace)
    alloc = CachingAllocator(settings)
    blocks: dict[int, Any] = {}
    first = set(start)
    for key, n, e in start + tuple(op for op in ops if op not in first):
        if alloc.trace is None and (key, n, e) not in first:
            alloc.trace = []
            alloc.stats.max_reserved = alloc.stats.reserved  # reset_peak_memory_stats()
        if n:
            blocks[key] = alloc.malloc(n)
        else:
            alloc.free(blocks.pop(key))
    segments = [
        {
            "address": s.addr,
            "total_size": s.size,
            "stream": s.stream,
            "segment_type": "small" if s.small else "large",
            "is_expandable": s.expandable,
            "blocks": [
                {
                    "address": b.addr,
                    "size": b.size,
                    "requested_size": b.requested if b.allocated else 0,
                    "state": "active_allocated" if b.allocated else "inactive",
                }
                for b in s.blocks()
            ],
        }
        for s in alloc.segments
    ]
    return {"segments": segments, "device_traces": [alloc.trace or []]}, alloc.stats.max_reserved


def replay_snapshot(snap: dict[str, Any], settings) -> dict[str, Any]:
    """The recorded events through the model (``cuda_trace.replay``): its max reserved and
    whether it made the very segments the allocator made (the exact oracle)."""
    from memsave_nb.measure.cuda_trace import replay

    events = snap["device_traces"][0]
    allocs = sum(e["action"] == "alloc" for e in events)
    if settings.expandable_segments or any(e["action"].startswith("segment_map") for e in events):
        return {"max_reserved": None, "exact": None, "allocs": allocs, "segment_allocs": None}
    r = replay(snap, settings=settings, trace_addresses=True)
    return {
        "max_reserved": r.max_reserved,
        "exact": r.model_segment_allocs == r.trace_segment_allocs and r.model_segments == r.dump_segments,
        "allocs": allocs,
        "segment_allocs": len(r.trace_segment_allocs),
    }


def _start_ops(ops, workspace: int) -> tuple[tuple[int, int, int], ...]:
    """The preexisting records' allocations (parameters, optimizer state, batch) and the cuBLAS
    workspace's (``with_workspace`` gives it the last key): what a real step finds allocated."""
    last = max((op[0] for op in ops), default=-1)
    return tuple(op for op in ops if op[2] < 0 or (workspace and op[0] == last and op[1] == workspace))


def _start_reserved(ops, settings, workspace: int) -> int:
    """Reserved after ``_start_ops`` alone, from an empty allocator."""
    from memsave_nb.measure.reserved import run_ops

    alloc, _ = run_ops(_start_ops(ops, workspace), settings)
    return alloc.stats.reserved


def _workspace_live(snap: dict[str, Any] | None, nbytes: int) -> bool | None:
    """Whether a block of exactly the cuBLAS workspace's size was live when the step began."""
    if snap is None:
        return None
    allocated = {e["addr"] for e in snap["device_traces"][0] if e["action"] == "alloc"}
    return any(
        b["state"] == "active_allocated" and b["requested_size"] == nbytes and b["address"] not in allocated
        for s in snap["segments"]
        for b in s["blocks"]
    )


def replay_case(case: str, dry: bool, quick: bool) -> dict[str, Any]:
    """One case: the fake-mode prediction on a CPU twin, ``measure()`` on the device (the
    tracker's events through the model), the real step's max reserved and its recorded events
    through the model."""
    from memsave_nb.measure.cublas_workspace import workspace_bytes
    from memsave_nb.measure.reserved import settings_of

    device = "cpu" if dry else "cuda"
    gpu = _gpu_key(dry)
    settings, conf = settings_of(None)
    small = dry
    twin = _replay_workload(case, "cpu", small).replace(sized_for="cuda", gpu=gpu)
    fake = measure(twin, mode="fake", repeats=0)
    del twin
    wl = _replay_workload(case, device, small).replace(sized_for="cuda", gpu=gpu)
    real = real_step(wl, record=not dry)
    if not dry:
        torch.cuda.empty_cache()
    m = measure(wl, repeats=0)
    assert fake.reserved is not None and m.reserved is not None
    snap = real["snapshot"]
    reference = real["max_reserved"]
    if snap is None:  # dry run: the tracker's own events, recorded through the model, stand in
        snap, reference = model_snapshot(m.reserved.ops, settings, m.reserved.workspace_bytes)
    rep = replay_snapshot(snap, settings)
    ws = workspace_bytes(gpu)
    tracker_allocs = sum(1 for _, n, e in m.reserved.ops if n and e >= 0) - (1 if m.reserved.workspace_bytes else 0)
    row: dict[str, Any] = {
        "case": case,
        "alloc_conf": conf,
        "fake_reserved": fake.reserved.max_reserved_bytes,
        "tracker_reserved": m.reserved.max_reserved_bytes,
        "trace_reserved": rep["max_reserved"],
        "real_reserved": real["max_reserved"],
        "replay_reference": reference,
        "replay_exact": rep["exact"],
        "trace_allocs": rep["allocs"],
        "tracker_allocs": tracker_allocs,
        "trace_segment_allocs": rep["segment_allocs"],
        "real_start_reserved": real["start_reserved"],
        "real_start_allocated": real["start_allocated"],
        "predicted_start_reserved": _start_reserved(m.reserved.ops, settings, m.reserved.workspace_bytes),
        "fake_workspace_bytes": fake.reserved.workspace_bytes,
        "workspace_live_at_start": _workspace_live(real["snapshot"], ws),
        "fake_peak_bytes": fake.peak_bytes,
        "tracker_peak_bytes": m.peak_bytes,
    }
    for col in ("fake", "tracker", "trace"):
        a, b = row[f"{col}_reserved"], row["real_reserved"]
        row[f"{col}_minus_real"] = None if a is None or b is None else a - b
    row["why"] = explain(row, ws)
    return row


def explain(row: dict[str, Any], ws: int) -> list[str]:
    """What is known to part the columns, read from the row's own figures."""
    why = []
    if row["replay_exact"] is None:
        why.append("trace replay n/a: expandable segments map pages (no segment_alloc to rebuild the start from)")
    elif row["replay_exact"] and row["trace_reserved"] == row["replay_reference"]:
        why.append("trace replay exact (same segments, same max)")
    else:
        why.append("TRACE REPLAY DIFFERS from the allocator: a model bug, report it")
    extra = row["trace_allocs"] - row["tracker_allocs"]
    if row["real_reserved"] is not None and extra:
        why.append(f"{extra:+d} allocations below the dispatcher (cuDNN/cuBLASLt/SDPA workspaces) or not seen")
    if row["workspace_live_at_start"]:
        why.append(f"cuBLAS workspace {ws / MiB:.0f} MiB live from the warm steps (in both predictions)")
    elif row["workspace_live_at_start"] is False:
        why.append(
            f"no {ws / MiB:.0f} MiB block live at start: cuBLAS keeps its workspace outside the allocator? "
            "predictions are high by it"
        )
    rs, ps = row["real_start_reserved"], row["predicted_start_reserved"]
    if rs is not None and rs != ps:
        why.append(
            f"start state: real {rs / MiB:.1f} MiB reserved vs {ps / MiB:.1f} MiB replayed from empty "
            "(parameters loaded, state made in earlier steps)"
        )
    if row["fake_reserved"] != row["tracker_reserved"]:
        why.append("fake twin vs tracker on device: ops/kernels the CPU twin sizes differently")
    return why


def _mib(v: int | None, width: int) -> str:
    return f"{v / MiB:{width}.1f}" if v is not None else f"{'-':>{width}}"


def print_replay_row(r: dict[str, Any]) -> None:
    print(
        f"{r['case'] + (' (expandable)' if 'expandable' in r['alloc_conf'] else ''):30} "
        f"{_mib(r['fake_reserved'], 9)} {_mib(r['tracker_reserved'], 9)} {_mib(r['trace_reserved'], 9)} "
        f"{_mib(r['real_reserved'], 9)} {_mib(r['fake_minus_real'], 8)} {_mib(r['tracker_minus_real'], 8)} "
        f"{_mib(r['trace_minus_real'], 8)}"
    )
    for line in r["why"]:
        print(f"{'':32}- {line}")


def expandable_child(dry: bool, quick: bool, tmp: Path) -> dict[str, Any]:
    """``EXPANDABLE_CASE`` in a fresh process under ``PYTORCH_CUDA_ALLOC_CONF=EXPANDABLE`` (torch
    reads the setting once, at the allocator's first use)."""
    out = tmp / "cuda_check_expandable.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--replay-case", EXPANDABLE_CASE, "--case-out", str(out)]
    cmd += ["--cpu"] if dry else []
    cmd += ["--quick"] if quick else []
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=EXPANDABLE)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"child exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] or ['']}")
    return json.loads(out.read_text())


def shared_trace_check() -> str:
    """The replay against a trace recorded on a real GPU (tests/data/gpu-traces), as a self-check."""
    from memsave_nb.measure.cuda_allocator import Settings

    if not SHARED_TRACE.is_file():
        return "skipped: no tests/data/gpu-traces/eor_nn.json"
    snap = json.loads(SHARED_TRACE.read_text())
    rep = replay_snapshot(snap, Settings())
    dump = sum(s["total_size"] for s in snap["segments"])
    return f"{'exact' if rep['exact'] else 'DIFFERS'}: {rep['segment_allocs']} segment_allocs, {dump / MiB:.0f} MiB at dump"


def replay_section(dry: bool, quick: bool, tmp: Path) -> tuple[list[dict[str, Any]], int, dict[str, Any]]:
    """Every replay case (each on its own: a failure prints its traceback and the rest go on)."""
    failures = 0
    rows: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    print("\nreplay check: predicted max_memory_reserved against the real one (MiB)")
    print(
        "fake = measure(mode='fake') on a CPU twin sized for this GPU; tracker = measure() on the device, its"
        " events through the model;\ntrace = the real step's recorded allocator events through the model;"
        " real = torch.cuda.max_memory_reserved() over one steady step\n"
    )
    print(
        f"{'case':30} {'fake':>9} {'tracker':>9} {'trace':>9} {'real':>9} {'fake-r':>8} {'track-r':>8} {'trace-r':>8}"
    )
    jobs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        (c, lambda c=c: replay_case(c, dry, quick)) for c in REPLAY_CASES
    ]
    jobs.append((f"{EXPANDABLE_CASE} (expandable)", lambda: expandable_child(dry, quick, tmp)))
    for case, job in jobs:
        try:
            row = job()
        except Exception as exc:  # noqa: BLE001 - report and go on: one script, one pass
            failures += 1
            print(f"{case:30} FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
            traceback.print_exc(limit=4)
            continue
        rows.append(row)
        print_replay_row(row)
        if not dry:
            torch.cuda.empty_cache()
    try:
        info["shared_trace"] = shared_trace_check()
    except Exception as exc:  # noqa: BLE001
        failures += 1
        info["shared_trace"] = f"FAILED: {type(exc).__name__}: {exc}"
    print(f"\nreplay of the shared GPU trace eor_nn.json: {info['shared_trace']}")
    if not dry:
        free, total = torch.cuda.mem_get_info()
        info["outside_allocator_bytes"] = total - free - torch.cuda.memory_reserved()
        print(
            f"outside the allocator (CUDA context, cuBLAS/cuDNN handles; never in max_memory_reserved): "
            f"{info['outside_allocator_bytes'] / MiB:.0f} MiB = used by the GPU (mem_get_info) - memory_reserved()"
        )
    return rows, failures, info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="dry run of the same code paths on the CPU")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: the CPU dry run at batch 1-8, 1 timed step; any failed run exits 1",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON output (default bench/results/cuda_check.json, /tmp/cuda_check_cpu_dry_run.json for a dry run)",
    )
    parser.add_argument("--no-replay", action="store_true", help="skip the replay check (max_memory_reserved)")
    parser.add_argument("--replay-case", default=None, help=argparse.SUPPRESS)  # the child of expandable_child
    parser.add_argument("--case-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    dry = args.cpu or args.quick
    failures = 0
    if args.replay_case is not None:
        return _child(args, dry)
    if not dry and not torch.cuda.is_available():
        print(
            "cuda_check: no CUDA device visible to this torch (torch.cuda.is_available() is False); nothing to check."
        )
        return 0
    device = "cpu" if dry else "cuda"
    if dry:
        _small_batches(args.quick)
    device_name = "CPU (dry run)" if dry else torch.cuda.get_device_name(0)
    print(f"cuda_check on {device_name}, torch {torch.__version__}")
    print("allocator = cuda_peak - cuda_baseline + tracker's (parameters + inputs); gap = allocator - tracker\n")
    rows: list[dict[str, Any]] = []
    header = f"{'model':5} {'plan':18} {'tracker MiB':>12} {'allocator MiB':>14} {'gap MiB':>9} {'gap %':>7} {'saved MiB':>10} {'step ms':>8}"
    print(header)
    started = time.perf_counter()
    for name in ("mlp", "cnn", "gpt"):
        wl = zoo.make(name, BATCH[name], device=device)
        for plan in ("baseline", "checkpoint blocks", "head only"):
            try:
                ctx = None if plan == "baseline" else _plan_context(plan, wl)
                if plan == "checkpoint blocks" and (ctx is None or not hasattr(wl.model, "blocks")):
                    continue
                r = run(name, plan, wl, ctx, repeats=1 if args.quick else 3)
            except Exception as exc:  # noqa: BLE001 - report and go on: one script, one pass
                failures += 1
                print(
                    f"{name:5} {plan:18} FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                )
                traceback.print_exc(limit=3)
                continue
            rows.append(r)
            print(
                f"{name:5} {plan:18} {r['tracker_peak_bytes'] / MiB:12.2f} {r['allocator_peak_bytes'] / MiB:14.2f} "
                f"{r['gap_bytes'] / MiB:9.2f} {r['gap_percent']:7.2f} {r['saved_bytes'] / MiB:10.2f} "
                f"{(r['step_ms'] or 0):8.1f}"
            )
        del wl
        if not dry:
            torch.cuda.empty_cache()
    try:
        explorer = explorer_check(device, BATCH["gpt"] if args.quick else None)
    except Exception as exc:  # noqa: BLE001
        failures += 1
        explorer = f"FAILED: {type(exc).__name__}: {exc}"
    print(f"\nexplorer headless: {explorer}")
    replay_rows: list[dict[str, Any]] = []
    replay_info: dict[str, Any] = {}
    if not args.no_replay:
        with tempfile.TemporaryDirectory() as tmp:
            replay_rows, failed, replay_info = replay_section(dry, args.quick, Path(tmp))
        failures += failed
    gaps = [abs(r["gap_percent"]) for r in rows]
    summary = {
        "device": device_name,
        "torch": torch.__version__,
        "rows": rows,
        "explorer": explorer,
        "max_abs_gap_percent": max(gaps) if gaps else None,
        "median_abs_gap_percent": statistics.median(gaps) if gaps else None,
        "replay": replay_rows,
        **replay_info,
        "failures": failures,
        "seconds": time.perf_counter() - started,
    }
    out = ROOT / "bench" / "results" / ("cuda_check_cpu_dry_run.json" if dry else "cuda_check.json")
    if dry:
        out = Path("/tmp") / out.name
    out = args.out or out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"max |gap| {summary['max_abs_gap_percent']:.2f}% over {len(rows)} runs, {summary['seconds']:.0f} s; wrote {out}"
    )
    if failures:
        print(f"{failures} case(s) FAILED (tracebacks above)")
    return 1 if failures else 0


def _small_batches(quick: bool) -> None:
    BATCH.update({"cnn": 2, "gpt": 1, "mlp": 8} if quick else {"cnn": 8, "gpt": 2, "mlp": 64})


def _child(args: argparse.Namespace, dry: bool) -> int:
    """One replay case in this process (``expandable_child``), its row written to ``--case-out``."""
    if dry:
        _small_batches(args.quick)
    elif not torch.cuda.is_available():
        print("cuda_check: no CUDA device in the child", file=sys.stderr)
        return 1
    row = replay_case(args.replay_case, dry, args.quick)
    if args.case_out is not None:
        args.case_out.write_text(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
