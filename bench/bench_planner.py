"""The planner, two claims, each printed with its numbers.

1. GPT-2-small shape (12 layers, d=768, seq 1024, vocab 50257, batch 32) in fake mode under a
   24 GB target: how many candidate plans it explored, how long it took (must be < 60 s, >= 200
   candidates), the chosen plan and its re-measured peak (must be under the headroom line).
2. The zoo CNN and GPT demos in real mode on this CPU: the planner's estimated step time (roofline
   of this CPU, calibrated) against measured step times (median of repeats) for plans spread
   over the estimated-time range; Spearman's rank correlation (must be >= 0.8).

    OMP_NUM_THREADS=1 python bench/bench_planner.py [--timed 6 --repeats 3] [--out planner.json]
    python bench/bench_planner.py --quick --out /tmp/planner.json   # smoke test: tiny shapes, claims not enforced
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from memsave_nb import presets, zoo  # noqa: E402
from memsave_nb.measure import measure  # noqa: E402
from memsave_nb.plan import Plan  # noqa: E402
from memsave_nb.planner import plan_for  # noqa: E402
from memsave_nb.target import Target  # noqa: E402
from memsave_nb.ui.format import format_bytes  # noqa: E402


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy)


GPT2_SMALL = zoo.GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.0)


def gpt2_fake(target_gb: float = 24.0, quick: bool = False) -> dict:
    """The GPT-2-small search; ``quick``: the zoo's small GPT (4 x 128, seq 128), batch 2, 1 GB."""
    torch.manual_seed(0)
    config, batch, blocks, micro = (
        (zoo.GPTConfig(dropout=0.0), 2, 1, (1, 2)) if quick else (GPT2_SMALL, 32, 4, (1, 2, 4))
    )
    target_gb = 1.0 if quick else target_gb
    wl = zoo.gpt(config, batch_size=batch)
    target = Target(target_gb)
    start, cpu_start = time.perf_counter(), time.process_time()
    result = plan_for(
        wl,
        target,
        mode="fake",
        device="H100",
        freezing={"all": Plan(), f"last {blocks} blocks": presets.last_blocks(wl.model, blocks)},
        precisions=("bf16_master",),
        micro_batches=micro,
    )
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    shape = "zoo GPT (4 x 128), batch 2, seq 128" if quick else "GPT-2-small shape, batch 32, seq 1024"
    print(f"== {shape}, fake mode, target", target.label)
    print(result.summary())
    for config in dict.fromkeys(c.config for c in result.candidates):
        of = [c for c in result.candidates if c.config == config]
        fit = [c for c in of if c.fits]
        line = f"  {config}: {len(of)} candidates, {len(fit)} fit"
        if fit:
            line += f"; fastest that fits: {fit[0].label} ({fit[0].est_seconds * 1e3:.1f} ms, {format_bytes(fit[0].est_peak_bytes)} est.)"
        print(line)
    print(
        f"candidates explored: {len(result.candidates)}   search time: {seconds:.1f} s ({cpu_seconds:.1f} s CPU)   Pareto front: {len(result.front)} plans"
    )
    chosen = result.chosen
    ok = chosen is not None and chosen.measured_peak_bytes is not None and target.fits(chosen.measured_peak_bytes)
    print(
        f"chosen re-measured peak {format_bytes(chosen.measured_peak_bytes if chosen else 0)} "
        f"< headroom line {format_bytes(target.usable_bytes)}: {ok}"
    )
    print(f"CLAIM candidates >= 200: {len(result.candidates) >= 200}; time < 60 s: {seconds < 60}; chosen fits: {ok}")
    return {
        "shape": shape,
        "target": target.label,
        "count": len(result.candidates),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "fits": ok,
    }


def _spread(candidates, n: int):
    ordered = sorted(candidates, key=lambda c: c.est_seconds)
    if len(ordered) <= n:
        return ordered
    return [ordered[round(i * (len(ordered) - 1) / (n - 1))] for i in range(n)]


def real_order(name: str, workload, freezing: dict, n: int, repeats: int) -> float:
    result = plan_for(
        workload,
        Target(1000),
        mode="real",
        device="host",
        freezing=freezing,
        precisions=(None,),
        region_kinds=("full", "save_matmuls"),
        remeasure=0,
    )
    picked = _spread(result.candidates, n)
    est, measured = [], []
    print(f"== {name} demo, real mode on this CPU: {len(result.candidates)} candidates, {len(picked)} timed")
    for c in picked:
        with c.plan.apply(workload) as wl:
            m = measure(wl, mode="real", repeats=repeats, flops=False)
        est.append(c.est_seconds)
        measured.append(m.step_seconds)
        print(f"  estimated {c.est_seconds * 1e3:8.2f} ms   measured {m.step_seconds * 1e3:8.2f} ms   {c.label}")
    rho = spearman(est, measured)
    print(f"CLAIM {name}: Spearman(estimated, measured) = {rho:.3f} (>= 0.8: {rho >= 0.8})")
    return rho


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: the small zoo GPT in fake mode, CNN batch 2 and GPT batch 2 in real mode, "
        "3 timed plans, 1 repeat; the claims are printed, not enforced (exit 0)",
    )
    parser.add_argument("--timed", type=int, default=8, help="plans timed per demo in real mode")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per plan")
    parser.add_argument("--skip-fake", action="store_true")
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="write the numbers as JSON here (default: none)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ok = True
    found: dict = {"quick": args.quick}
    if not args.skip_fake:
        r = found["fake_search"] = gpt2_fake(quick=args.quick)
        ok &= r["count"] >= 200 and r["seconds"] < 60 and r["fits"]
    if not args.skip_real:
        n, repeats, cnn_batch, gpt_batch = (3, 1, 2, 2) if args.quick else (args.timed, args.repeats, 16, 8)
        cnn = zoo.make("cnn", cnn_batch)
        rho = found["cnn_spearman"] = real_order(
            "CNN",
            cnn,
            {
                "all": Plan(),
                "input only": presets.input_only(cnn.model),
                "last block": presets.last_blocks(cnn.model, 1),
            },
            n,
            repeats,
        )
        ok &= rho >= 0.8
        gpt = zoo.make("gpt", gpt_batch)
        rho = found["gpt_spearman"] = real_order(
            "GPT", gpt, {"all": Plan(), "last block": presets.last_blocks(gpt.model, 1)}, n, repeats
        )
        ok &= rho >= 0.8
    found["claims_hold"] = bool(ok)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(found, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
