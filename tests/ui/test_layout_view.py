"""The layout planner's picture (ui/parallel_view.py): every candidate plotted where the planner put
it, the front and the chosen layout, the front as a table with the chosen row marked."""

from __future__ import annotations

import torch

from memsave_nb.planner.layout import plan_layout
from memsave_nb.target import Target
from memsave_nb.ui.parallel_view import layout_figure, layout_front_html
from memsave_nb.workload import Workload
from memsave_nb.zoo import GPT, GPTConfig


def _result(gb: float):
    cfg = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab_size, (1, cfg.block_size))
    wl = Workload(model, {"idx": idx, "targets": idx}, name="gpt")
    return plan_layout(
        wl, 2, "H100", Target(gb, headroom=1.0), tensor_parallel=(1,), remeasure=False, region_kinds=(None, "full")
    )


def test_layout_figure_and_front_table():
    r = _result(460_000 / 2**30)  # 460 kB per GPU: some layouts fit, some do not
    assert r.chosen is not None and r.fitting and len(r.fitting) < len(r.candidates)
    fig = layout_figure(r)
    fit = fig.select_one({"name": "layout_fit"}).data_source.data
    nofit = fig.select_one({"name": "layout_nofit"}).data_source.data
    assert sorted(fit["peak"] + nofit["peak"]) == sorted(c.est_peak_bytes for c in r.candidates)
    assert all(p <= r.target.usable_bytes for p in fit["peak"]) and all(
        p > r.target.usable_bytes for p in nofit["peak"]
    )
    assert fig.select_one({"name": "layout_front"}).data_source.data["label"] == [c.label for c in r.front]
    assert fig.select_one({"name": "layout_chosen"}).data_source.data["label"] == [r.chosen.label]
    assert fig.select_one({"name": "layout_usable_line"}).location == r.target.usable_bytes
    page = layout_front_html(r)
    assert page.count("<tr") == len(r.front) + 1 and page.count("memsave-layout-chosen") == 1
    assert "no layout fits" in layout_front_html(_result(1 / 2**20))
