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
Last, the explorer runs headless on CUDA (if ``memsave_nb.ui.explorer`` exists).
Without CUDA the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
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
    args = parser.parse_args(argv)
    dry = args.cpu or args.quick
    failures = 0
    if not dry and not torch.cuda.is_available():
        print(
            "cuda_check: no CUDA device visible to this torch (torch.cuda.is_available() is False); nothing to check."
        )
        return 0
    device = "cpu" if dry else "cuda"
    if dry:
        BATCH.update({"cnn": 2, "gpt": 1, "mlp": 8} if args.quick else {"cnn": 8, "gpt": 2, "mlp": 64})
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
    gaps = [abs(r["gap_percent"]) for r in rows]
    summary = {
        "device": device_name,
        "torch": torch.__version__,
        "rows": rows,
        "explorer": explorer,
        "max_abs_gap_percent": max(gaps) if gaps else None,
        "median_abs_gap_percent": statistics.median(gaps) if gaps else None,
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
    return 1 if args.quick and failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
