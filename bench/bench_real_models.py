"""Hugging Face models as fine-tuning users build them: what one training step keeps.

Per model (from configs, random weights, nothing downloaded; real vocabularies): parameters,
saved for backward, outputs and caches kept to the end of forward, the first-step and the
steady-state peak (training's step 2 on, optimizer state alive), the seconds a fake-mode
measurement takes, and PyTorch's MemTracker over a two-step loop (its second step's peak) with
the difference. Printed as a table and written to ``bench/results/real_models.json``.

    python bench/bench_real_models.py              # layers 4, d 256, batch 2, seq 128
    python bench/bench_real_models.py --seq 64 --layers 2
    python bench/bench_real_models.py --quick --out /tmp/real_models.json   # smoke test: 1 layer, d 64, seq 16, vocab 1000
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the model builders and the MemTracker oracle live beside the tests

from memsave_nb import measure  # noqa: E402
from tests.measure.hf_models import MODELS  # noqa: E402
from tests.measure.oracles import frozen_aware_memtracker, memtracker_count  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "real_models.json"
VOCABS = {"gpt2": 50257, "bert": 30522, "llama": 32000, "t5": 32128, "lora-llama": 32000, "qwen2": 151936}


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def run(name: str, args: argparse.Namespace) -> dict:
    vocab = {} if args.quick else {"vocab": VOCABS[name]}  # quick: the builders' small vocabulary
    wl = MODELS[name](batch=args.batch, seq=args.seq, layers=args.layers, d=args.d, **vocab)
    params = sum(p.numel() for p in wl.model.parameters())
    trainable = sum(p.numel() for p in wl.model.parameters() if p.requires_grad)
    m = measure(wl, "real", repeats=0, first_step_peak=True)
    start = time.perf_counter()
    fake = measure(wl, "fake")
    fake_seconds = time.perf_counter() - start
    tracker_cls = frozen_aware_memtracker() if name.startswith("lora") else None
    oracle = memtracker_count(wl, iterations=2, tracker_cls=tracker_cls).peak_bytes
    return {
        "model": name,
        "params": params,
        "trainable": trainable,
        "saved_bytes": m.saved_bytes,
        "output_bytes": m.output_bytes,
        "output_parts": dict(m.output_parts),
        "first_step_peak_bytes": m.first_step_peak_bytes,
        "steady_peak_bytes": m.peak_bytes,
        "fake_equals_real": (fake.peak_bytes, fake.saved_bytes, fake.output_bytes)
        == (m.peak_bytes, m.saved_bytes, m.output_bytes),
        "fake_seconds": fake_seconds,
        "memtracker_steady_peak_bytes": oracle,
        "difference_bytes": m.peak_bytes - oracle,
        "advice": list(m.advice),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: batch 1, seq 16, 1 layer, d 64, vocabulary 1000"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.seq, args.layers, args.d = 1, 16, 1, 64
    torch.set_num_threads(1)
    rows = [run(name, args) for name in args.models]
    print(
        f"batch {args.batch}, seq {args.seq}, {args.layers} layers, d {args.d}, AdamW, float32, CPU "
        f"(torch {torch.__version__}); MiB"
    )
    print()
    print(
        "| model | params (trainable) | saved for backward | outputs/caches kept | first-step peak | steady-state peak "
        "| steady vs first | fake-mode s | MemTracker steady peak | difference (B) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        outputs = ", ".join(f"{k} {mib(v)}" for k, v in r["output_parts"].items() if v >= 2**16) or "-"
        print(
            f"| {r['model']} | {r['params'] / 1e6:.2f}M ({r['trainable'] / 1e6:.2f}M) | {mib(r['saved_bytes'])} "
            f"| {mib(r['output_bytes'])} ({outputs}) | {mib(r['first_step_peak_bytes'])} | {mib(r['steady_peak_bytes'])} "
            f"| {r['steady_peak_bytes'] / r['first_step_peak_bytes'] - 1:+.1%} | {r['fake_seconds']:.2f} "
            f"| {mib(r['memtracker_steady_peak_bytes'])} | {r['difference_bytes']} |"
        )
    print()
    for r in rows:
        for a in r["advice"]:
            print(f"- {r['model']}: {a}")
    print(
        f"fake mode equals real mode (peak, saved, outputs) on {sum(r['fake_equals_real'] for r in rows)} of {len(rows)}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "torch": torch.__version__,
                "machine": platform.machine(),
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
