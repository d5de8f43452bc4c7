"""Sizing a Llama-2-70B-shaped fine-tune per rank under FSDP2, in fake mode, on this CPU.

Llama-2-70B shape (80 layers, d=8192, 64 heads / 8 KV heads, MLP 28672, vocab 32000; Hugging Face
``LlamaForCausalLM`` built on the meta device), bf16 parameters, AdamW, sequence 4096, batch 1 per
rank, every decoder layer plus the root a ``fully_shard`` unit. Each case runs in a fresh
subprocess, which reports its wall time and peak RSS (``resource.getrusage``). Printed as a table
and written to ``bench/results/parallel.json``.

    python bench/bench_parallel.py                  # world sizes 8 and 64, steady state
    python bench/bench_parallel.py --world-size 8 --layers 8   # a quicker, shallower shape
    python bench/bench_parallel.py --quick --out /tmp/parallel.json   # smoke test: 2 ranks, 1 layer, in-process
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "parallel.json"
GIB = 1 << 30


def llama2_70b(layers: int = 80, seq: int = 4096):
    """A Workload: Llama-2-70B shape on the meta device, bf16, batch 1 x ``seq`` per rank."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from memsave_nb.workload import Workload

    cfg = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        use_cache=False,
        torch_dtype=torch.bfloat16,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)

    def batch():  # called inside the fake mode
        ids = torch.randint(0, cfg.vocab_size, (1, seq))
        return {"input_ids": ids, "labels": ids}

    return Workload(model, batch, optimizer="adamw", name=f"llama2-70b-shape ({layers} layers)")


def run_case(world_size: int, layers: int, seq: int) -> dict:
    """In this (fresh) process: measure and report seconds and peak RSS."""
    t0, c0 = time.perf_counter(), time.process_time()
    from memsave_nb.parallel import ParallelSpec, measure_parallel

    workload = llama2_70b(layers, seq)
    built, cbuilt = time.perf_counter(), time.process_time()
    spec = ParallelSpec(world_size=world_size)
    m = measure_parallel(workload, spec)
    done, cdone = time.perf_counter(), time.process_time()
    params = sum(p.numel() for p in workload.model.parameters())
    w = m.worst
    return {
        "world_size": world_size,
        "layers": layers,
        "seq": seq,
        "params": params,
        "build_seconds": built - t0,
        "measure_seconds": done - built,
        "total_seconds": done - t0,
        "measure_cpu_seconds": cdone - cbuilt,
        "total_cpu_seconds": cdone - c0,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "worst_rank": w.rank,
        "ranks_measured": len(m.ranks),
        "peak_bytes": w.peak_bytes,
        "peak_split": w.peak_split,
        "peak_phase": w.peak_phase,
        "unseen_low_bytes": m.unseen_low_bytes,
        "unseen_high_bytes": m.unseen_high_bytes,
        "table": m.table(),
    }


def _fresh_processes(args: argparse.Namespace) -> list[dict] | None:
    """One fresh subprocess per world size (its RSS is its own); None when one fails."""
    rows = []
    root = str(Path(__file__).resolve().parent.parent)  # this checkout's package, not an installed copy
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    )
    for ws in args.world_size:
        cmd = [sys.executable, __file__, "--case", str(ws), "--layers", str(args.layers), "--seq", str(args.seq)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent.parent)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return None
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", nargs="+", type=int, default=[8, 64])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="smoke test: world size 2, 1 layer, seq 128, in this process")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--case", type=int, help=argparse.SUPPRESS)  # child mode: one world size
    args = ap.parse_args(argv)
    if args.case is not None:
        print(json.dumps(run_case(args.case, args.layers, args.seq)))
        return 0
    if args.quick:
        args.world_size, args.layers, args.seq = [2], 1, 128
        rows = [run_case(ws, args.layers, args.seq) for ws in args.world_size]
    else:
        rows = _fresh_processes(args)
        if rows is None:
            return 1
    print(
        f"Llama-2-70B shape ({args.layers} layers), bf16, AdamW, seq {args.seq}, batch 1 per rank, FSDP2 per layer + root, steady state (step 2)"
    )
    print(
        f"{'world':>5} {'params':>8} {'worst rank peak':>16} {'+ unseen':>18} {'measure s':>10} {'(CPU s)':>8} {'total s':>8} {'max RSS':>9}"
    )
    for r in rows:
        print(
            f"{r['world_size']:>5} {r['params'] / 1e9:7.1f}B {r['peak_bytes'] / GIB:12.2f} GiB "
            f"{r['unseen_low_bytes'] / GIB:6.2f}..{r['unseen_high_bytes'] / GIB:.2f} GiB {r['measure_seconds']:10.1f} {r['measure_cpu_seconds']:8.1f} "
            f"{r['total_seconds']:8.1f} {r['max_rss_bytes'] / GIB:6.2f} GiB"
        )
    for r in rows:
        print()
        print(r["table"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "rows": [{k: v for k, v in r.items() if k != "table"} for r in rows],
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
