"""Steady state in one tracked step against the old two steps, side by side in one run.

``measure()`` now makes the optimizer's state the cheapest way the optimizer itself can
(``_init_group``, or a step on zero gradients) and tracks one step; ``first_step_peak=True`` runs
the old way (a whole first step under a light tracker, then the tracked step), which is also what
gives ``first_step_peak_bytes``. For each shape, in fake mode, the two are run interleaved
(old, new, old, new, ...) in this process so a noisy neighbour slows both alike; medians of the
``measure()`` call's wall time and the ratio old / new are printed, and the peaks are checked equal.

- ``gpt-7b``: the Llama-7B-shaped demo (``zoo.make("gpt-7b")``), AdamW.
- ``gpt2-small``: the GPT-2-small shape of ``bench_explorer.py`` (12 x 768, seq 1024), batch 8.

    python bench/bench_steady_state.py [--repeats 5] [--quick]

``--quick`` (the test suite's smoke run) uses small shapes and one repeat. Writes
``bench/results/steady_state.json`` (``--out`` to change it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memsave_nb import measure, zoo  # noqa: E402
from memsave_nb.zoo import GPTConfig  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "steady_state.json"
GPT2_SMALL = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
GPT_TINY = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)


def _shapes(quick: bool) -> dict:
    if quick:
        return {"gpt-tiny": lambda: zoo.gpt(GPT_TINY, batch_size=2), "cnn": lambda: zoo.make("cnn", 2)}
    return {"gpt-7b": lambda: zoo.make("gpt-7b"), "gpt2-small": lambda: zoo.gpt(GPT2_SMALL, batch_size=8)}


def _timed(workload, first_step_peak: bool):
    start = time.perf_counter()
    m = measure(workload, "fake", repeats=0, first_step_peak=first_step_peak)
    return time.perf_counter() - start, m


def run_shape(name: str, make, repeats: int) -> dict:
    workload = make()
    _timed(workload, False)  # warm-up: lazy imports, fake-mode caches
    old_s, new_s = [], []
    for _ in range(repeats):
        t_old, old = _timed(workload, True)
        t_new, new = _timed(workload, False)
        old_s.append(t_old)
        new_s.append(t_new)
        if (old.peak_bytes, old.peak_split) != (new.peak_bytes, new.peak_split):
            raise SystemExit(f"{name}: one-step peak {new.peak_bytes} != two-step peak {old.peak_bytes}")
    old_m, new_m = statistics.median(old_s), statistics.median(new_s)
    return {
        "shape": name,
        "repeats": repeats,
        "two_steps_s": old_m,
        "one_step_s": new_m,
        "ratio_old_over_new": old_m / new_m,
        "peak_bytes": new.peak_bytes,
        "first_step_peak_bytes": old.first_step_peak_bytes,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small shapes, one repeat (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    rows = [run_shape(name, make, repeats) for name, make in _shapes(args.quick).items()]
    print("| shape (fake mode) | two steps (old), median s | one step (new), median s | old / new |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['two_steps_s']:.2f} | {r['one_step_s']:.2f} | {r['ratio_old_over_new']:.2f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
