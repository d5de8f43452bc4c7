"""The layout search's lower bound counts every optimizer's state from the vocabulary's layout
(``vocabulary.OPTIMIZER_STATE``): ``adamw_foreach`` and ``adamw_fused`` counted 0 where they hold
AdamW's two moments. The oracle: the state the real torch optimizer makes on a small model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_nb import zoo
from memsave_nb.knobs import optimizer_factory
from memsave_nb.measure.optimizer_state import make_state_on_zero_grads
from memsave_nb.parallel import ParallelSpec
from memsave_nb.planner.depth import blocks_of
from memsave_nb.planner.layout_estimate import LayoutSearch, _optimizer_state_factor
from memsave_nb.planner.layout_measure import RankSizes
from memsave_nb.planner.links import fabric_for
from memsave_nb.planner.roofline import device_named
from memsave_nb.target import Target
from memsave_nb.vocabulary import OPTIMIZER_STATE, OPTIMIZERS
from memsave_nb.workload import Workload


def test_every_optimizer_has_a_state_layout():
    assert list(OPTIMIZER_STATE) == list(OPTIMIZERS)


def _real_state_bytes(name: str) -> tuple[int, int, int]:
    """(trainable bytes, state bytes the optimizer made, parameter tensors): float32, 8-bit sized tensors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 96), nn.Linear(96, 64))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_factory(name)(params)
    make_state_on_zero_grads(optimizer, params)
    seen: dict[int, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                seen[id(value.untyped_storage())] = value.untyped_storage().nbytes()
    return sum(p.numel() * p.element_size() for p in params), sum(seen.values()), len(params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_factor_is_a_tight_lower_bound_of_the_real_state(name):
    wl = Workload(nn.Linear(1, 1), torch.zeros(1, 1), optimizer=name)
    factor = _optimizer_state_factor(wl, None)
    trainable, real, tensors = _real_state_bytes(name)
    assert factor * trainable <= real
    moments, bits = OPTIMIZER_STATE[name]
    if moments and bits != 8:  # counted: all but the step counters (a float32 scalar per tensor at most)
        assert real - factor * trainable <= 4 * tensors, (name, factor, real)
    elif moments:  # 8-bit: also the absmax scales and the small tensors (biases) kept at 32 bits
        assert real - factor * trainable <= 0.1 * real, (name, factor, real)
    if name in ("adamw_foreach", "adamw_fused"):  # the same state as adamw (they counted 0)
        assert factor == _optimizer_state_factor(wl.replace(optimizer="adamw"), None) == 2.0


def test_the_layout_lower_bound_counts_fused_and_foreach_adamw_as_adamw():
    wl = zoo.gpt(zoo.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0), 2)
    trainable = sum(p.numel() * 4 for p in wl.model.parameters())
    spec = ParallelSpec(world_size=2)
    bounds = {}
    for name in ("sgd", "adamw", "adamw_foreach", "adamw_fused"):
        w = wl.replace(optimizer=name)
        search = LayoutSearch(RankSizes(w, blocks_of(w.model), device_named("H100")), fabric_for("H100"), Target(80), 4)
        bounds[name] = search.lower_bound(spec, None, None)
    assert bounds["adamw_foreach"] == bounds["adamw_fused"] == bounds["adamw"]
    assert bounds["adamw"] - bounds["sgd"] == pytest.approx(2 * trainable / spec.world_size)
