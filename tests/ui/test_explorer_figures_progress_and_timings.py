"""The explorer as people meet it (issue 14): figures that carry BokehJS, charts that hold every
byte, SAC choices explained before a run, progress and honest timings, small wording fixes.
Driven without a browser (set widget values, click, wait); numbers against the engine."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from memsave_nb import presets, zoo
from memsave_nb.checkpointing import OpChoice, RegionKind, RegionPolicy
from memsave_nb.errors import MemsaveError
from memsave_nb.measure import measure
from memsave_nb.plan import Plan
from memsave_nb.session import Session
from memsave_nb.ui import figures
from memsave_nb.ui.explorer import Explorer, explore
from memsave_nb.ui.format import format_bytes, format_time_spread, time_change
from memsave_nb.ui.plots import BokehFigure, bokehjs_loader, bokehjs_script, load_bokehjs
from memsave_nb.zoo import GPTConfig

pytestmark = pytest.mark.timeout(300)


def engine(workload, plan, mode="real"):
    with plan.apply(workload) as applied:
        return measure(applied, mode, repeats=0)


def walk(widget):
    yield widget
    for child in getattr(widget, "children", ()) or ():
        yield from walk(child)


@pytest.fixture(scope="module")
def cnn():
    return Explorer(Session(zoo.make("cnn", 4), repeats=3), debounce_s=0.05, live=False)


# -- 1. every figure brings BokehJS with it ------------------------------------------------------
def test_every_figure_widget_carries_the_bokehjs_loader(cnn):
    figs = [w for w in walk(cnn) if isinstance(w, BokehFigure)]
    assert len(figs) == 6  # history, peak split, timeline, layer bars, budget sweep, Pareto front (Fit a GPU)
    loader = bokehjs_loader()
    for f in figs:
        assert f.children[0] is loader  # first: its view is made before the figure's
        assert f.children[1] is f.model and "memsave-bokeh" in f._dom_classes
    assert cnn.children[0] is loader
    (out,) = loader.outputs
    js = out["data"]["application/javascript"]
    import bokeh
    from bokeh.resources import INLINE

    assert js == bokehjs_script() and f'"{bokeh.__version__}"' in js
    assert all(chunk in js for chunk in INLINE.js_raw)  # the whole bundle, inline: no network
    assert "cdn.bokeh.org" not in js.split("const chunks")[0]
    # skipped when the page already has this BokehJS, so a second view does not reload it
    assert "root.Bokeh.version === version) return" in js
    # one loader per kernel, whatever the number of explorers
    other = explore(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4), repeats=0, live=False)
    assert other.children[0] is loader


def test_load_bokehjs_publishes_on_every_call():
    """Notebooks that show Bokeh figures themselves call it in a cell; a reloaded tab that runs
    the cell again must get BokehJS again (it was once per kernel)."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    InteractiveShell.instance()
    with capture_output() as captured:
        assert load_bokehjs(force=True) and load_bokehjs(force=True)
    loads = [o for o in captured.outputs if "application/vnd.bokehjs_load.v0+json" in o.data]
    assert len(loads) == 2


# -- 2. the charts hold every byte -------------------------------------------------------------
def test_bars_sum_to_the_header_total_on_a_transformer_encoder():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False
    )
    ex = explore(enc, torch.randn(4, 16, 32), repeats=0, live=False)
    data = ex.results.layers_plot.source.data
    assert sum(data["saved_bytes"]) == figures.kept_total(ex.baseline)
    assert ex.saved_bytes.value == f"{sum(data['backward_bytes']):,} B"  # the header's saved-for-backward
    assert "layers.0.self_attn (own)" in data["name"]  # the attention, 2/3 of the bytes, is a bar


