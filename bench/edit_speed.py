"""One edit on a model by name in fake mode, before and after issue 42's cuts, side by side.

An edit is what the explorer runs when a control changes: ``Session.run(plan)`` on the session it
opened (the model built once, its baseline measured), for a plan that checkpoints a layer, freezes
one or turns a knob. Every cut has a switch (``CUTS``): "before" is the same code with every switch
off, "after" with every switch on, run alternately on the same edits in one process (which goes
first alternates too), so machine load hits both alike. Each pair's measurements must be equal
(the cuts change no number; the script stops if one does). Reported: median, mean and worst CPU
seconds of an edit (``time.process_time``: this process, one torch thread) and wall seconds, the
before / after ratios, the load average, and the floor (the same fake step with no tracker).

Goal (issue 42): under 1 s per edit on a named 0.5B model. On a shared machine read the ratios and
the CPU columns; wall time is the CPU time stretched by the load.

    python bench/edit_speed.py                # qwen2.5-0.5b + LoRA r=8, seq 2048, 10 edits x 3 rounds
    python bench/edit_speed.py --rounds 5     # more rounds
    python bench/edit_speed.py --only "subtree parameter counts in one pass"   # one cut alone
    python bench/edit_speed.py --quick --out /tmp/edit.json   # 2 layers, seq 128, 3 edits, 1 round

Prints a table and writes ``bench/results/edit_speed.json`` (not with ``--quick`` unless ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from memsave_nb import Plan, RegionPolicy  # noqa: E402
from memsave_nb.hub import from_pretrained  # noqa: E402
from memsave_nb.session import Session  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "edit_speed.json"
# cut -> (module, switch): each a module-level bool, True = the cut is on
CUTS = {
    "collector held off in fake runs": ("memsave_nb.measure.gc_pause", "ENABLED"),
    "subtree parameter counts in one pass": ("memsave_nb.measure.summary", "ONE_PASS_SUBTREES"),
    "fake parameters wrapped inside the mode": ("memsave_nb.measure.fake_model", "WRAP_IN_MODE"),
}


@contextlib.contextmanager
def cuts(on: bool, only: str | None = None) -> Iterator[None]:
    """Every cut's switch set to ``on`` for the block (``only``: that cut's; the others on), then put back."""
    saved = []
    for name, (module_name, attr) in CUTS.items():
        module = importlib.import_module(module_name)
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, on if only is None or name == only else True)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def edits(layers: int, quick: bool) -> list[tuple[str, Plan]]:
    """The edits a user makes in the explorer: a layer checkpointed or frozen, a knob turned."""
    stem = "base_model.model.model.layers"
    pick = sorted({0, layers // 2, layers - 1})
    plans = [(f"checkpoint layer {i}", Plan(regions={f"{stem}.{i}": RegionPolicy()})) for i in pick]
    plans += [(f"freeze layer {i}", Plan(frozen=(f"{stem}.{i}",))) for i in pick]
    plans += [
        ("chunked loss", Plan(loss="chunked")),
        ("optimizer sgd", Plan(optimizer="sgd")),
        ("accumulate 2", Plan(accumulation_steps=2)),
        ("checkpoint every layer", Plan(regions={f"{stem}.{i}": RegionPolicy() for i in range(layers)})),
    ]
    return plans[:3] if quick else plans


def _one(session: Session, plan: Plan) -> tuple[float, float, object]:
    cpu, wall = time.process_time(), time.perf_counter()
    entry = session.run(plan)
    return time.process_time() - cpu, time.perf_counter() - wall, entry.measurement


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "max": max(values)}


def _floor_cpu_s(workload, plan: Plan, n: int) -> float:
    """CPU seconds of the plan's fake step with no tracker (bench_explorer's floor), median of ``n``."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_explorer import _plain_fake_step_cpu_s

    return _plain_fake_step_cpu_s(workload, plan, n)


