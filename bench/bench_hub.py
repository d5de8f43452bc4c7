"""Models by name against the anchors people use: accelerate's ``estimate-memory`` figure, the
"16 bytes per parameter" rule, and our steady-state peak with its split, for catalogue models,
full fine-tuning (bf16 weights, and fp32 weights under bf16 autocast), LoRA and QLoRA (nf4).

accelerate's figure is computed here with its own functions on the same config: its
``create_empty_model`` builds ``AutoModel`` (the base model, no LM head) from the hub config in
float32; ``calculate_maximum_sizes`` gives its bytes; ``estimate_training_usage`` gives the
"Training using Adam (Peak vRAM)" column, which ``estimate-memory`` prints as the largest of its
parts (float32: 4x the float32 model, 16 bytes/param; bfloat16: 2x, 8 bytes/param). It ignores
LoRA and quantisation. Ours: ``from_pretrained`` + ``measure(mode="fake")``, AdamW as torch runs it
on a GPU (foreach), the peak from step 2 on (optimizer state alive).

    python bench/bench_hub.py            # five models, batch 1, seq 1024 (minutes on this CPU)
    python bench/bench_hub.py --quick    # two small models cut to 2 layers, seq 128 (under a minute)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from memsave_nb.hub import from_pretrained, resolve_config  # noqa: E402
from memsave_nb.measure import measure  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "hub.json"
MODELS = ["qwen2.5-0.5b", "llama-3.2-1b", "smollm2-1.7b", "qwen2.5-7b", "llama-3.1-8b"]
QUICK_MODELS = ["smollm2-135m", "qwen2.5-0.5b"]
SETUPS = {  # name -> from_pretrained arguments (and autocast for mixed precision)
    "full bf16": dict(dtype="bf16"),
    "full fp32+autocast": dict(dtype="fp32"),
    "LoRA r=16": dict(dtype="bf16", lora="r=16"),
    "QLoRA nf4 r=16": dict(dtype="bf16", lora="r=16", quantize="nf4"),
}
GiB = 2**30


def gpu_adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)  # torch's default step on a CUDA GPU


def accelerate_estimate(name: str, overrides: dict) -> dict:
    """accelerate's estimate-memory numbers for this config, from its own functions (no hub needed)."""
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModel

    with init_empty_weights():
        config = resolve_config(name)
        for key, value in overrides.items():
            setattr(config, key, value)
        model = AutoModel.from_config(config)  # as create_empty_model builds it
    total, _ = calculate_maximum_sizes(model)
    return {
        "model_bytes_fp32": total,
        "training_fp32": max(estimate_training_usage(total, "float32").values()),
        "training_bf16": max(estimate_training_usage(total, "bfloat16").values()),
    }


def ours(name: str, setup: dict, batch: int, seq: int, overrides: dict) -> dict:
    wl = from_pretrained(name, batch_size=batch, seq_len=seq, optimizer=gpu_adamw, overrides=overrides, **setup)
    if setup["dtype"] == "fp32":
        wl = wl.replace(autocast_dtype=torch.bfloat16)
    trainable = sum(p.numel() for p in wl.model.parameters() if p.requires_grad)
    start = time.perf_counter()
    m = measure(wl, "fake", flops=False)
    return {
        "trainable": trainable,
        "peak_bytes": m.peak_bytes,
        "peak_phase": m.peak_phase,
        "split": dict(vars(m.peak_split)),
        "fake_seconds": time.perf_counter() - start,
    }


def parameter_count(name: str, overrides: dict) -> int:
    """Parameters of the unquantised model with its head (a quantised base holds buffers instead)."""
    return sum(p.numel() for p in from_pretrained(name, overrides=overrides).model.parameters())


def run(models: list[str], batch: int, seq: int, overrides: dict | None = None) -> list[dict]:
    overrides = overrides or {}
    rows = []
    for name in models:
        anchor = accelerate_estimate(name, overrides)
        params = parameter_count(name, overrides)
        for label, setup in SETUPS.items():
            rows.append(
                {
                    "model": name,
                    "setup": label,
                    **anchor,
                    "params": params,
                    "rule_16_bytes": 16 * params,
                    **ours(name, setup, batch, seq, overrides),
                }
            )
    return rows


def table(rows: list[dict], batch: int, seq: int) -> str:
    g = lambda n: f"{n / GiB:,.2f}"  # noqa: E731
    lines = [
        f"batch {batch}, seq {seq}, AdamW (foreach), fake mode, torch {torch.__version__}; GiB",
        "",
        "| model | setup | params (trainable) | accelerate fp32 / bf16 | 16 B/param | our peak | params+quant | grads | "
        "optimizer | activations | outputs | temporaries | phase | s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        s = r["split"]
        lines.append(
            f"| {r['model']} | {r['setup']} | {r['params'] / 1e9:.2f}B ({r['trainable'] / 1e6:,.1f}M) "
            f"| {g(r['training_fp32'])} / {g(r['training_bf16'])} | {g(r['rule_16_bytes'])} | **{g(r['peak_bytes'])}** "
            f"| {g(s['parameters'])} | {g(s['gradients'])} | {g(s['optimizer_state'])} | {g(s['activations'])} "
            f"| {g(s['outputs'])} | {g(s['temporaries'])} | {r['peak_phase']} | {r['fake_seconds']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small catalogue models at seq 128")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=None, help="default 1024 (128 with --quick)")
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--layers", type=int, default=None, help="cut every model to this many layers (2 with --quick)")
    parser.add_argument(
        "--out", type=Path, default=None, help=f"JSON output (default {RESULTS.relative_to(ROOT)}; none with --quick)"
    )
    args = parser.parse_args(argv)
    seq = args.seq or (128 if args.quick else 1024)
    models = args.models or (QUICK_MODELS if args.quick else MODELS)
    layers = args.layers or (2 if args.quick else None)
    rows = run(models, args.batch, seq, {"num_hidden_layers": layers} if layers else None)
    print(table(rows, args.batch, seq) + (f"\n(every model cut to {layers} layers)" if layers else ""))
    out = args.out or (None if args.quick else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "date": _dt.date.today().isoformat(),
                    "machine": platform.machine(),
                    "torch": torch.__version__,
                    "batch": args.batch,
                    "seq": seq,
                    "layers": layers,
                    "quick": args.quick,
                    "rows": rows,
                },
                indent=1,
                default=str,
            )
        )
    return rows


if __name__ == "__main__":
    main()