def test_bitfit_bars_and_export():
    """Notebook 05's BitFit: the chart's bars hold the header's total, and the exported code names
    a pattern, not one name per bias."""
    wl = zoo.make("cnn", 4)
    ex = Explorer(Session(wl, repeats=0), live=False)
    ex.preset.value = "bias only (BitFit)"
    entry = ex.run_now()
    assert entry is not None
    plan = ex.plan
    assert plan.frozen == ("*",) and plan.trainable == ("*.bias",)
    assert '"*.bias"' in ex.code_text or "'*.bias'" in ex.code_text
    expected = engine(wl, presets.bias_only(wl.model))  # the preset's own plan, by name
    assert entry.measurement.saved_bytes == expected.saved_bytes
    data = ex.results.layers_plot.source.data
    assert sum(data["backward_bytes"]) == expected.saved_bytes == ex.measurement.saved_bytes
    assert sum(data["saved_bytes"]) == figures.kept_total(expected)
    assert len(data["name"]) <= figures.DEFAULT_TOP


# -- 4. SAC: what cannot be saved, and presets that do nothing ------------------------------------
def test_sac_panel_says_which_ops_cannot_be_saved_before_the_run(cnn):
    cnn.table.select("layers.0.0")
    assert "aten.native_batch_norm" in cnn.sac.blocked
    assert "aten.relu_" in cnn.sac.blocked["aten.native_batch_norm"]
    advice = cnn.sac.advice.value
    assert "cannot be saved" in advice and "changed in place" in advice
    toggle = cnn.sac.toggle("aten.native_batch_norm")
    assert toggle.disabled
    assert not cnn.sac.toggle("aten.convolution").disabled
    # a programmatic "save" is refused too: the plan does not change
    before = cnn.plan
    toggle.value = "save"
    assert cnn.plan == before
    # the advice is true: a plan saving it is refused (or, without the plan's own check, fails in
    # backward with SAC's "cached ... has been mutated")
    bad = Plan(
        regions={
            "layers.0.0": RegionPolicy(
                RegionKind.SELECTIVE, {"aten.native_batch_norm": OpChoice.SAVE}, OpChoice.RECOMPUTE
            )
        }
    )
    with pytest.raises(MemsaveError, match="mutated|writes in place into the output of aten.native_batch_norm"):
        cnn.session.run(bad)


def test_save_matmuls_equals_full_checkpoint_on_a_cnn_and_the_panel_says_so(cnn):
    cnn.table.select("layers.1")
    import html

    advice = html.unescape(cnn.sac.advice.value)
    assert "'save compute-intensive' keeps aten.convolution" in advice and "equals 'full checkpoint'" in advice
    wl = cnn.session.workload
    full = engine(wl, Plan(regions={"layers.1": "full"}))
    matmuls = engine(wl, Plan(regions={"layers.1": "save_matmuls"}))
    intensive = engine(wl, Plan(regions={"layers.1": "save_compute_intensive"}))
    assert matmuls.saved_bytes == full.saved_bytes  # what the advice says
    assert intensive.saved_bytes > full.saved_bytes  # the preset it names keeps the convolutions


def test_no_preset_advice_where_matmuls_run():
    wl = zoo.gpt(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.0), batch_size=2)
    ex = Explorer(Session(wl, repeats=0), live=False)
    ex.table.select("blocks.0")
    assert "save matmuls" not in ex.sac.advice.value


# -- 5. long runs: progress, cancel, fake mode ---------------------------------------------------
class Slow(nn.Module):
    def __init__(self, seconds: float = 0.4):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return torch.relu(self.lin(x))


@pytest.mark.slow
def test_a_run_shows_its_phase_and_elapsed_time_and_can_be_cancelled():
    ex = explore(nn.Sequential(Slow(), Slow(), Slow(), Slow()), torch.randn(2, 8), repeats=0, debounce_s=0.01)
    ex.table.row("0").freeze.value = True
    deadline = time.monotonic() + 10
    while "elapsed" not in ex.progress_text.value and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ex.progress.layout.visibility == "visible" and not ex.cancel_button.disabled
    assert "measuring the step" in ex.progress_text.value and "s elapsed" in ex.progress_text.value
    time.sleep(1.2)
    assert any(f"{k} s elapsed" in ex.progress_text.value for k in range(1, 10))  # it ticks
    ex.cancel_button.click()
    assert ex.wait(30)
    assert ex.state == "cancelled" and ex.progress.layout.visibility == "hidden" and ex.progress_text.value == ""