def run(model: str, lora: int, seq: int, layers: int | None, rounds: int, quick: bool, only: str | None = None) -> dict:
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    start = time.perf_counter()
    workload = from_pretrained(
        model, lora=dict(r=lora), seq_len=seq, overrides={"num_hidden_layers": layers} if layers else None
    )
    build_s = time.perf_counter() - start
    n_layers = workload.model.base_model.model.config.num_hidden_layers
    session = Session(workload, "fake", repeats=0)
    with cuts(True):
        session.baseline
    plans = edits(n_layers, quick)
    with cuts(True):  # warm-up: first-run costs (lazy imports, fake-tensor dispatch cache) out of both paths
        for _, plan in plans:
            session.run(plan)
    times: dict[str, dict[str, list[float]]] = {p: {"cpu": [], "wall": []} for p in ("before", "after")}
    per_edit: dict[str, dict[str, list[float]]] = {name: {"before": [], "after": []} for name, _ in plans}
    for r in range(rounds):
        for i, (name, plan) in enumerate(plans):
            order = ("before", "after") if (r + i) % 2 == 0 else ("after", "before")
            got = {}
            for path in order:
                with cuts(path == "after", only):
                    cpu, wall, m = _one(session, plan)
                times[path]["cpu"].append(cpu)
                times[path]["wall"].append(wall)
                per_edit[name][path].append(cpu)
                got[path] = m
            if got["before"] != got["after"]:
                raise SystemExit(
                    f"the cuts changed the measurement of {name!r}: "
                    f"{got['before'].peak_bytes:,} B before, {got['after'].peak_bytes:,} B after"
                )
    load_after = os.getloadavg()
    with cuts(True):
        floor = _floor_cpu_s(workload, plans[0][1], 1 if quick else 3)
    out = {
        "model": model,
        "lora_r": lora,
        "seq_len": seq,
        "layers": n_layers,
        "rounds": rounds,
        "edits": len(plans),
        "build_s": build_s,
        "cuts": [only] if only else list(CUTS),
        "before": {k: _stats(v) for k, v in times["before"].items()},
        "after": {k: _stats(v) for k, v in times["after"].items()},
        "floor_cpu_s": floor,
        "per_edit_cpu_median": {name: {p: statistics.median(v) for p, v in d.items()} for name, d in per_edit.items()},
        "load_before": load_before,
        "load_after": load_after,
    }
    out["ratio"] = {
        f"{k}_{s}": out["before"][k][s] / out["after"][k][s] for k in ("cpu", "wall") for s in ("median", "mean", "max")
    }
    return out


def table(r: dict) -> str:
    lines = [
        f"{r['model']} + LoRA r={r['lora_r']}, {r['layers']} layers, seq {r['seq_len']}, fake mode, "
        f"{r['edits']} edits x {r['rounds']} rounds, each before and after (1 torch thread); "
        f"load average {r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f}",
        "",
        "| path | CPU s median | CPU s mean | CPU s worst | wall s median | wall s mean | wall s worst |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for path in ("before", "after"):
        c, w = r[path]["cpu"], r[path]["wall"]
        lines.append(
            f"| {path} | {c['median']:.3f} | {c['mean']:.3f} | {c['max']:.3f} | "
            f"{w['median']:.3f} | {w['mean']:.3f} | {w['max']:.3f} |"
        )
    q = r["ratio"]
    lines.append(
        f"| before / after | {q['cpu_median']:.2f}x | {q['cpu_mean']:.2f}x | {q['cpu_max']:.2f}x | "
        f"{q['wall_median']:.2f}x | {q['wall_mean']:.2f}x | {q['wall_max']:.2f}x |"
    )
    lines += [
        "",
        f"floor (the first edit's fake step, no tracker): {r['floor_cpu_s']:.3f} s CPU; "
        f"after / floor {r['after']['cpu']['median'] / r['floor_cpu_s']:.2f}x. Model build (once): {r['build_s']:.1f} s wall.",
        "",
        "| edit | CPU s before | CPU s after | ratio |",
        "|---|---:|---:|---:|",
    ]
    for name, d in r["per_edit_cpu_median"].items():
        lines.append(f"| {name} | {d['before']:.3f} | {d['after']:.3f} | {d['before'] / d['after']:.2f}x |")
    lines.append("\ncuts: " + "; ".join(r["cuts"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, seq 128, 3 edits, 1 round")
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--lora", type=int, default=8, help="LoRA rank")
    parser.add_argument("--seq", type=int, default=None, help="default 2048 (128 with --quick)")
    parser.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (2 with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument(
        "--only", choices=list(CUTS), default=None, help="before / after of this one cut, every other cut on in both"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help=f"JSON output (default {RESULTS.relative_to(ROOT)}; none with --quick)"
    )
    args = parser.parse_args(argv)
    result = run(
        args.model,
        args.lora,
        args.seq or (128 if args.quick else 2048),
        args.layers or (2 if args.quick else None),
        args.rounds or (1 if args.quick else 3),
        args.quick,
        args.only,
    )
    result.update(
        date=_dt.date.today().isoformat(), machine=platform.machine(), torch=torch.__version__, quick=args.quick
    )
    print(table(result))
    out = args.out or (None if args.quick else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
