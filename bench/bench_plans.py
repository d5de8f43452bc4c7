"""What each plan costs and saves on the GPT demo, side by side in one run.

For every plan: saved activations, peak and median step time, each as a ratio to the baseline
(the model as built, all parameters trainable, eager). Printed as a table and written to
``bench/results/plans.json``.

    python bench/bench_plans.py                     # the GPT demo, batch 8, budgets 1.0 0.5 0.0
    python bench/bench_plans.py --budgets           # no compiled plans (fast)
    python bench/bench_plans.py --batch-size 4 --repeats 3
    python bench/bench_plans.py --quick --out /tmp/plans.json   # smoke test: 2-layer GPT, 1 step, no compile
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from memsave_nb import presets, zoo
from memsave_nb.checkpointing import suggest_regions
from memsave_nb.measure.compiled import original_model
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.plan import Plan
from memsave_nb.session import Session

RESULTS = Path(__file__).resolve().parent / "results" / "plans.json"


def plans_for(workload, budgets: list[float]) -> list[Plan]:
    model = workload.model
    blocks = suggest_regions(model)
    out = [
        presets.head_only(model),
        presets.last_blocks(model, 1),
        presets.bias_only(model),
        presets.norm_only(model),
        presets.first_quarter(model),
        presets.last_quarter(model),
        Plan(name="checkpoint blocks: full", regions={b: "full" for b in blocks}),
        Plan(name="checkpoint blocks: save matmuls", regions={b: "save_matmuls" for b in blocks}),
        Plan(name="checkpoint blocks: save compute-intensive", regions={b: "save_compute_intensive" for b in blocks}),
        Plan(name="checkpoint blocks: SAC recompute all", regions={b: "recompute_all" for b in blocks}),
        Plan(
            name="head only + checkpoint blocks: full",
            frozen="*",
            trainable=presets.head_name(model),
            regions={b: "full" for b in blocks},
        ),
    ]
    out += [Plan(name=f"compile, budget {b:g}", compile_budget=b) for b in budgets]
    return out


def _one_step(workload) -> float:
    """Seconds of one forward, backward and optimizer step; the model is put back afterwards."""
    model = original_model(workload.model)
    snapshot = ModelSnapshot.capture(model, copy_values=True)
    try:
        optimizer = workload.make_optimizer()
        batch = workload.make_batch()
        start = time.perf_counter()
        workload.compute_loss(workload.forward(batch)).backward()
        if optimizer is not None:
            optimizer.step()
        return time.perf_counter() - start
    finally:
        snapshot.restore(model)


def time_interleaved(workload, plans: list[Plan], rounds: int) -> dict[int, list[float]]:
    """Step times per plan index, one step of each plan per round (after one warm-up round)."""
    times: dict[int, list[float]] = {i: [] for i in range(len(plans))}
    for r in range(rounds + 1):
        for i, plan in enumerate(plans):
            with plan.apply(workload) as applied:
                seconds = _one_step(applied)
            if r:
                times[i].append(seconds)
    return times


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:8.2f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:5.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per plan (median)")
    parser.add_argument(
        "--budgets", type=float, nargs="*", default=[1.0, 0.5, 0.0], help="compile budgets ([] for none)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: a 2-layer GPT at seq 32, batch 2, one timed step, no compiled plans",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.repeats, args.budgets = 2, 1, []

    if args.quick:
        workload = zoo.gpt(zoo.GPTConfig(n_layer=2, block_size=32, n_embd=64), batch_size=args.batch_size)
    else:
        workload = zoo.make("gpt", batch_size=args.batch_size)
    started = time.perf_counter()
    plans = plans_for(workload, args.budgets)
    eager = [p for p in plans if not p.compiled]
    # memory: one tracked step per plan; eager timing is interleaved below
    session = Session(workload, repeats=0)
    base = session.baseline
    for plan in eager:
        print(f"... {plan.name}", file=sys.stderr, flush=True)
        session.run(plan)
    # time: round-robin over the eager plans (baseline included), so that load from other
    # processes on a shared machine falls on every plan alike; compiled plans time their own steps
    print(f"... timing {len(eager) + 1} eager plans, {args.repeats} rounds", file=sys.stderr, flush=True)
    eager_times = time_interleaved(workload, [Plan(name="baseline")] + eager, args.repeats)
    session_compiled = Session(workload, repeats=args.repeats, baseline=base)  # the same eager baseline
    for plan in plans:
        if plan.compiled:
            print(f"... {plan.name}", file=sys.stderr, flush=True)
            session_compiled.run(plan)
    entries = [session.baseline_entry] + session.history + session_compiled.history
    rows = [e.row() for e in entries]
    times_of = {i: eager_times[i] for i in range(len(eager) + 1)}
    for i, e in enumerate(entries[len(eager) + 1 :], start=len(eager) + 1):
        times_of[i] = list(e.measurement.step_seconds_all)
    base_med, base_min = statistics.median(times_of[0]), min(times_of[0])
    for i, row in enumerate(rows):
        ts = times_of[i]
        row["step_seconds"] = statistics.median(ts) if ts else None
        row["step_seconds_min"] = min(ts) if ts else None
        row["time_ratio"] = row["step_seconds"] / base_med if ts else None
        row["time_ratio_min"] = row["step_seconds_min"] / base_min if ts else None
        row["step_seconds_all"] = ts

    header = (
        f"{'plan':44} {'saved MB':>9} {'x base':>6} {'peak MB':>9} {'x base':>6} "
        f"{'step ms':>8} {'x base':>6} {'min ms':>8} {'x base':>6}"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"GPT demo ({workload.model.config}), batch {args.batch_size}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.repeats} timed steps per plan (median, fastest; eager plans "
        f"interleaved round-robin), load {load:.1f}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        step = "-" if r["step_seconds"] is None else f"{r['step_seconds'] * 1e3:8.1f}"
        fastest = "-" if r["step_seconds_min"] is None else f"{r['step_seconds_min'] * 1e3:8.1f}"
        print(
            f"{r['plan'][:44]:44} {_mb(r['saved_bytes'])} {_ratio(r['saved_ratio']):>6} "
            f"{_mb(r['peak_bytes'])} {_ratio(r['peak_ratio']):>6} {step:>8} {_ratio(r['time_ratio']):>6} "
            f"{fastest:>8} {_ratio(r['time_ratio_min']):>6}"
        )
    print(
        "saved: activations kept for backward at the end of forward; peak: parameters, inputs, grads,\n"
        "optimizer state (AdamW), activations and temporaries; compiled rows come from profiler events."
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "bench": "plans",
        "workload": {"name": "gpt", "config": repr(workload.model.config), "batch_size": args.batch_size},
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        },
        "repeats": args.repeats,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "baseline": base.summary(),
        "rows": rows,
        "plans": {e.plan.name: e.plan.to_dict() for e in entries[1:]},
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