@pytest.mark.slow
def test_fake_mode_disables_the_compile_tab_and_says_why():
    wl = zoo.gpt(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.0), batch_size=2)
    ex = Explorer(Session(wl, "fake", repeats=0), live=False)
    panel = ex.budget
    assert panel.enable.disabled and panel.sweep_button.disabled and panel.slider.disabled
    assert "fake tensors do not compile" in panel.reason.value
    panel.enable.value = True  # a programmatic tick is refused as well
    assert not panel.enable.value and ex.plan.compile_budget is None


def test_a_failed_plan_is_never_exported_as_code():
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            if not self.lin.weight.requires_grad:
                raise RuntimeError("flaky layer refuses to run frozen")
            return self.lin(x)

    ex = explore(nn.Sequential(nn.Linear(8, 8), Flaky()), torch.randn(4, 8), repeats=0, live=False)
    failing = Plan(frozen=("1",))
    ex.set_plan(failing)
    assert ex.run_now() is None and ex.state == "error"
    assert ex.plan.replace(name="") == Plan()  # the toggle did not stay on
    ex.editor.load(failing)  # set again by hand: the code tab refuses it
    assert ex.code_text.startswith("# not exported: this plan failed")


# -- 6. timings ---------------------------------------------------------------------------------
def _timed(median, times):
    return SimpleNamespace(step_seconds=median, step_seconds_all=tuple(times))


def test_time_changes_within_the_noise_read_same():
    base = _timed(0.010, [0.009, 0.010, 0.013])
    assert time_change(_timed(0.0115, [0.011, 0.0115, 0.012]), base) == "same (within noise)"
    assert time_change(_timed(0.030, [0.029, 0.030, 0.031]), base) == "3.00x"
    assert time_change(_timed(0.023, [0.023]), base).endswith("(too few runs to judge)")
    assert format_time_spread(base) == "10.0 ms (9.0 ms–13.0 ms, 3 runs)"
    assert format_time_spread(_timed(0.023, [0.023])) == "23.0 ms (1 run)"


def test_the_explorer_states_spread_runs_and_device(cnn):
    m = cnn.baseline
    assert len(m.step_seconds_all) >= 3
    assert cnn.step_time.value == format_time_spread(m) and "3 runs" in cnn.step_time.value
    assert "real mode on cpu" in cnn.results.table.value
    assert "median" in cnn.results.table.value


def test_plans_tried_has_no_duplicates_and_no_label_pileup():
    session = Session(zoo.make("mlp", batch_size=8), repeats=0)
    ex = Explorer(session, live=False)
    hist = ex.results.history_plot
    # a one-point plot: the y range is given room, so ticks cannot all read the same value
    y = hist.figure.y_range
    assert y.start == 0 and y.end == pytest.approx(1.25 * session.baseline.peak_bytes)
    plan = Plan(frozen=("0",))
    session.run(plan)  # "hidden cells" running the same plan on the session
    session.run(plan)
    ex.set_plan(Plan(frozen=("2",)))
    ex.run_now()
    data = hist.source.data
    assert len(data["label"]) == 3  # baseline, freeze 0 (once), freeze 2
    assert data["point_label"] == ["baseline", "", data["label"][2]]  # text for baseline and current only


# -- 7. layout --------------------------------------------------------------------------------
def test_row_controls_come_before_the_numbers_and_tracks_suit_dark_themes(cnn):
    row = cnn.table.row("layers.0")
    kids = list(row.box.children)
    assert kids.index(row.freeze) < kids.index(row.info) and kids.index(row.region) < kids.index(row.info)
    assert "background:#eee" not in row.info.value and "rgba(128,128,128" in row.info.value
    assert cnn.run_button.layout.min_width == "90px" and cnn.cancel_button.layout.flex == "0 0 auto"


