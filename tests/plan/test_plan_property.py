"""Every plan gives stock gradients or is refused with one PlanError line (issue 9, section 1).

Random plans -- frozen/trainable sets x memory-saving layers x regions of every policy kind
(presets, full, custom selective ops with default save or recompute, nested) x batch norm in eval
x input grad -- over a CNN, an MLP with BatchNorm1d, a transformer block and the zoo GPT, all in
float64, against the stock model's own gradients. 250 seeded plans per model: ~1000 cases.
"""

from __future__ import annotations

import json
import random

import pytest

from random_plans import MODELS, Checker, Outcome, random_plan

PLANS_PER_MODEL = 250


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_random_plans_give_stock_gradients_or_a_plan_error(model):
    checker = Checker(model)
    outcome = Outcome()
    refusals: list[str] = []

    def refused(exc) -> None:
        text = str(exc)
        assert text and "\n" not in text, f"a refusal must be one line: {text!r}"
        refusals.append(text)

    rng = random.Random(f"issue9-{model}")
    for i in range(PLANS_PER_MODEL):
        fields = random_plan(rng, checker.workload.model)
        try:
            checker.check(fields, outcome, refused)
        except BaseException as exc:
            raise AssertionError(f"{model} plan #{i} {json.dumps(fields)}: {type(exc).__name__}: {exc}") from exc
    # the sample must exercise what it claims: most plans run and compare gradients
    assert outcome.checked + outcome.refused + outcome.skipped == PLANS_PER_MODEL
    assert outcome.checked >= 0.6 * PLANS_PER_MODEL, outcome
    assert outcome.compared_tensors >= 5 * outcome.checked, outcome
    assert outcome.memsave_and_save_default >= 10, outcome
    print(f"{model}: {outcome}; refusal kinds: {sorted({r.split(':')[1][:40] for r in refusals})}")
