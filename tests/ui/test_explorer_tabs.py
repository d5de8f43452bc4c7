"""explore(..., tab=...) opens the explorer on a given tab (notebooks 07 and 08 end on theirs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_nb.errors import MemsaveError
from memsave_nb.ui.explorer import explore


def _model_and_batch():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(3, 6)


def test_explore_opens_the_named_tab_and_defaults_to_layers():
    model, batch = _model_and_batch()
    default = explore(model, batch, live=False, repeats=0)
    assert default.tabs.selected_index == 0 and default.tabs.titles[0] == "Layers"
    fit = explore(model, batch, mode="fake", live=False, repeats=0, tab="fit a gpu")  # case ignored
    assert fit.tabs.titles[fit.tabs.selected_index] == "Fit a GPU"
    assert fit.tabs.children[fit.tabs.selected_index] is fit.tuner
    fit.show_tab("GPUs")
    assert fit.tabs.children[fit.tabs.selected_index] is fit.gpus


def test_an_unknown_tab_is_a_one_line_error_naming_the_tabs():
    model, batch = _model_and_batch()
    ex = explore(model, batch, live=False, repeats=0, tab="GPUs")
    with pytest.raises(MemsaveError, match=r"no tab 'Tuner'.*Fit a GPU") as info:
        ex.show_tab("Tuner")
    assert "\n" not in str(info.value)
    assert ex.tabs.children[ex.tabs.selected_index] is ex.gpus  # left as it was
