"""The KV-cache switch on models that carry a config the way Hugging Face models do (a ``config``
attribute with ``use_cache``), without transformers: exact restore, and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_nb import hf
from memsave_nb.measure import measure
from memsave_nb.plan import Plan, PlanError
from memsave_nb.workload import Workload


class ClassDefault:
    use_cache = True  # a class attribute only: the instance has none to put back


class ReadOnly:
    @property
    def use_cache(self):
        return True


class WithConfig(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)])

    def forward(self, x, use_cache=None):
        for block in self.blocks:
            x = block(x)
        return x


REGIONS = Plan(regions={"blocks.0": "save_matmuls", "blocks.1": "full"})


def test_a_class_default_is_shadowed_for_the_step_and_removed_after():
    config = ClassDefault()
    wl = Workload(WithConfig(config), {"x": torch.randn(2, 4)})
    with REGIONS.apply(wl) as applied:
        assert config.use_cache is False and "use_cache" in vars(config)
        measure(applied, "real", repeats=0, flops=False)
    assert config.use_cache is True and "use_cache" not in vars(config)
    assert "KV cache off" in REGIONS.describe(wl.model)


def test_a_cache_that_cannot_be_turned_off_is_refused_in_one_line():
    wl = Workload(WithConfig(ReadOnly()), {"x": torch.randn(2, 4)})
    with pytest.raises(PlanError, match=r"use_cache cannot be set .*build the model with use_cache=False") as info:
        with REGIONS.apply(wl):
            raise AssertionError("the plan should not apply")
    assert "\n" not in str(info.value)
    assert "forward" not in vars(wl.model.blocks[0])  # nothing left wrapped


def test_plans_without_regions_leave_the_cache_alone():
    config = ClassDefault()
    wl = Workload(WithConfig(config), {"x": torch.randn(2, 4), "use_cache": True})
    with Plan(frozen=["blocks.0"]).apply(wl) as applied:
        assert config.use_cache is True
        measure(applied, "real", repeats=0, flops=False)
    with pytest.raises(PlanError, match="the batch passes use_cache=True"):
        with REGIONS.apply(wl):
            pass
    assert hf.cache_configs(wl.model) == [config]
    assert hf.cache_configs(nn.Linear(2, 2)) == []
