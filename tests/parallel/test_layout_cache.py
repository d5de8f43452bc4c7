"""The layout search's kept measurements (planner/layout_cache.py): a second search of the same step
gives the answer a fresh search gives, measuring only what the first did not; a changed model or
start plan measures afresh. The oracle is the same search with ``reuse=False``."""

from __future__ import annotations

import pytest
import torch

from memsave_nb.plan import Plan
from memsave_nb.planner import layout_cache
from memsave_nb.planner.layout import plan_layout
from memsave_nb.target import Target
from memsave_nb.workload import Workload
from memsave_nb.zoo import GPT, GPTConfig


def _gpt() -> Workload:
    cfg = GPTConfig(vocab_size=128, block_size=16, n_layer=5, n_head=2, n_embd=32, dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    return Workload(model, {"idx": idx, "targets": idx}, name="gpt")


def _answer(r) -> tuple:
    return (
        r.candidates,
        r.front,
        r.chosen,
        r.pruned,
        r.notes,
        r.remeasured.device_peak_bytes if r.remeasured else None,
    )


def _search(wl, gpu="H100", target=None, plan=None, reuse=True):
    return plan_layout(wl, 2, gpu, target, tensor_parallel=(1,), plan=plan, reuse=reuse)


@pytest.fixture(autouse=True)
def _empty_cache():
    layout_cache.clear()
    yield
    layout_cache.clear()


def test_a_second_search_of_the_same_step_measures_nothing_and_answers_the_same():
    wl = _gpt()
    first = _search(wl)
    assert first.measurements > 0 and first.chosen is not None
    again, fresh = _search(wl, "A100"), _search(wl, "A100", reuse=False)  # another GPU kind: other times, same bytes
    assert _answer(again) == _answer(fresh)
    assert again.measurements == 0 and fresh.measurements > 0
    target = Target(0.0005, headroom=1.0)  # 0.5 MB: other layouts pruned, others measured
    tight, fresh = _search(wl, target=target), _search(wl, target=target, reuse=False)
    assert _answer(tight) == _answer(fresh) and tight.measurements < fresh.measurements
    assert _answer(_search(wl)) == _answer(first)


@pytest.mark.slow
def test_a_changed_model_or_start_plan_is_measured_afresh():
    wl = _gpt()
    _search(wl)
    wl.model.head.weight.requires_grad_(False)  # frozen between two clicks
    frozen = _search(wl)
    assert frozen.measurements > 0 and _answer(frozen) == _answer(_search(wl, reuse=False))
    wl.model.head.weight.requires_grad_(True)
    plan = Plan(frozen=("blocks.0",))
    started = _search(wl, plan=plan)
    assert started.measurements > 0 and _answer(started) == _answer(_search(wl, plan=plan, reuse=False))
    assert _search(wl).measurements == 0  # the first store is still kept
