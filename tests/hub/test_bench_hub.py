"""bench/bench_hub.py --quick runs and its anchors are what they claim: accelerate's training figure
is its documented 16 (fp32) / 8 (bf16) bytes per base-model parameter, the rule is 16 bytes per
parameter, and our split adds up, with parameters and AdamW state counted exactly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_hub.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_hub", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quick_mode_table_and_anchors(capsys):
    from transformers import AutoModel

    from memsave_nb.hub import from_pretrained, resolve_config

    bench = load_bench()
    rows = bench.main(["--quick", "--models", "smollm2-135m"])
    printed = capsys.readouterr().out
    assert [r["setup"] for r in rows] == list(bench.SETUPS)
    assert all(f"| smollm2-135m | {setup} |" in printed for setup in bench.SETUPS)
    config = resolve_config("smollm2-135m")
    config.num_hidden_layers = 2
    base = AutoModel.from_config(config)  # accelerate builds AutoModel (no head) in float32
    base_bytes = sum(t.numel() * t.element_size() for t in [*base.parameters(), *base.buffers()])
    full = from_pretrained("smollm2-135m", overrides={"num_hidden_layers": 2})
    params = sum(p.numel() for p in full.model.parameters())
    tensors = len(list(full.model.parameters()))
    by_setup = {r["setup"]: r for r in rows}
    for r in rows:
        assert r["model_bytes_fp32"] == base_bytes
        assert r["training_fp32"] == 4 * base_bytes and r["training_bf16"] == 2 * base_bytes
        assert r["rule_16_bytes"] == 16 * params
        assert sum(r["split"].values()) == r["peak_bytes"]
    bf16 = by_setup["full bf16"]["split"]
    buffers = sum(b.numel() * b.element_size() for b in full.model.buffers())
    assert bf16["parameters"] == 2 * params + buffers
    assert bf16["optimizer_state"] == 2 * 2 * params + 4 * tensors  # exp_avg, exp_avg_sq in bf16; a float32 step each
    assert by_setup["full fp32+autocast"]["split"]["optimizer_state"] == 2 * 4 * params + 4 * tensors
    assert by_setup["QLoRA nf4 r=16"]["split"]["parameters"] < by_setup["LoRA r=16"]["split"]["parameters"]
    assert by_setup["LoRA r=16"]["trainable"] == by_setup["QLoRA nf4 r=16"]["trainable"] < params // 100
