"""The standalone HTML report: written, offline (BokehJS inline), holding the layers and figures."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest

from memsave_nb import measure, zoo
from memsave_nb.report import write_report
from memsave_nb.ui.format import format_bytes

EXTERNAL = re.compile(r"<(?:script|link)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//", re.IGNORECASE)


@pytest.fixture(scope="module")
def mlp():
    return measure(zoo.make("mlp", 32), mode="fake")


def _assert_offline(text: str) -> None:
    assert not EXTERNAL.search(text), "the report loads something over the network"
    assert "cdn.bokeh.org" not in text
    assert "Bokeh.embed.embed_items" in text  # BokehJS and the documents are inline


def test_report_of_a_measurement(tmp_path, mlp):
    path = write_report(mlp, tmp_path / "report.html", title="MLP <fake>")
    text = path.read_text(encoding="utf-8")
    _assert_offline(text)
    assert "<title>MLP &lt;fake&gt;</title>" in text
    for r in mlp.modules[1:]:
        assert f"{r.name} ({r.type_name})" in text  # bar labels in the embedded document
    assert "<td>ReLU</td>" in text  # the per-layer table
    for name in ("peak_split_figure", "layer_bars_figure", "timeline_figure"):
        assert name in text
    assert format_bytes(mlp.peak_bytes) in text
    assert "history_figure" not in text  # a single measurement has no plans


def test_report_of_a_session_like_object(tmp_path, mlp):
    slower = dataclasses.replace(mlp, step_seconds=0.02, peak_bytes=mlp.peak_bytes - 1024)
    plan = SimpleNamespace(
        name="freeze first", compile_budget=None, to_code=lambda loop="loss_only": "model[0].requires_grad_(False)"
    )
    session = SimpleNamespace(
        baseline=dataclasses.replace(mlp, step_seconds=0.01), history=[SimpleNamespace(plan=plan, measurement=slower)]
    )
    text = write_report(session, tmp_path / "s.html").read_text(encoding="utf-8")
    _assert_offline(text)
    assert "history_figure" in text and "freeze first" in text
    assert "model[0].requires_grad_(False)" in text
    assert "-1.0 KiB" in text  # peak vs baseline
    assert "budget_sweep_figure" not in text


def test_report_of_a_real_session(tmp_path):
    session_mod = pytest.importorskip("memsave_nb.session")
    plan_mod = pytest.importorskip("memsave_nb.plan")
    session = session_mod.Session(zoo.make("mlp", 16), mode="fake")
    empty = write_report(session, tmp_path / "baseline.html").read_text(encoding="utf-8")
    _assert_offline(empty)
    assert "timeline_figure" in empty
    session.run(plan_mod.Plan(name="freeze 0", frozen=("0",)))
    text = write_report(session, tmp_path / "session.html").read_text(encoding="utf-8")
    assert "freeze 0" in text and "history_figure" in text


def test_report_rejects_other_objects(tmp_path):
    with pytest.raises(TypeError):
        write_report(object(), tmp_path / "x.html")


def test_report_bars_show_the_largest_layers_of_a_big_model(tmp_path, mlp):
    leaf = next(r for r in mlp.modules if r.is_leaf)
    many = tuple(dataclasses.replace(leaf, name=f"layer{i}", saved_bytes=1000 + i) for i in range(60))
    big = dataclasses.replace(mlp, modules=(mlp.modules[0], *many))
    text = write_report(big, tmp_path / "big.html").read_text(encoding="utf-8")
    assert "the 40 largest of 60 layers" in text
    assert ">layer0</td>" in text and ">layer59</td>" in text  # the table keeps every layer


def test_report_shows_first_step_beside_steady_state_and_outputs():
    from memsave_nb.report import render_report

    wl = zoo.make("cnn", 2)
    steady = measure(wl, mode="fake", first_step_peak=True)
    first = measure(wl, mode="fake", steady_state=False)
    text = render_report(steady)
    assert steady.first_step_peak_bytes < steady.peak_bytes
    assert "steady state: training&#x27;s step 2 on" in text
    assert f"<span>first-step peak</span><b>{format_bytes(steady.first_step_peak_bytes)}</b>" in text
    assert f"<span>outputs kept</span><b>{format_bytes(steady.output_bytes)}</b>" in text
    text_first = render_report(first)
    assert "first training step" in text_first and "first-step peak" not in text_first
    advised = dataclasses.replace(steady, advice=("use_cache=False frees the KV cache <1 MiB>",))
    assert '<p class="advice">use_cache=False frees the KV cache &lt;1 MiB&gt;</p>' in render_report(advised)
