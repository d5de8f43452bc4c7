"""How much the engine costs, side by side with PyTorch's MemTracker, in one run.

1. The CNN demo step (``zoo.make("cnn")``, batch 32): a plain step, the tracked step without and
   with FLOP counting, a whole ``measure(repeats=0)`` (the optimizer's state made, one tracked
   step, the summary), and the same step under ``torch.distributed._tools.mem_tracker.MemTracker``.
   Repeats are interleaved (plain, tracked, ..., plain, tracked, ...) so a noisy neighbour slows
   all of them alike; medians and ratios to the plain step are reported, in wall time and in
   process CPU time.
2. The Llama-7B shape in fake mode (``zoo.make("gpt-7b")``), steady state: ``measure(mode="fake")``
   (one tracked step) against MemTracker under the same FakeTensorMode (two iterations of the same
   loop, the peak of the second: its steady state), each in a fresh subprocess, alternating,
   reporting the call's wall and CPU time and the process's peak RSS (``VmHWM``, torch import included)
   beside its RSS just before the call (``VmRSS``, torch and the fake model loaded). The two
   predicted peaks must be equal to the byte (the run fails otherwise). In the same rounds: the
   plain fake step with no tracker (the floor), on torch's own dispatch path and with
   ``measure/fake_dispatch.py``'s quick cache hits, and with ``--before-root PATH`` the same
   ``measure()`` from another checkout (the code before a change), which must predict the same peak.
3. Issue 26's command, ``memsave-nb report --model llama-3.1-8b --lora r=16 --target-gb 24
   --max-batch``, as a whole fresh process (imports included): wall and CPU seconds.

    python bench/bench_engine.py [--repeats 9] [--big-repeats 3] [--cli-repeats 3] [--threads 1] [--before-root ../main]
    python bench/bench_engine.py --quick --out /tmp/engine.json   # smoke test (the test suite's)

Writes ``bench/results/engine.json`` and prints a Markdown table (pasted into README.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memsave_nb import measure, zoo  # noqa: E402
from memsave_nb.measure.step import _run_once, _Step  # noqa: E402
from memsave_nb.model_state import ModelSnapshot  # noqa: E402
from memsave_nb.workload import iter_tensors  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "engine.json"


# -- 1. the CNN step ------------------------------------------------------------------------------
def _plain(wl) -> None:
    for p in wl.model.parameters():
        p.grad = None
    _Step(wl, None).run(wl.make_batch)


def _tracked(wl, flops: bool) -> None:
    # one tracked first step, as the plain and MemTracker variants run a first step
    _run_once(wl, fake_mode=None, flops=flops, cancel_event=None, warm_up=None, repeats=0)


def _measure(wl) -> None:
    measure(wl, repeats=0)


def _memtracker(wl) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    for p in wl.model.parameters():
        p.grad = None
    batch = wl.make_batch()
    tracker = MemTracker()
    tracker.track_external(wl.model, *iter_tensors(batch))
    with tracker:
        _Step(wl, None).run(lambda: batch)
    tracker.get_tracker_snapshot("peak")


def bench_cnn(repeats: int) -> dict:
    wl = zoo.make("cnn")
    snapshot = ModelSnapshot.capture(wl.model)
    variants: dict[str, Callable[[], None]] = {
        "plain step": lambda: _plain(wl),
        "tracker": lambda: _tracked(wl, False),
        "tracker + FLOPs": lambda: _tracked(wl, True),
        "measure(repeats=0)": lambda: _measure(wl),
        "MemTracker": lambda: _memtracker(wl),
    }
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():  # warm-up: first calls pay for lazy imports and allocator growth
        fn()
        snapshot.restore(wl.model)
    for _ in range(repeats):
        for name, fn in variants.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
            snapshot.restore(wl.model)
    base_wall, base_cpu = statistics.median(wall["plain step"]), statistics.median(cpu["plain step"])
    rows = []
    for name in variants:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        rows.append(
            {
                "variant": name,
                "wall_seconds": w,
                "cpu_seconds": c,
                "wall_ratio": w / base_wall,
                "cpu_ratio": c / base_cpu,
            }
        )
    return {"workload": "cnn", "batch": zoo.DEFAULT_BATCH["cnn"], "repeats": repeats, "rows": rows}


# -- 2. the 7B shape in fake mode, each run in a fresh process --------------------------------------
_CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads({threads})
from memsave_nb import measure, zoo
def vm(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
wl = zoo.make("gpt-7b")
rss_after_import = vm("VmRSS")
start, cpu_start = time.perf_counter(), time.process_time()
if {which!r} == "memsave":
    m = measure(wl, "fake")  # the steady state: one tracked step
    peak = m.peak_bytes
elif {which!r}.startswith("floor"):
    # the same step under FakeTensorMode with no tracker: forward, loss, backward, the AdamW step
    # (single-tensor, as measure() runs it in fake mode; its state made inside it); "floor_quick" with
    # measure/fake_dispatch.py's quick cache hits, "floor_torch" on torch's own path
    import contextlib
    fake_mode = next(wl.model.parameters()).fake_mode
    quick = contextlib.nullcontext()
    if {which!r} == "floor_quick":
        from memsave_nb.measure.fake_dispatch import quick_dispatch
        quick = quick_dispatch(fake_mode)
    with quick, fake_mode:
        batch = wl.make_batch()
        opt = torch.optim.AdamW(wl.model.parameters(), lr=1e-3, foreach=False)
        loss = wl.compute_loss(wl.model(**batch))
        loss.backward()
        opt.step()
        del loss, opt
    peak = None
else:
    # MemTracker's steady state is its second iteration of a training loop (reset_mod_stats() and a
    # fresh `with` before it), the loop measure() runs: the output dropped before backward (loss_only)
    from torch.distributed._tools.mem_tracker import MemTracker
    fake_mode = next(wl.model.parameters()).fake_mode
    with fake_mode:
        batch = wl.make_batch()
        tracker = MemTracker()
        tracker.track_external(wl.model, *batch.values())
        opt = None
        for i in range(2):
            if i:
                tracker.reset_mod_stats()
                for p in wl.model.parameters():
                    p.grad = None
            with tracker:
                if opt is None:
                    opt = torch.optim.AdamW(wl.model.parameters(), lr=1e-3)
                out = wl.model(**batch)
                loss = wl.compute_loss(out)
                del out
                loss.backward()
                opt.step()
                del loss
            peak = sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
        del opt
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
print(json.dumps({{"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_rss_bytes": vm("VmHWM"),
                  "rss_after_import_bytes": rss_after_import, "predicted_peak_bytes": peak}}))
"""


