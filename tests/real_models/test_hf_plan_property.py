"""Random plans on Hugging Face models: the choices combined, against plain PyTorch.

Freezing presets (or random names) x memory-saving layers x regions (full, selective with a random
per-op policy, offload, presets) x workload knobs (batch size, sequence length, accumulation,
precision, optimizer, set_to_none), on tiny GPT-2 (ReLU MLP), Llama, a peft LoRA Llama and T5,
float64 (float32 for the precision knobs). For every plan (see ``hf_plans.Checker.check``):

- the gradients the engine's optimizer sees equal those of plain PyTorch with no plan and the same
  knobs (float64: rtol 1e-9; autocast bf16: rtol 1e-5 on float32; bf16 parameters: against a bf16
  copy, rtol 1e-2 / atol 1e-4, since bf16 rounds each sum);
- fake mode counts what real mode counts: peak, its split, saved, outputs, end of forward, output
  parts and every module row (docs/architecture.md: "bytes equal real mode on the CPU");
- the model is as it was: parameters (bits, dtype), requires_grad, grads, module objects and
  classes, train/eval, hooks, ``config.use_cache``; the batch too;
- or the plan is refused with one PlanError line, and the model is unchanged;
- for some plans, ``to_code()``'s snippet run on a fresh copy of the model trains the same
  parameters to the same gradients and (but offload) keeps the same bytes under the same knobs.

GPT-2 and Llama also run some plans from ``inputs_embeds`` (float: the input may require grad) and
some measure training's second step (steady state).

Counts per model are printed (``-s``); the sample must exercise the combinations it claims.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from .hf_plans import MODELS, Checker, Outcome, random_plan

# plans per model: about 0.5 s (GPT-2) to 1.7 s (T5) each on one core, real and fake step included
PLANS = {"gpt2": 40, "llama": 36, "lora-llama": 28, "t5": 12}


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_random_hf_plans_match_plain_pytorch_or_refuse(model):
    checker = Checker(model)
    outcome = Outcome()
    rng = random.Random(f"combos-{model}")
    n = PLANS[model]
    for i in range(n):
        fields = random_plan(rng, checker.workload(torch.float64).model)
        steady = rng.random() < 0.3  # some plans measure training's second step
        embeds = rng.random() < 0.3  # GPT-2 and Llama: some run from inputs_embeds (input grads possible)
        snippet = rng.random() < 0.4  # some also run their to_code() snippet on a fresh model
        try:
            checker.check(fields, outcome, steady, embeds, snippet)
        except BaseException as exc:
            raise AssertionError(
                f"{model} plan #{i} (replay: hf_plans.replay({model!r}, {json.dumps(json.dumps(fields))}, {steady}, {embeds}, {snippet})): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    print(
        f"{model}: {outcome.tried} tried, {outcome.compared} compared ({outcome.compared_tensors} gradients, "
        f"{outcome.snippets} snippets), "
        f"{outcome.refused} refused, {outcome.skipped} with nothing to differentiate; {outcome.kinds}; "
        f"refusals: {sorted(outcome.refusals)}"
    )
    assert outcome.tried == n == outcome.compared + outcome.refused + outcome.skipped
    assert outcome.compared >= 0.6 * n, outcome
    # the sample meets the choices it is about
    for combination in ("memsave+regions", "precision+regions", "accumulation+regions", "region:offload"):
        assert outcome.kinds.get(combination, 0) >= 1, (combination, outcome.kinds)
