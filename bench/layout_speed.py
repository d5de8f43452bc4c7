"""The GPUs tab's "find a layout", searched again as a user does: the layout planner's CPU seconds with
and without the measurements kept between searches (``planner/layout_cache.py``), side by side.

One sequence of searches on one model, as clicks in the tab: 16 x H100, then the same GPUs as A100
(another GPU kind), then a 40 GB target, then 8 x H100 (another GPU count), then 16 x H100 again.
"before" runs each with ``plan_layout(..., reuse=False)`` (every search measures afresh, as before
2026-12-05); "after" with ``reuse=True`` from an empty cache. The two are interleaved, ``--repeats``
times, and the medians printed per search with their ratio. Every search must give the same answer
both ways (candidates, front, chosen layout, re-measured bytes): the script exits 1 otherwise.
CPU seconds (``time.process_time``): wall time on a shared machine says little.

    python bench/layout_speed.py                          # llama-3.1-8b (catalogue, bf16, AdamW), seq 2048
    python bench/layout_speed.py --lora 16 --repeats 3
    python bench/layout_speed.py --quick --out /tmp/l.json  # a small GPT (6 blocks) on 2 GPUs, three searches
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "layout_speed.json"


def _small_gpt():
    import torch

    from memsave_nb.workload import Workload
    from memsave_nb.zoo import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=6, n_head=4, n_embd=64, dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    return Workload(model, {"idx": idx, "targets": idx}, name="small gpt (6 blocks)")


def _clicks(quick: bool):
    """(label, gpus, gpu kind, target GB or None) in the order a user clicks."""
    if quick:
        return [("2 x H100", 2, "H100", None), ("2 x A100", 2, "A100", None), ("2 x H100, 1 MB", 2, "H100", 1 / 1024)]
    return [
        ("16 x H100", 16, "H100", None),
        ("16 x A100", 16, "A100", None),
        ("16 x H100, 40 GB", 16, "H100", 40.0),
        ("8 x H100", 8, "H100", None),
        ("16 x H100 again", 16, "H100", None),
    ]


def _answer(r) -> tuple:
    return (
        r.candidates,
        r.front,
        r.chosen,
        r.pruned,
        r.notes,
        None if r.remeasured is None else r.remeasured.device_peak_bytes,
    )


def _sequence(workload, clicks, reuse: bool) -> list:
    from memsave_nb.planner import layout_cache
    from memsave_nb.planner.layout import plan_layout
    from memsave_nb.target import Target

    layout_cache.clear()
    out = []
    for _, gpus, gpu, gb in clicks:
        begin = time.process_time()
        r = plan_layout(workload, gpus, gpu, Target(gb) if gb else None, reuse=reuse)
        out.append((time.process_time() - begin, r))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="a catalogue name (default llama-3.1-8b)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tune)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved runs of each way (medians reported)")
    ap.add_argument("--quick", action="store_true", help="a small GPT (6 blocks) on 2 GPUs, three searches")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    if args.quick:
        workload = _small_gpt()
    else:
        from memsave_nb import from_pretrained

        workload = from_pretrained(args.model, seq_len=args.seq, lora=dict(r=args.lora) if args.lora else None)
    clicks = _clicks(args.quick)
    runs: dict[str, list[list]] = {"before": [], "after": []}
    for i in range(max(1, args.repeats)):
        for way in ("before", "after") if i % 2 == 0 else ("after", "before"):  # neither always the cold first
            runs[way].append(_sequence(workload, clicks, reuse=way == "after"))
    same = all(_answer(a[1]) == _answer(b[1]) for rb, ra in zip(runs["before"], runs["after"]) for b, a in zip(rb, ra))
    rows = []
    print(f"{workload.name}: CPU seconds per search, median of {len(runs['before'])} (before: reuse=False)")
    print(f"  {'search':20s} {'before':>8s} {'after':>8s} {'ratio':>7s}  chosen")
    for i, (label, gpus, gpu, gb) in enumerate(clicks):
        before = statistics.median(rs[i][0] for rs in runs["before"])
        after = statistics.median(rs[i][0] for rs in runs["after"])
        r = runs["after"][-1][i][1]
        chosen = r.chosen.label if r.chosen else "none fits"
        rows.append(
            {
                "search": label,
                "gpus": gpus,
                "gpu": gpu,
                "target_gb": gb,
                "before_cpu_seconds": before,
                "after_cpu_seconds": after,
                "ratio": before / after if after else None,
                "measurements_after": r.measurements,
                "chosen": chosen,
            }
        )
        print(f"  {label:20s} {before:8.2f} {after:8.2f} {before / max(after, 1e-9):6.1f}x  {chosen}")
    total_b = sum(r["before_cpu_seconds"] for r in rows)
    total_a = sum(r["after_cpu_seconds"] for r in rows)
    print(f"  {'all':20s} {total_b:8.2f} {total_a:8.2f} {total_b / max(total_a, 1e-9):6.1f}x")
    print(f"  same answers both ways: {'yes' if same else 'NO'}")
    doc = {
        "bench": "layout_speed",
        "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "python": platform.python_version(),
        "quick": args.quick,
        "model": workload.name,
        "repeats": len(runs["before"]),
        "same_answers": same,
        "rows": rows,
        "total_before_cpu_seconds": total_b,
        "total_after_cpu_seconds": total_a,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
