"""Screens that say what was sized (issue 42), without a browser: a model opened by name shows the
batch and sequence it sized (and a plan's knobs move them), "max seq len" searches a model by
name, the front list's rows say what differs, and "none fits" reports the wait the user had."""

from __future__ import annotations

import re
import time

import pytest
import torch

from memsave_nb import measure
from memsave_nb.hub import from_pretrained
from memsave_nb.plan import Plan
from memsave_nb.target import CUDA_CONTEXT_BYTES, Target, fit_of, measure_peak
from memsave_nb.ui.explorer import explore
from memsave_nb.ui.front_list import FrontList, row_label, shared_prefix
from memsave_nb.ui.sized import batch_words, no_seq_reason
from memsave_nb.workload import Workload

pytestmark = pytest.mark.timeout(300)
CFG = dict(
    overrides=dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
    )
)


@pytest.fixture(scope="module")
def named():
    ex = explore("llama-3.2-1b", lora=dict(r=4), batch_size=2, seq_len=48, live=False, repeats=0, **CFG)
    yield ex
    ex.close()


def test_a_model_by_name_shows_the_batch_and_sequence_it_sized(named):
    title = named.title.value
    assert "(batch 2 × seq 48)" in title and "memsave-sized" in title
    assert "sized as CUDA runs it" in title  # kept: the step is sized as CUDA runs it
    # a plan's knobs move what is sized, and the title follows the plan on display
    named.set_plan(Plan(seq_len=96))
    entry = named.run_now(raise_errors=True)
    assert "(batch 2 × seq 96)" in named.title.value
    direct = measure(from_pretrained("llama-3.2-1b", lora=dict(r=4), batch_size=2, seq_len=96, **CFG), mode="fake")
    assert entry.measurement.peak_bytes == direct.peak_bytes  # the numbers are the sized step's
    named.set_plan(Plan())
    named.run_now(raise_errors=True)
    assert "(batch 2 × seq 48)" in named.title.value


def test_batch_words_for_batches_a_user_passes():
    model = torch.nn.Embedding(10, 4)
    assert batch_words(Workload(model, {"input_ids": torch.zeros(3, 7, dtype=torch.long)})) == "batch 3 × seq 7"
    assert batch_words(Workload(torch.nn.Linear(4, 2), torch.randn(5, 4))) == "batch 5"
    # a function the user wrote is never called to find out
    calls = []
    assert batch_words(Workload(torch.nn.Linear(4, 2), lambda: calls.append(1) or torch.randn(5, 4))) == ""
    assert calls == []
    assert batch_words(Workload(torch.nn.Linear(4, 2), torch.randn(5, 4)), Plan(batch_size=9)) == "batch 9"


def test_max_seq_len_searches_a_model_by_name(named):
    panel = named.tuner
    assert not panel.max_seq_button.disabled and panel.max_seq_result.value == ""
    assert no_seq_reason(named.session.workload) == ""
    wl = named.session.workload
    # a target between seq 96 and seq 160: the replay's line is the GPU less the CUDA context
    r96 = measure_peak(wl, Plan(seq_len=96)).reserved.max_reserved_bytes
    r160 = measure_peak(wl, Plan(seq_len=160)).reserved.max_reserved_bytes
    assert r96 < r160
    panel.set_target((CUDA_CONTEXT_BYTES + (r96 + r160) / 2) / 2**30, headroom=1.0)
    found = panel.find_max_seq_len()
    assert found is not None and 96 <= found < 160, found
    # the oracle: that length measured on a fresh build fits, one more does not
    fits = measure_peak(from_pretrained("llama-3.2-1b", lora=dict(r=4), batch_size=2, seq_len=found, **CFG), Plan())
    over = measure_peak(from_pretrained("llama-3.2-1b", lora=dict(r=4), batch_size=2, seq_len=found + 1, **CFG), Plan())
    assert fit_of(panel.target, fits).fits and not fit_of(panel.target, over).fits
    assert f"max sequence length that fits: <b>{found}</b>" in panel.max_seq_result.value


def test_max_seq_len_reasons_a_user_can_follow():
    fn = Workload(torch.nn.Linear(4, 2), lambda: torch.randn(5, 4))
    assert "the batch is a function of yours" in no_seq_reason(fn) and "pass the batch itself" in no_seq_reason(fn)
    assert "no token-id inputs" in no_seq_reason(Workload(torch.nn.Linear(4, 2), torch.randn(5, 4)))
    assert no_seq_reason(Workload(torch.nn.Embedding(10, 4), torch.zeros(2, 3, dtype=torch.long))) == ""


def test_front_rows_of_a_hf_model_say_what_differs(named):
    from memsave_nb.planner import plan_for

    front = plan_for(named.session.workload, Target(24), mode="fake", precisions=(None,)).front
    box = FrontList(lambda _i: None)
    box.set_front(front, list(range(len(front))))
    box.show(front, None)
    assert box.prefix == "base_model.model.model."
    assert "modules under <code>base_model.model.model.</code>" in box.heading.value
    shown = [re.sub(r"<[^>]+>", "", r.children[1].value).split("est. peak")[0] for r in box.rows]
    assert any("layers.0" in s for s in shown)
    assert not any("base_model" in s for s in shown)
    assert len(set(shown)) == len(shown), shown  # every row reads differently
    # the full label stays in the tooltip
    full = [c.label for c in front if c.plan.active_regions]
    assert full and all(html_escaped(label) in " ".join(r.children[1].value for r in box.rows) for label in full)


def html_escaped(s: str) -> str:
    import html

    return html.escape(s, quote=True)


def test_shared_prefix_keeps_the_container_and_leaves_other_names_alone():
    from memsave_nb.planner import Candidate

    def cand(*names: str) -> Candidate:
        return Candidate(Plan(regions={n: "offload" for n in names}), "as given", 1, 1.0, True)

    front = [cand("m.model.layers.0", "m.model.layers.1"), cand("m.model.layers.0"), cand()]
    assert shared_prefix(front) == "m.model."
    c = Candidate(Plan(regions={"m.model.layers.0": "full"}), "x", 1, 1.0, True)
    assert row_label(c, "m.model.") == c.label.replace("m.model.", "")
    assert shared_prefix([cand("layers.0"), cand("head")]) == ""


@pytest.mark.slow
def test_none_fits_reports_the_wait_the_user_had(named):
    panel = named.tuner
    panel.set_target(1e-5, headroom=1.0)  # 10 kB: nothing fits
    t0 = time.perf_counter()
    result = panel.search(precisions=(None,))
    waited = time.perf_counter() - t0
    assert result is not None and not result.fitting and panel.hints
    said = float(re.search(r"none fits.*\(([\d.]+) s\)", panel.status.value).group(1))
    # the status is the user's wait (search and the knobs tried after it), not the planner's share
    assert abs(said - waited) <= 0.15, (said, waited)
    assert said > result.seconds + 0.05, (said, result.seconds)
