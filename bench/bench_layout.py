"""The layout planner on a Llama-3.1-70B-shaped fine-tune over 16 x H100 80 GB, in fake mode, on this CPU.

The model comes from the offline catalogue (``memsave_nb.from_pretrained("llama-3.1-70b")``, built on
the meta device, bf16, AdamW), batch 1 x sequence 4096 per GPU, so a global batch of 16 sequences.
The search (``planner.layout.plan_layout``) and the full-depth per-rank re-measurement of the chosen
layout are timed apart with ``time.process_time()`` (CPU seconds; wall time on a shared machine says
little). Printed as the planner's summary and front; written to ``bench/results/layout.json``.

``--baseline`` times, in the same run and interleaved with it, the search as it was before TP took the
cheap warm-up (every TP measurement ran a whole untracked first step: ``_whole_first_step_under_tp``);
``--repeats`` runs each several times and reports medians. The chosen layout and its per-rank
re-measurement must be the same bytes in both.

    python bench/bench_layout.py                                   # 70B on 16 x H100
    python bench/bench_layout.py --gpus 8 --gpu A100 --target-gb 80
    python bench/bench_layout.py --quick --out /tmp/layout.json    # smoke test: a small GPT (4 blocks) on 4 GPUs
    python bench/bench_layout.py --baseline --repeats 2           # beside the whole-first-step warm-up
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "layout.json"


def _small_gpt():
    import torch

    from memsave_nb.workload import Workload
    from memsave_nb.zoo import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=64, dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab_size, (1, cfg.block_size))
    return Workload(model, {"idx": idx, "targets": idx}, name="small gpt (4 blocks)")


@contextlib.contextmanager
def _whole_first_step_under_tp():
    """The warm-up before 2026-12-05: under tensor parallel, a whole untracked first step before the
    tracked one (now the optimizer state is made on zero gradients, as for FSDP2 alone)."""
    from memsave_nb.parallel import measure as measure_module

    original = measure_module.measure_rank

    def measure_rank(workload, spec, plan=None, *, steady=True, **kw):
        full = spec.tensor_parallel > 1 and steady is True
        return original(workload, spec, plan, steady="full" if full else steady, **kw)

    measure_module.measure_rank = measure_rank
    try:
        yield
    finally:
        measure_module.measure_rank = original


def _timed(workload, gpus, gpu, target, tps, baseline: bool, pps=None):
    from memsave_nb.planner.layout import plan_layout

    with _whole_first_step_under_tp() if baseline else contextlib.nullcontext():
        return plan_layout(workload, gpus, gpu, target, tensor_parallel=tps, pipeline_parallel=pps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-70b", help="a catalogue name (default llama-3.1-70b)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--gpus", type=int, default=16)
    ap.add_argument("--gpu", default="H100")
    ap.add_argument("--target-gb", type=float, default=None, help="per-GPU memory (default: the GPU's)")
    ap.add_argument("--tp", default=None, help="TP degrees to search, e.g. 1,2 (default: the planner's)")
    ap.add_argument("--pp", default=None, help="pipeline stage counts to search, e.g. 2,4,8 (default: the planner's)")
    ap.add_argument("--quick", action="store_true", help="a small GPT (4 blocks) on 4 GPUs, in seconds")
    ap.add_argument(
        "--baseline", action="store_true", help="also time the whole-first-step warm-up under TP, interleaved"
    )
    ap.add_argument("--repeats", type=int, default=1, help="runs of each (medians reported)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    from memsave_nb.target import Target

    c0 = time.process_time()
    if args.quick:
        workload, gpus, target, tps = _small_gpt(), 4, Target(2 / 1024, headroom=1.0), (1, 2)
    else:
        from memsave_nb import from_pretrained

        workload = from_pretrained(args.model, batch_size=1, seq_len=args.seq)
        gpus = args.gpus
        tps = tuple(int(t) for t in args.tp.split(",")) if args.tp else None
        target = Target(args.target_gb) if args.target_gb else None
    built = time.process_time()
    pps = tuple(int(p) for p in args.pp.split(",")) if args.pp else None
    runs: dict[str, list] = {"now": [], "baseline": []}
    for _ in range(max(1, args.repeats)):
        for kind in ("now", "baseline") if args.baseline else ("now",):
            runs[kind].append(_timed(workload, gpus, args.gpu, target, tps, kind == "baseline", pps))
    result = runs["now"][-1]
    chosen = result.chosen
    timing = {
        kind: {
            "search_cpu_seconds": [r.search_cpu_seconds for r in rs],
            "remeasure_cpu_seconds": [r.remeasure_cpu_seconds for r in rs],
            "total_cpu_seconds": [r.cpu_seconds for r in rs],
        }
        for kind, rs in runs.items()
        if rs
    }
    same = all(
        r.chosen is not None
        and chosen is not None
        and r.chosen.label == chosen.label
        and r.remeasured.device_peak_bytes == result.remeasured.device_peak_bytes
        for r in runs["baseline"]
    )
    row = {
        "model": workload.name,
        "gpus": gpus,
        "gpu": args.gpu,
        "target_gb": result.target.gb,
        "usable_bytes": result.target.usable_bytes,
        "global_batch": result.global_batch,
        "build_cpu_seconds": built - c0,
        "search_cpu_seconds": result.search_cpu_seconds,
        "remeasure_cpu_seconds": result.remeasure_cpu_seconds,
        "measurements": result.measurements,
        "candidates": len(result.candidates),
        "fitting": len(result.fitting),
        "chosen": None
        if chosen is None
        else {
            "label": chosen.label,
            "spec": chosen.spec.to_dict(),
            "est_peak_bytes": chosen.est_peak_bytes,
            "checked_peak_bytes": chosen.checked_peak_bytes,
            "step_seconds": chosen.step_seconds,
            "compute_seconds": chosen.compute_seconds,
            "comm_seconds": dict(chosen.comm_seconds),
        },
        "remeasured_device_peak_bytes": None if result.remeasured is None else result.remeasured.device_peak_bytes,
        "front": [
            {"label": c.label, "est_peak_bytes": c.est_peak_bytes, "step_seconds": c.step_seconds} for c in result.front
        ],
        "timing": timing,
        "baseline_same_answer": same if args.baseline else None,
        "candidates_all": [
            {
                "label": c.label,
                "est_peak_bytes": c.est_peak_bytes,
                "step_seconds": c.step_seconds,
                "bubble_seconds": c.bubble_seconds,
                "comm_seconds": dict(c.comm_seconds),
                "fits": c.fits,
            }
            for c in result.candidates
        ],
        "pruned": result.pruned,
        "notes": result.notes,
    }
    print(result.summary())
    print()
    print(result.front_table())
    print("\nCPU seconds (median of {} run{}):".format(len(runs["now"]), "s" * (len(runs["now"]) != 1)))
    for kind, t in timing.items():
        med = {k: statistics.median(v) for k, v in t.items()}
        print(
            f"  {kind:8s}  search {med['search_cpu_seconds']:5.1f}  full-depth re-measurement "
            f"{med['remeasure_cpu_seconds']:5.1f}  total {med['total_cpu_seconds']:5.1f}"
        )
    if args.baseline:
        print(f"  same chosen layout and re-measured bytes: {'yes' if same else 'NO'}")
    doc = {
        "bench": "layout",
        "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "python": platform.python_version(),
        "quick": args.quick,
        "result": row,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if chosen is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
