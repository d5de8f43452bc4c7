"""Toggle-to-updated-numbers in the explorer, as a user feels it.

For each case the explorer is built, then a freeze checkbox is clicked several times (each click a
new plan, and every click is a real rerun: the explorer keeps no cache) and the time from the click to the new
saved-activation total on display is taken (in real mode the memory numbers show after the
tracked step, the times after the timed steps: both are taken): the explorer's own path (debounce, worker thread,
Session.run, widget and Bokeh source updates). Reported: the median and the worst click, and
the median of the part spent in ``Session.run`` (the engine) and in updating the display.

Goals (issue 29): under 0.2 s for the CNN demo in real mode on this CPU; under 0.3 s for a
GPT-2-small-shaped model (12 layers, d=768, vocab 50257, sequence 1024) in fake mode. For the fake
case the floor is printed too: each click's step (its optimizer making its state in the step)
run under ``FakeTensorMode`` with no tracker at all, after the click (the median of those): the
fake-tensor work alone, with the engine's quick cache hits (``measure/fake_dispatch.py``) and on
torch's own dispatch path (the floor before that module).

    python bench/bench_explorer.py              # both cases, 7 clicks each
    python bench/bench_explorer.py --clicks 3   # quicker
    python bench/bench_explorer.py --quick --out /tmp/explorer.json   # smoke test: 1 click, 1 repeat
    python bench/bench_explorer.py --threads 1  # torch intra-op threads (default: torch's own)
    python bench/bench_explorer.py --cuda-check # on a CUDA machine: allocator vs tracker peaks, 3 plans

Prints a table and writes ``bench/results/explorer.json``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import inspect
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from memsave_nb import zoo
from memsave_nb.session import Session
from memsave_nb.ui.explorer import Explorer, explore
from memsave_nb.zoo import GPTConfig

EXPLORE_REPEATS = inspect.signature(explore).parameters["repeats"].default  # what a click times in real mode
RESULTS = Path(__file__).resolve().parent / "results" / "explorer.json"
GPT2_SMALL = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)


def _cases(names: list[str]) -> list[dict]:
    all_cases = {
        "cnn-real": dict(
            name="cnn-real",
            goal_s=0.2,
            mode="real",
            make=lambda: zoo.make("cnn"),
            describe="ResNet-style CNN demo, batch 32, 3x32x32, real mode (1 tracked + explore()'s 3 timed steps)",
            toggles=["stem", "layers.0", "layers.1", "layers.2", "layers.0.0", "layers.1.0", "layers.2.0"],
        ),
        "cnn-real-1step": dict(
            name="cnn-real-1step",
            goal_s=0.2,
            mode="real",
            repeats=1,
            make=lambda: zoo.make("cnn"),
            describe="the same with one timed step (explore(..., repeats=1); time changes then read 'too few runs to judge')",
            toggles=["stem", "layers.0", "layers.1", "layers.2", "layers.0.0", "layers.1.0", "layers.2.0"],
        ),
        "gpt2-small-fake": dict(
            name="gpt2-small-fake",
            goal_s=0.3,
            mode="fake",
            make=lambda: zoo.gpt(GPT2_SMALL, batch_size=8),
            describe="GPT-2-small shape (12 x 768, vocab 50257, seq 1024), batch 8, fake mode",
            toggles=[f"blocks.{i}" for i in range(12)],
        ),
    }
    return [all_cases[n] for n in names]


def run_case(case: dict, clicks: int, repeats: int) -> dict:
    repeats = case.get("repeats", repeats)
    workload = case["make"]()
    t0 = time.perf_counter()
    explorer = Explorer(Session(workload, case["mode"], repeats=repeats))
    build_s = time.perf_counter() - t0
    shown: dict[str, float] = {}

    def on_result(entry) -> None:  # real mode: the memory numbers first (no time yet), then the times
        now = time.perf_counter()
        shown.setdefault("memory", now)
        shown["t"] = now

    explorer.on_result(on_result)

    # warm-up click (first-run costs: lazy imports, allocator, autograd graph caches)
    box = explorer.table.reveal(case["toggles"][0]).freeze
    box.value = not box.value
    explorer.wait()

    rows = []
    names = case["toggles"][1:]
    for i in range(clicks):
        name = names[i % len(names)]
        box = explorer.table.reveal(name).freeze
        before_label = explorer.saved_total.value
        shown.clear()
        start, cpu0 = time.perf_counter(), time.process_time()
        box.value = not box.value  # the click
        explorer.wait()
        end = shown.get("t", time.perf_counter())
        memory_at = shown.get("memory", end)
        cpu = time.process_time() - cpu0  # every thread of this process: engine and UI
        entry = explorer.entry
        if explorer.state != "done":
            raise RuntimeError(f"{case['name']}: click {i} ended in {explorer.state}: {explorer.error}")
        fake = case["mode"] == "fake"
        floor = _plain_fake_step_cpu_s(explorer.session.workload, entry.plan, 1) if fake else None
        floor_torch = _plain_fake_step_cpu_s(explorer.session.workload, entry.plan, 1, quick=False) if fake else None
        rows.append(
            {
                "module": name,
                "frozen": bool(box.value),
                "click_to_numbers_s": end - start,
                "click_to_memory_s": memory_at - start,
                "click_cpu_s": cpu,
                "plain_fake_step_cpu_s": floor,
                "plain_fake_step_torch_path_cpu_s": floor_torch,
                "session_run_s": entry.seconds,
                "saved_bytes": entry.measurement.saved_bytes,
                "label_before": before_label,
                "label_after": explorer.saved_total.value,
            }
        )
    floors = [r["plain_fake_step_cpu_s"] for r in rows if r["plain_fake_step_cpu_s"] is not None]
    floor = statistics.median(floors) if floors else None
    floors_torch = [
        r["plain_fake_step_torch_path_cpu_s"] for r in rows if r["plain_fake_step_torch_path_cpu_s"] is not None
    ]
    clicks_s = [r["click_to_numbers_s"] for r in rows]
    runs_s = [r["session_run_s"] for r in rows]
    overhead = [c - r for c, r in zip(clicks_s, runs_s)]
    median = statistics.median(clicks_s)
    return {
        "case": case["name"],
        "describe": case["describe"],
        "mode": case["mode"],
        "clicks": len(rows),
        "timed_steps": repeats if case["mode"] == "real" else 0,
        "goal_s": case["goal_s"],
        "median_s": median,
        "max_s": max(clicks_s),
        "median_to_memory_s": statistics.median(r["click_to_memory_s"] for r in rows),
        "max_to_memory_s": max(r["click_to_memory_s"] for r in rows),
        "median_session_run_s": statistics.median(runs_s),
        "median_click_cpu_s": statistics.median(r["click_cpu_s"] for r in rows),
        "median_ui_overhead_s": statistics.median(overhead),
        "plain_fake_step_cpu_s": floor,
        "plain_fake_step_torch_path_cpu_s": statistics.median(floors_torch) if floors_torch else None,
        "explorer_build_s": build_s,
        "debounce_s": explorer.runner.debounce_s,
        "meets_goal": statistics.median(r["click_to_memory_s"] for r in rows) < case["goal_s"],
        "rows": rows,
    }


def _plain_fake_step_cpu_s(workload, plan, n: int, quick: bool = True) -> float:
    """Median CPU seconds of the step ``plan`` makes, under FakeTensorMode with no tracker: forward,
    loss, backward and the optimizer's first step (which makes its state), as torch runs them;
    ``quick``: with the engine's quick cache hits (``measure/fake_dispatch.py``), else torch's own path."""
    from memsave_nb.measure import fake_dispatch

    enabled, fake_dispatch.ENABLED = fake_dispatch.ENABLED, quick
    try:
        return _median_plain_step(workload, plan, n)
    finally:
        fake_dispatch.ENABLED = enabled


def _median_plain_step(workload, plan, n: int) -> float:
    from memsave_nb.measure.engine import model_lock
    from memsave_nb.measure.fake_model import _fake_model

    times = []
    with model_lock(workload.model), plan.apply(workload) as wl:
        with _fake_model(wl.model, str(wl.device)) as fake_mode, fake_mode:
            for _ in range(max(1, n)):
                start = time.process_time()
                optimizer = wl.make_optimizer()
                loss = wl.compute_loss(wl.forward(wl.make_batch()))
                loss.backward()
                if optimizer is not None:
                    optimizer.step()
                times.append(time.process_time() - start)
                for p in wl.model.parameters():
                    p.grad = None
                del optimizer, loss
    return statistics.median(times)


def cuda_check(out: Path, device: str = "cuda") -> int:
    """Drive the explorer headlessly on CUDA: three plans clicked through its widgets, and for
    each the tracker's peak against the CUDA caching allocator's ``max_memory_allocated``."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    explorer = Explorer(Session(zoo.make("cnn", 64, device=device), "real", repeats=3))
    steps = [
        ("baseline", lambda: None),
        ("freeze stem", lambda: setattr(explorer.table.reveal("stem").freeze, "value", True)),
        (
            "+ checkpoint layers.1 full, memsave all",
            lambda: (
                setattr(explorer.table.reveal("layers.1").region, "value", "full"),
                setattr(explorer.table.reveal("").memsave, "value", True),
            ),
        ),
    ]
    rows = []
    print(f"{'plan':<42} {'tracker peak':>14} {'allocator peak':>15} {'ratio':>6} {'saved':>12} {'step':>9}")
    for label, click in steps:
        click()
        explorer.wait()
        if explorer.state not in ("done", "idle"):
            raise RuntimeError(f"{label}: {explorer.state}: {explorer.error}")
        m = explorer.measurement
        ratio = m.cuda_peak_bytes / m.peak_bytes if m.cuda_peak_bytes and m.peak_bytes else float("nan")
        rows.append(
            {
                "plan": label,
                "description": explorer.plan.describe(),
                "peak_bytes": m.peak_bytes,
                "cuda_peak_bytes": m.cuda_peak_bytes,
                "saved_bytes": m.saved_bytes,
                "step_seconds": m.step_seconds,
                "shown_cuda_label": explorer.cuda_peak.value,
            }
        )
        print(
            f"{label:<42} {m.peak_bytes:>14,} {m.cuda_peak_bytes or 0:>15,} {ratio:>6.3f} {m.saved_bytes:>12,} "
            f"{(m.step_seconds or 0) * 1e3:>7.1f}ms"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else device
    out.write_text(
        json.dumps({"benchmark": "explorer on CUDA: tracker vs allocator peak", "device": name, "rows": rows}, indent=1)
        + "\n"
    )
    print(f"written {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["cnn-real", "cnn-real-1step", "gpt2-small-fake"])
    parser.add_argument("--clicks", type=int, default=7)
    parser.add_argument(
        "--repeats",
        type=int,
        default=EXPLORE_REPEATS,
        help=f"timed steps per real-mode run (Session repeats; default: explore()'s, {EXPLORE_REPEATS})",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true", help="smoke test: one click per case, one timed step")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--cuda-check", action="store_true", help="allocator vs tracker peaks on CUDA, 3 plans")
    parser.add_argument("--check-device", default="cuda", help=argparse.SUPPRESS)  # "cpu" dry-runs the check
    args = parser.parse_args(argv)
    if args.quick:
        args.clicks, args.repeats = 1, 1
    if args.cuda_check:
        return cuda_check(args.out.with_name("explorer_cuda.json"), args.check_device)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [run_case(c, args.clicks, args.repeats) for c in _cases(args.cases)]

    print(
        f"{'case':<18} {'clicks':>6} {'memory':>8} {'max':>8} {'times':>8} {'max':>8} {'engine':>8} {'ui':>7} {'CPU':>7} {'floor':>7} {'torch':>7} {'goal':>6}  ok"
    )
    for r in results:
        floor, floor_torch = (
            f"{r[k]:>6.3f}s" if r.get(k) is not None else f"{'-':>7}"
            for k in ("plain_fake_step_cpu_s", "plain_fake_step_torch_path_cpu_s")
        )
        print(
            f"{r['case']:<18} {r['clicks']:>6} {r['median_to_memory_s']:>7.3f}s {r['max_to_memory_s']:>7.3f}s "
            f"{r['median_s']:>7.3f}s {r['max_s']:>7.3f}s "
            f"{r['median_session_run_s']:>7.3f}s {r['median_ui_overhead_s']:>6.3f}s {r['median_click_cpu_s']:>6.3f}s {floor} {floor_torch} "
            f"{r['goal_s']:>5.1f}s  "
            f"{'yes' if r['meets_goal'] else 'NO'}"
        )
    print(
        "memory: click to the memory numbers on display (wall; real mode shows them before the timed steps, the goal's\n"
        "figure); times: click to the step times too (fake mode: the same); engine: Session.run; ui: the rest (thread, widgets, Bokeh);\n"
        "CPU: the click's CPU seconds, all threads (steadier than wall on shared cores); floor: CPU seconds of the same\n"
        "fake step with no tracker (the fake-tensor work alone), with the engine's quick cache hits; torch: the same on\n"
        "torch's own dispatch path (measure/fake_dispatch.py off)"
    )
    try:
        import os

        load = os.getloadavg()
    except (AttributeError, OSError):
        load = None
    payload = {
        "benchmark": "explorer toggle-to-updated-numbers",
        "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu_count": __import__("os").cpu_count(),
            "load_average": load,
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
