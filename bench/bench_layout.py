"""The layout planner on a Llama-3.1-70B-shaped fine-tune over 16 x H100 80 GB, in fake mode, on this CPU.

The model comes from the offline catalogue (``memsave_nb.from_pretrained("llama-3.1-70b")``, built on
the meta device, bf16, AdamW), batch 1 x sequence 4096 per GPU, so a global batch of 16 sequences.
The search (``planner.layout.plan_layout``) and the full-depth per-rank re-measurement of the chosen
layout are timed apart with ``time.process_time()`` (CPU seconds; wall time on a shared machine says
little). Printed as the planner's summary and front; written to ``bench/results/layout.json``.

    python bench/bench_layout.py                                   # 70B on 16 x H100
    python bench/bench_layout.py --gpus 8 --gpu A100 --target-gb 80
    python bench/bench_layout.py --quick --out /tmp/layout.json    # smoke test: a small GPT (4 blocks) on 4 GPUs
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
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
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    from memsave_nb.planner.layout import plan_layout
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
    result = plan_layout(workload, gpus, args.gpu, target, tensor_parallel=tps, pipeline_parallel=pps)
    chosen = result.chosen
    row = {
        "model": workload.name, "gpus": gpus, "gpu": args.gpu, "target_gb": result.target.gb,
        "usable_bytes": result.target.usable_bytes, "global_batch": result.global_batch,
        "build_cpu_seconds": built - c0, "search_cpu_seconds": result.search_cpu_seconds,
        "remeasure_cpu_seconds": result.remeasure_cpu_seconds, "measurements": result.measurements,
        "candidates": len(result.candidates), "fitting": len(result.fitting),
        "chosen": None if chosen is None else {
            "label": chosen.label, "spec": chosen.spec.to_dict(), "est_peak_bytes": chosen.est_peak_bytes,
            "checked_peak_bytes": chosen.checked_peak_bytes, "step_seconds": chosen.step_seconds,
            "compute_seconds": chosen.compute_seconds, "comm_seconds": dict(chosen.comm_seconds),
        },
        "remeasured_device_peak_bytes": None if result.remeasured is None else result.remeasured.device_peak_bytes,
        "front": [{"label": c.label, "est_peak_bytes": c.est_peak_bytes, "step_seconds": c.step_seconds} for c in result.front],
        "candidates_all": [{"label": c.label, "est_peak_bytes": c.est_peak_bytes, "step_seconds": c.step_seconds,
                            "bubble_seconds": c.bubble_seconds, "comm_seconds": dict(c.comm_seconds), "fits": c.fits}
                           for c in result.candidates],
        "pruned": result.pruned, "notes": result.notes,
    }
    print(result.summary())
    print()
    print(result.front_table())
    print(f"\nCPU seconds: search {result.search_cpu_seconds:.1f}, full-depth re-measurement {result.remeasure_cpu_seconds:.1f}")
    doc = {"bench": "layout", "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "machine": platform.platform(), "python": platform.python_version(), "quick": args.quick, "result": row}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if chosen is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