def test_timeline_zooms_on_one_phase(cnn):
    m = cnn.measurement
    t = m.timeline
    cnn.results.zoom.value = "backward"
    start, end = cnn.results.timeline_plot.figure.x_range.start, cnn.results.timeline_plot.figure.x_range.end
    later = sorted(v for v in t.phase_starts.values() if v > t.phase_starts["backward"])
    assert start == t.phase_starts["backward"] - 0.5 and end == later[0] + 0.5
    cnn.results.zoom.value = ""
    assert cnn.results.timeline_plot.figure.x_range.start == -0.5


# -- 8. small ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_title_names_the_class_once_and_the_loss_of_a_tuple_output():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return y, y.relu()

    seq = explore(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4), repeats=0, live=False)
    assert "Sequential: Sequential" not in seq.title.value and "Sequential" in seq.title.value
    assert "sum of the model's output" in seq.loss_note.value
    pair = explore(Pair(), torch.randn(2, 4), repeats=0, live=False)
    assert "returns a tuple" in pair.loss_note.value and "sum" in pair.loss_note.value
    custom = explore(Pair(), torch.randn(2, 4), loss=lambda o: o[0].sum(), repeats=0, live=False)
    assert custom.loss_note.value == ""


def test_presets_come_from_the_workload_no_input_only_for_token_ids(cnn):
    wl = zoo.gpt(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.0), batch_size=2)
    ex = Explorer(Session(wl, "fake", repeats=0), live=False)
    labels = [label for label, _ in ex.preset.options]
    assert not any("input" in label for label in labels)
    assert any("input" in label for label, _ in cnn.preset.options)  # images: offered


# -- engine fields that other branches add (shown when present) ----------------------------------
class _WithExtras:
    def __init__(self, m, **extra):
        self._m, self._extra = m, extra

    def __getattr__(self, name):
        return self._extra[name] if name in self._extra else getattr(self._m, name)


def test_steady_state_outputs_and_advice_are_shown_when_the_engine_reports_them(cnn):
    m = cnn.baseline
    outputs = m.saved_bytes // 5
    extra = _WithExtras(
        m,
        first_step_peak_bytes=m.peak_bytes - 4096,
        output_bytes=outputs,
        advice=("use_cache=False frees the KV cache",),
        steady_state=True,
    )
    cnn._show(SimpleNamespace(plan=Plan(), measurement=extra))
    assert f"step 1: {format_bytes(m.peak_bytes - 4096)}" in cnn.first_step.value
    assert cnn.first_step.layout.display == ""
    assert f"+ {format_bytes(outputs)} outputs and caches" == cnn.output_kept.value
    assert f"{m.saved_bytes + outputs:,} B kept in all" in cnn.output_kept.tooltip
    assert "use_cache=False" in cnn.advice.value and cnn.advice.layout.display == ""
    assert "peak of the first step" in cnn.results.table.value and "outputs and caches kept" in cnn.results.table.value
    cnn._show(cnn.session.baseline_entry)
    base = cnn.baseline
    differs = base.first_step_peak_bytes is not None and base.first_step_peak_bytes != base.peak_bytes
    assert (cnn.first_step.layout.display == "") == differs  # the engine's own steady-state step
    assert (cnn.advice.layout.display == "none") == (not base.advice)


def test_tied_parameters_are_shown_in_the_layer_table():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight  # GPT-2's lm_head / wte tie

        def forward(self, ids):
            return self.head(self.emb(ids))

    ex = explore(Tied(), torch.randint(0, 16, (2, 4)), repeats=0, live=False)
    assert "weight = head.weight" in ex.table.row("emb").details.value
    assert "weight = emb.weight" in ex.table.row("head").details.value
    assert "=" not in ex.table.tied.get("", "")