_TOOLS = {
    "memsave": "memsave measure(mode='fake')",
    "before": "memsave measure(mode='fake'), before ({label})",
    "floor_quick": "plain fake step, no tracker, quick cache hits (floor now)",
    "floor_torch": "plain fake step, no tracker, torch's own path (floor before)",
    "MemTracker": "MemTracker + FakeTensorMode (2nd iteration)",
}


def bench_7b(repeats: int, threads: int, before_root: Path | None = None, floors: bool = True) -> dict:
    """Ours and MemTracker alternating, each in a fresh process; both must predict the same peak.

    ``before_root``: another checkout of memsave_nb (the code before a change) run the same way, in
    the same rounds, for a before/after pair measured together. ``floors``: the plain fake step with
    no tracker, on torch's own dispatch path and on the quick one (``measure/fake_dispatch.py``)."""
    order = (
        ["memsave"]
        + (["before"] if before_root else [])
        + (["floor_quick", "floor_torch"] if floors else [])
        + ["MemTracker"]
    )
    runs: dict[str, list[dict]] = {k: [] for k in order}
    for _ in range(repeats):
        for which in runs:
            root = before_root if which == "before" else ROOT
            code = _CHILD.format(root=str(root), which="memsave" if which == "before" else which, threads=threads)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
            if out.returncode != 0:
                raise RuntimeError(f"{which} 7B run failed: {out.stderr.strip().splitlines()[-1:]}")
            runs[which].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for which, rs in runs.items():
        rows.append(
            {
                "key": which,
                "tool": _TOOLS[which].format(label=before_root.name if before_root else ""),
                "seconds": statistics.median(r["seconds"] for r in rs),
                "seconds_all": [r["seconds"] for r in rs],
                "cpu_seconds": statistics.median(r["cpu_seconds"] for r in rs),
                "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs),
                "rss_after_import_bytes": max(r["rss_after_import_bytes"] for r in rs),
                "predicted_peak_bytes": rs[0]["predicted_peak_bytes"],
            }
        )
    ours, anchor = rows[0]["predicted_peak_bytes"], rows[-1]["predicted_peak_bytes"]
    if ours != anchor:
        raise RuntimeError(f"7B steady-state peaks differ: memsave {ours} B, MemTracker {anchor} B")
    if before_root and rows[1]["predicted_peak_bytes"] != ours:
        raise RuntimeError(
            f"7B steady-state peaks differ: memsave {ours} B, before {rows[1]['predicted_peak_bytes']} B"
        )
    return {
        "workload": "gpt-7b (32 layers, d=4096, bf16, batch 1, seq 2048, AdamW), steady state",
        "repeats": repeats,
        "rows": rows,
    }


# -- 3. the issue-26 command, a whole fresh process -----------------------------------------------
CLI_COMMAND = ["report", "--model", "llama-3.1-8b", "--lora", "r=16", "--target-gb", "24", "--max-batch"]


