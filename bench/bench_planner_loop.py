"""The planner's chosen plan against the exported snippet's own loop (issue 24).

A Qwen2-0.5B shape (24 layers, d 896, GQA 14/2 heads, vocabulary 151,936, tied embeddings) built
under FakeTensorMode, batch 8, sequence 256, AdamW, the workload's default loop (``loss_only``).
The planner runs in fake mode under a 16 GB target; the chosen plan is exported with
``Plan.to_code(loop=workload.loop)``, executed on the same fake model, and its own ``training_step``
runs twice with PyTorch's MemTracker on the second step. The claim: the chosen plan's re-measured
peak equals MemTracker's, to the byte. Writes bench/results/planner_loop.json.

    OMP_NUM_THREADS=1 python bench/bench_planner_loop.py
    python bench/bench_planner_loop.py --quick --out /tmp/planner_loop.json   # smoke test: a 2-layer Qwen2 shape
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from memsave_nb import Workload  # noqa: E402
from memsave_nb.measure.fake_compat import same_path_as_real  # noqa: E402
from memsave_nb.planner import plan_for  # noqa: E402
from memsave_nb.target import Target  # noqa: E402

BATCH, SEQ, TARGET_GB = 8, 256, 16
QUICK_BATCH, QUICK_SEQ, QUICK_TARGET_GB = 2, 32, 1
RESULTS = Path(__file__).resolve().parent / "results" / "planner_loop.json"


def qwen2_05b(fake_mode: FakeTensorMode, quick: bool = False) -> Workload:
    """The Qwen2-0.5B shape; ``quick``: 2 layers, d 64, vocabulary 1000 (the smoke test's)."""
    import transformers

    transformers.logging.set_verbosity_error()
    if quick:
        cfg = transformers.Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
            max_position_embeddings=256,
            tie_word_embeddings=True,
        )
    else:
        cfg = transformers.Qwen2Config(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
        )
    with fake_mode:
        model = transformers.Qwen2ForCausalLM(cfg).train()
    batch, seq = (QUICK_BATCH, QUICK_SEQ) if quick else (BATCH, SEQ)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return Workload(model, {"input_ids": ids, "labels": ids}, name="qwen2-tiny" if quick else "qwen2-0.5b")


def snippet_peak(wl: Workload, plan, fake_mode: FakeTensorMode) -> int:
    """MemTracker's peak of step 2 of the snippet's own training_step (fake mode; transformers'
    mask checks answered from the real batch, as the engine's fake step does)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    namespace = {"model": wl.model}
    with fake_mode, same_path_as_real(wl):
        exec(compile(plan.to_code(loop=wl.loop), "<plan>", "exec"), namespace)  # noqa: S102
        model = namespace["model"]
        optimizer = namespace.get("optimizer") or torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=1e-3
        )
        ids = fake_mode.from_tensor(wl.batch["input_ids"][: plan.batch_size or len(wl.batch["input_ids"])])
        micro = [{"input_ids": ids, "labels": ids}]
        namespace["training_step"](model, micro, optimizer)
        tracker = MemTracker()
        tracker.track_external(model, optimizer, ids)
        with tracker:
            namespace["training_step"](model, micro, optimizer)
        (peak,) = tracker.get_tracker_snapshot("peak").values()
    return int(peak["Total"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 2-layer Qwen2 shape, batch 2, seq 32, 1 GB target"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    wl = qwen2_05b(fake_mode, args.quick)
    batch, seq, target_gb = (QUICK_BATCH, QUICK_SEQ, QUICK_TARGET_GB) if args.quick else (BATCH, SEQ, TARGET_GB)
    start = time.perf_counter()
    result = plan_for(wl, Target(target_gb), mode="fake", device="H100")
    seconds = time.perf_counter() - start
    chosen = result.chosen
    print(result.summary())
    mem = snippet_peak(wl, chosen.plan, fake_mode)
    row = {
        "model": f"{wl.name} shape",
        "batch": batch,
        "seq": seq,
        "target_gb": target_gb,
        "loop": wl.loop,
        "chosen": chosen.label,
        "claimed_peak_bytes": chosen.measured_peak_bytes,
        "memtracker_snippet_bytes": mem,
        "difference_bytes": chosen.measured_peak_bytes - mem,
        "planner_seconds": round(seconds, 1),
    }
    print(json.dumps(row, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(row, f, indent=2)
    assert row["difference_bytes"] == 0, row


if __name__ == "__main__":
    main()
