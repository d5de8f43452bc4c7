"""The magics through IPython's own InteractiveShell: load, open, measure a cell, report, unload."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from memsave_nb import Workload, measure
from memsave_nb.magics import MemsaveMagics
from memsave_nb.measure import Measurement
from memsave_nb.ui.explorer import Explorer

pytestmark = pytest.mark.timeout(300)

SETUP = """
import torch
import torch.nn.functional as F
from memsave_nb import zoo
torch.manual_seed(0)
model = zoo.mlp((64, 128, 128, 10))
x = torch.randn(16, 64)
y = torch.randint(0, 10, (16,))
opt = torch.optim.AdamW(model.parameters())
"""

STEP = """\
out = model(x)
loss = F.cross_entropy(out, y)
loss.backward()
opt.step()
opt.zero_grad()
"""


@pytest.fixture()
def ip():
    shell = InteractiveShell.instance()
    shell.run_cell(SETUP)
    shell.run_line_magic("load_ext", "memsave_nb")
    yield shell
    shell.run_line_magic("unload_ext", "memsave_nb")


def test_load_registers_and_unload_removes_the_magics():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "memsave_nb")
    magics = shell.magics_manager.magics
    assert {"memsave", "memsave_report"} <= set(magics["line"]) and "memsave" in magics["cell"]
    shell.run_line_magic("unload_ext", "memsave_nb")
    assert "memsave" not in magics["line"] and "memsave_report" not in magics["line"]
    assert "memsave" not in magics["cell"]
    shell.run_line_magic("load_ext", "memsave_nb")  # and again
    assert "memsave" in shell.magics_manager.magics["line"]
    shell.run_line_magic("unload_ext", "memsave_nb")


def test_cell_magic_measures_the_step_the_cell_runs(ip, capsys):
    m = ip.run_cell_magic("memsave", "-r", STEP)
    assert isinstance(m, Measurement)
    printed = capsys.readouterr().out
    assert "peak memory:" in printed and "saved activations:" in printed
    assert "outputs kept to the end of forward: 644 B (output 640 B, loss 4 B)" in printed
    # the same step driven by the engine gives the same bytes
    ns = ip.user_ns
    # (the cell keeps `out` to its end: the loop that keeps the output through the step)
    ref = measure(
        Workload(ns["model"], ns["x"], loss=lambda o: F.cross_entropy(o, ns["y"]), loop="keep_output_step"), repeats=0
    )
    # what the step keeps at the end of forward, split as the engine splits it: saved for backward,
    # and the outputs (the logits, 16 x 10 float32, and the loss) that autograd did not save
    assert (m.saved_bytes, m.output_bytes) == (ref.saved_bytes, ref.output_bytes)
    assert m.output_bytes == 16 * 10 * 4 + 4 and dict(m.output_parts) == {"output": 16 * 10 * 4, "loss": 4}
    assert m.peak_bytes == ref.peak_bytes
    assert m.peak_split == ref.peak_split  # (its end of forward has the steady state's optimizer state too)
    assert m.module("1").saved_bytes == ref.module("1").saved_bytes
    assert m.peak_phase == "optimizer" and m.peak_split.optimizer_state > 0
    # the cell really ran: its names are in the namespace, the optimizer stepped once
    assert "loss" in ns and len(ns["opt"].state) == len(list(ns["model"].parameters()))


def test_cell_magic_without_r_returns_nothing_and_takes_a_model(ip, capsys):
    assert ip.run_cell_magic("memsave", "-m model", STEP) is None
    assert "saved activations" in capsys.readouterr().out
    with pytest.raises(UsageError, match="not a torch.nn.Module"):
        ip.run_cell_magic("memsave", "-m x", STEP)


def test_line_magic_opens_the_explorer_on_notebook_objects(ip):
    ex = ip.run_line_magic("memsave", "model x --loss 'F.cross_entropy(out, y)' --optimizer sgd")
    assert isinstance(ex, Explorer)
    ns = ip.user_ns
    ref = measure(
        Workload(ns["model"], ns["x"], loss=lambda o: F.cross_entropy(o, ns["y"]), optimizer="sgd"), repeats=0
    )
    assert ex.baseline.saved_bytes == ref.saved_bytes
    assert ex.baseline.peak_bytes == ref.peak_bytes
    # a loss given as a function works too; --fake measures with fake tensors
    ip.run_cell("def my_loss(out):\n    return out.pow(2).mean()")
    ex2 = ip.run_line_magic("memsave", "model x --loss my_loss --fake --optimizer none")
    assert ex2.session.mode == "fake" and ex2.baseline.step_seconds is None
    assert ex2.baseline.peak_split.optimizer_state == 0


@pytest.mark.parametrize(
    "line, message",
    [
        ("nomodel x", "nomodel"),
        ("model", "required"),
        ("x x", "not a torch.nn.Module"),
        ("model x --optimizer rmsprop", "--optimizer"),
        ("model x --loss 3", "not a function"),
        ("model x --loss 'out +'", "not a Python expression"),
        ("model x --bogus", "unrecognized"),
    ],
)
def test_line_magic_mistakes_are_one_line_usage_errors(ip, line, message):
    with pytest.raises(UsageError, match=message) as info:
        ip.run_line_magic("memsave", line)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_asking_for_cuda_without_one_is_a_usage_error(ip):
    with pytest.raises(UsageError, match="not available"):
        ip.run_line_magic("memsave", "model x --device cuda")


def test_report_writes_the_html_of_the_explorers_session(ip, tmp_path):
    magics = ip.magics_manager.registry["MemsaveMagics"]
    assert isinstance(magics, MemsaveMagics)
    import memsave_nb.ui.explorer as explorer_module

    explorer_module._last_explorer = None
    with pytest.raises(UsageError, match="nothing to report"):
        magics.session = magics.last_measurement = None
        ip.run_line_magic("memsave_report", str(tmp_path / "r.html"))
    ex = ip.run_line_magic("memsave", "model x --static")
    ex.table.row("0").freeze.value = True
    ex.run_now()
    path = tmp_path / "report.html"
    ip.run_line_magic("memsave_report", str(path))
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>") and "cdn.bokeh.org" not in text
    assert "freeze 0" in text  # the plan tried is in it
    with pytest.raises(UsageError, match="html"):
        ip.run_line_magic("memsave_report", str(tmp_path / "r.txt"))


def test_a_failing_cell_is_one_line_and_leaves_torch_as_it_was(ip, capsys):
    backward, grad = torch.autograd.backward, torch.autograd.grad
    result = ip.run_cell("%%memsave\nout = model(x)\nraise ValueError('my cell failed')\n")
    err = result.error_in_exec
    assert isinstance(err, UsageError) and "\n" not in str(err)
    assert str(err).startswith("line 2 of the cell (raise ValueError('my cell failed')): ValueError: my cell failed")
    assert "Traceback" not in capsys.readouterr().err
    # -t: the user's own exception, traceback and all
    result = ip.run_cell("%%memsave -t\nout = model(x)\nraise ValueError('my cell failed')\n")
    assert isinstance(result.error_in_exec, ValueError) and "my cell failed" in str(result.error_in_exec)
    assert torch.autograd.backward is backward and torch.autograd.grad is grad
    # and the next measured cell works
    assert ip.run_cell_magic("memsave", "-r -q", STEP).saved_bytes > 0


def test_quoted_expressions_with_spaces(ip):
    ip.run_cell(
        "bil = torch.nn.Bilinear(4, 4, 2)\na = torch.randn(3, 4)\nb = torch.randn(3, 4)\nt = torch.randint(0, 2, (3,))"
    )
    ex = ip.run_line_magic("memsave", """bil "(a, b)" --loss "F.cross_entropy(out, t)" --static""")
    ns = ip.user_ns
    ref = measure(Workload(ns["bil"], (ns["a"], ns["b"]), loss=lambda o: F.cross_entropy(o, ns["t"])), repeats=0)
    assert ex.baseline.saved_bytes == ref.saved_bytes


def test_a_cell_without_modules(ip):
    cell = (
        "w = torch.randn(100, 100, requires_grad=True)\n"
        "xx = torch.randn(64, 100)\n"
        "l2 = (xx @ w).relu().sum()\n"
        "l2.backward()\n"
    )
    ip.run_cell("for _k in ('model', 'opt'): globals().pop(_k, None)")
    m = ip.run_cell_magic("memsave", "-r -q", cell)
    # relu keeps its output (64 x 100 float32); the loss scalar is the step's output; the data the
    # cell made are inputs (xx) and parameters (w), w.grad a gradient
    assert m.saved_bytes == 64 * 100 * 4
    assert m.output_bytes == 4 and m.output_parts == (("loss", 4),)
    assert m.peak_split.inputs >= 64 * 100 * 4
    assert m.peak_split.parameters >= 100 * 100 * 4  # w, and any module left in the namespace
    assert m.peak_split.gradients == 100 * 100 * 4


def test_report_of_an_explorer_opened_without_the_magic(ip, tmp_path):
    from memsave_nb.ui.explorer import explore

    magics = ip.magics_manager.registry["MemsaveMagics"]
    magics.session = None
    ns = ip.user_ns
    ex = explore(ns["model"], ns["x"], live=False, repeats=0)
    ex.table.row("2").freeze.value = True
    ex.run_now()
    ip.run_line_magic("memsave_report", str(tmp_path / "mine.html"))
    assert "freeze 2" in (tmp_path / "mine.html").read_text()


def test_a_shape_bug_names_the_line_and_the_module(ip):
    """The 115-line traceback of a shape bug becomes: which line, which module, what."""
    ip.run_cell("bad = torch.randn(16, 63)")
    result = ip.run_cell("%%memsave -m model\ny0 = 1\nout = model(bad)\nout.sum().backward()\n")
    msg = str(result.error_in_exec)
    assert isinstance(result.error_in_exec, UsageError) and "\n" not in msg
    assert msg.startswith("line 2 of the cell (out = model(bad)), in module 0 (Linear): RuntimeError: ")
    assert "%%memsave -t" in msg


@pytest.mark.parametrize(
    "line",
    [
        "model torch.randn(16, 64)",  # spaces in the batch, no quotes
        "--optimizer sgd model torch.randn(16, 64)",  # options first
        "model torch.randn(16, 64) -- --optimizer sgd",  # options after --
        "model torch.randn(16, 64) --optimizer sgd",  # known options after the batch
    ],
)
def test_everything_after_the_model_is_the_batch(ip, line):
    ex = ip.run_line_magic("memsave", line + " --static" if "--" in line else line + " -- --static")
    assert isinstance(ex, Explorer)
    assert tuple(ex.session.workload.make_batch().shape) == (16, 64)
    opt = ex.session.workload.optimizer
    assert opt == ("sgd" if "sgd" in line else "adamw")
    ref = measure(Workload(ip.user_ns["model"], torch.zeros(16, 64), optimizer=opt), repeats=0)
    assert ex.baseline.saved_bytes == ref.saved_bytes


def test_a_failing_loss_is_said_to_fail_in_the_loss(ip):
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("memsave", "model x --loss 'F.cross_entropy(out, y[:3])' --static")
    msg = str(info.value)
    assert "in the loss" in msg and "during forward" not in msg and "\n" not in msg


def test_report_without_a_path_writes_the_default_file_and_says_where(ip, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ip.run_line_magic("memsave", "model x --static")
    ip.run_line_magic("memsave_report", "")
    out = capsys.readouterr().out
    path = tmp_path / "memsave_report.html"
    assert path.read_text().startswith("<!DOCTYPE html>")
    assert str(path) in out


HF_SETUP = """
import transformers
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16))
ids = torch.randint(0, 50, (2, 12))
"""

HF_STEP = """\
out = gpt(input_ids=ids, labels=ids)
out.loss.backward()
"""


def _hooks_count(model, kwargs):
    """Independent of the tracker: unique storages a saved_tensors_hooks pack hook sees in one forward
    (parameters, buffers and inputs excluded), and the output's storages (logits, KV cache, loss)
    that autograd did not save."""
    from memsave_nb.workload import iter_output_tensors

    pre = {id(t.untyped_storage()) for t in [*model.parameters(), *model.buffers(), *kwargs.values()]}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if id(st) not in pre:
            saved[id(st)] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = model(**kwargs)
    outputs = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in iter_output_tensors(output)}
    outputs = {k: v for k, v in outputs.items() if k not in saved and k not in pre}
    return sum(saved.values()), sum(outputs.values())


def test_cell_magic_splits_outputs_from_saved_on_a_hugging_face_model(ip):
    pytest.importorskip("transformers")
    ip.run_cell(HF_SETUP)
    ns = ip.user_ns
    m = ip.run_cell_magic("memsave", "-r -q -m gpt", HF_STEP)
    saved, outputs = _hooks_count(ns["gpt"], {"input_ids": ns["ids"], "labels": ns["ids"]})
    assert m.saved_bytes == saved > 0
    assert m.output_bytes == outputs
    parts = dict(m.output_parts)
    assert parts["logits"] == 2 * 12 * 50 * 4  # returned, never saved: cross-entropy keeps its log-softmax
    assert parts["loss"] == 4
    assert sum(parts.values()) == m.output_bytes > parts["logits"] + 4  # and the KV cache
    assert m.end_of_forward.activations == m.saved_bytes and m.end_of_forward.outputs == m.output_bytes
    assert any("use_cache=False" in a for a in m.advice)
    # the engine, driving the same step, splits it the same way
    ref = measure(
        Workload(ns["gpt"], {"input_ids": ns["ids"], "labels": ns["ids"]}, optimizer=None),
        repeats=0,
        steady_state=False,
    )
    assert (ref.saved_bytes, ref.output_bytes, ref.output_parts) == (m.saved_bytes, m.output_bytes, m.output_parts)