def bench_cli(repeats: int) -> dict:
    """``memsave-nb report --model llama-3.1-8b --lora r=16 --target-gb 24 --max-batch`` as a user
    runs it: wall and CPU seconds of the whole process (imports, building the meta model, the fake
    step, the max-batch search, the report), median of fresh processes."""
    runs = []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "memsave_nb.cli", *CLI_COMMAND],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            cwd=ROOT,
        )
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if out.returncode != 0:
            raise RuntimeError(f"memsave-nb report failed: {out.stderr.strip().splitlines()[-1:]}")
        runs.append(
            {
                "wall_seconds": wall,
                "cpu_seconds": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
                "first_lines": out.stdout.splitlines()[:5],
                "stderr": out.stderr,
            }
        )
    return {
        "command": "memsave-nb " + " ".join(CLI_COMMAND),
        "repeats": repeats,
        "wall_seconds": statistics.median(r["wall_seconds"] for r in runs),
        "cpu_seconds": statistics.median(r["cpu_seconds"] for r in runs),
        "wall_seconds_all": [r["wall_seconds"] for r in runs],
        "first_lines": runs[0]["first_lines"],
        "stderr_empty": all(not r["stderr"] for r in runs),
        "load_average": _load(),
    }


def _has(*modules: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in modules)


def _load() -> float | None:
    try:
        return round(__import__("os").getloadavg()[0], 1)
    except OSError:
        return None


# -- output ---------------------------------------------------------------------------------------
def table(result: dict) -> str:
    cnn, big, cli = result["cnn"], result["gpt_7b"], result.get("cli")
    lines = [
        f"CNN demo step (batch {cnn['batch']}), median of {cnn['repeats']} interleaved repeats, "
        f"{result['threads']} torch thread(s); goal (issue 29): tracker <= 1.15x a plain step",
        "",
        "| variant | wall ms | x plain (wall) | CPU ms | x plain (CPU) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in cnn["rows"]:
        lines.append(
            f"| {r['variant']} | {r['wall_seconds'] * 1e3:.1f} | {r['wall_ratio']:.2f} | {r['cpu_seconds'] * 1e3:.1f} | {r['cpu_ratio']:.2f} |"
        )
    if big["rows"]:
        lines += [
            "",
            f"Llama-7B shape in fake mode, steady state (training's step 2 on), median of {big['repeats']} fresh processes "
            "each, alternating in this run; goal (issue 29): measure() < 1.0 s and < 1 GB RSS",
            "",
            "| tool | wall s | CPU s | peak RSS (MB) | RSS before the run (MB) | predicted peak (GiB) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in big["rows"]:
            peak = f"{r['predicted_peak_bytes'] / 2**30:.2f}" if r["predicted_peak_bytes"] is not None else ""
            lines.append(
                f"| {r['tool']} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} | {r['peak_rss_bytes'] / 1e6:.0f} | {r['rss_after_import_bytes'] / 1e6:.0f} | {peak} |"
            )
        ours, anchor = big["rows"][0], big["rows"][-1]
        lines.append(
            f"\nmemsave and MemTracker predict {ours['predicted_peak_bytes']:,} bytes. MemTracker / ours: "
            f"{anchor['seconds'] / ours['seconds']:.1f}x in wall time, {anchor['cpu_seconds'] / ours['cpu_seconds']:.1f}x in CPU "
            "time. Each fresh process starts with torch's fake-tensor dispatch cache empty."
        )
        before = next((r for r in big["rows"] if r.get("key") == "before"), None)
        if before:
            lines.append(
                f"Before / now: {before['cpu_seconds'] / ours['cpu_seconds']:.2f}x in CPU time "
                f"({before['cpu_seconds']:.2f} s -> {ours['cpu_seconds']:.2f} s), the same peak."
            )
    if cli:
        lines += [
            "",
            f"`{cli['command']}`, the whole process, median of {cli['repeats']} fresh processes "
            f"(load average {cli['load_average']}); goal (issue 26): < 10 s",
            "",
            "| wall s | CPU s | runs (wall s) | stderr empty |",
            "|---:|---:|---|---|",
            f"| {cli['wall_seconds']:.1f} | {cli['cpu_seconds']:.1f} | {', '.join(f'{w:.1f}' for w in cli['wall_seconds_all'])} "
            f"| {'yes' if cli['stderr_empty'] else 'no'} |",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="interleaved repeats of the CNN step")
    parser.add_argument("--big-repeats", type=int, default=3, help="fresh processes per tool for the 7B shape")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on shared cores)")
    parser.add_argument("--cli-repeats", type=int, default=3, help="fresh processes of the issue-26 command")
    parser.add_argument("--skip-7b", action="store_true")
    parser.add_argument(
        "--before-root",
        type=Path,
        default=None,
        help="another checkout (the code before a change): its 7B measure() runs in the same rounds",
    )
    parser.add_argument("--no-floors", action="store_true", help="leave out the 7B plain fake step (no tracker)")
    parser.add_argument("--skip-cli", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: one CNN repeat, no 7B processes, one CLI process"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.skip_7b, args.cli_repeats = 1, True, 1
    torch.set_num_threads(args.threads)
    result = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), {__import__('os').cpu_count()} CPUs",
        "threads": args.threads,
        "cnn": bench_cnn(args.repeats),
        "gpt_7b": bench_7b(args.big_repeats, args.threads, args.before_root, not args.no_floors)
        if not args.skip_7b
        else {"repeats": 0, "rows": []},
        "cli": bench_cli(args.cli_repeats) if not args.skip_cli and _has("transformers", "peft") else None,
    }
    result["table_markdown"] = table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(result["table_markdown"])
    print(f"\nwrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
