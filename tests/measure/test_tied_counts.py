"""A weight tied between two modules (GPT-2's wte and lm_head) is one parameter: the per-module
subtree counts, and the tables built from them, count it once. The oracle is PyTorch's own
deduplicating ``module.parameters()``."""

import pytest

from memsave_nb import measure
from memsave_nb.measure.result import subtree_params
from memsave_nb.ui.format import layer_table

from .hf_models import gpt2


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_tied_weight_counted_once_in_subtree_totals(mode):
    workload = gpt2()
    model = workload.model
    m = measure(workload, mode=mode, repeats=0)
    counts = subtree_params(m.modules)
    distinct = sum(p.numel() for p in model.parameters())
    with_ties = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert with_ties > distinct  # the tie exists
    assert sum(counts[""]) == distinct
    for name, mod in model.named_modules():
        assert sum(counts[name]) == sum(p.numel() for p in mod.parameters()), name
    _, rows = layer_table(m)
    assert rows[0][3] == f"{distinct:,}"
