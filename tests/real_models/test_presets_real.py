"""Every preset that applies to a real model applies, runs a measured step, and trains exactly the
parameters it reports (counted against the gradients a step makes); the model is left as it was."""

from __future__ import annotations

from memsave_nb import presets
from memsave_nb.measure import measure
from memsave_nb.model_state import ModelSnapshot
from .real_steps import step_grads

EXPECTED = {  # the presets offered for a token-id batch (no input-only, no BN eval)
    "gpt2": {
        "all trainable",
        "last block",
        "head only",
        "bias only (BitFit)",
        "norm layers only",
        "first quarter",
        "last quarter",
    },
    "lora-llama": {
        "all trainable",
        "last block",
        "head only",
        "norm layers only",
        "first quarter",
        "last quarter",
        "adapters only (LoRA)",
    },
}


def test_presets_apply_run_and_train_what_they_report(case):
    wl = case.workload
    offered = presets.presets_for(wl)
    if case.name in EXPECTED:
        assert set(offered) == EXPECTED[case.name]
    snapshot = ModelSnapshot.capture(wl.model)
    for label, plan in offered.items():
        names = plan.trainable_parameter_names(wl.model)
        assert names, label
        with plan.apply(wl) as applied:
            grads = step_grads(applied)
            m = measure(applied, "real", repeats=0, flops=False)
        assert list(grads) == names, label
        grad_bytes = sum(g.numel() * g.element_size() for g in grads.values())
        assert max(m.timeline.by_category["gradients"]) == grad_bytes, label  # a tied gradient counted once
        assert snapshot.differences(wl.model) == [], label
    norms = {"llama": 2 * 2 + 1, "lora-llama": 2 * 2 + 1, "t5": 2 * 2 + 1 + 2 * 3 + 1, "gpt2": 2 * 2 + 1}
    if case.name in norms:  # HF's own norm classes (LlamaRMSNorm, T5LayerNorm) count as norm layers
        assert len(offered["norm layers only"].trainable) == norms[case.name]
    if "adapters only (LoRA)" in offered:
        lora = offered["adapters only (LoRA)"].trainable_parameter_names(wl.model)
        assert lora and all("lora_" in n for n in lora)
        assert len(lora) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
