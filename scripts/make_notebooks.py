"""Write the tutorial notebooks in notebooks/ from the cell sources below (outputs stripped).

The notebooks are authored here, as Python data, so a change to the course is a reviewable diff;
run ``python scripts/make_notebooks.py`` after editing. Each notebook ends with a cell that
asserts its key claim from measured numbers, so the notebook test catches a regression.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[1] / "notebooks"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def md(text: str):
    return new_markdown_cell(text.strip())


def code(text: str, hidden: bool = False):
    cell = new_code_cell(text.strip())
    if hidden:  # the answer to the reader's question: collapsed until they open it
        cell.metadata["jupyter"] = {"source_hidden": True, "outputs_hidden": True}
        cell.metadata["tags"] = ["answer"]
    return cell


# -- 1. What backward keeps ------------------------------------------------------------
NB01 = [
    md(r"""
# 1. What backward keeps

A training step runs the model forward, computes a loss, runs backward and lets the optimizer
update the parameters. Backward needs some of the tensors forward computed: autograd **keeps
them alive** from the moment forward makes them until backward has used them. Those are the
*saved activations*, and on most models they are the largest part of a step's memory that you
can change.

This notebook measures them, layer by layer, on a small ResNet-style CNN (8 images of 3x32x32),
explains why each kind of layer keeps what it keeps, and compares the measurement with the
estimate `torchinfo` prints. At the end you get an **explorer**: tick a box, the step is
measured again, and the numbers change.

*memsave_nb counts a tensor as "saved" when its storage was created during forward and is
still alive when forward ends; parameters and the batch itself are not counted; a storage shared
by several views counts once.*
"""),
    code(r"""
import copy

import torch
import torchinfo

from memsave_nb import zoo
from memsave_nb.plan import Plan
from memsave_nb.session import Session
from memsave_nb.ui.explorer import explore
from memsave_nb.ui.format import format_bytes, layer_table, render_table

BATCH = 8
workload = zoo.make("cnn", batch_size=BATCH)  # ResNet-style: stem, 3 stages of 2 blocks, linear head
session = Session(workload, repeats=1)        # one Session: a baseline and every plan tried against it
baseline = session.baseline                   # one measured training step, nothing changed

print(f"saved for backward: {format_bytes(baseline.saved_bytes)}")
print(f"peak of the step:   {format_bytes(baseline.peak_bytes)}")
for category, nbytes in baseline.peak_split.as_dict().items():
    print(f"  {category.replace('_', ' '):16s} {format_bytes(nbytes):>10s}")
"""),
    md(r"""
## Layer by layer

The ten layers that keep the most. A layer's *saved activations* are the storages **created in
it** that backward still needs: the output of a convolution shows up in the convolution's row
even though it is the following batch norm that keeps it.
"""),
    code(r"""
print(render_table(*layer_table(baseline, top=10)))
"""),
    md(r"""
## Why each layer keeps what it keeps

Backward of a layer needs whatever its derivative formula reads:

- **Convolution** `y = w * x`: the weight gradient needs the input `x`; the input gradient needs
  only `w` (a parameter, not counted). Stock PyTorch saves `x` whenever *anything* in the layer
  needs a gradient.
- **Batch norm** (training mode): normalises with the batch's mean and variance, so backward needs
  its input plus the per-channel mean and inverse standard deviation (small).
- **ReLU** needs only *where* its input was positive. The in-place ReLU of this CNN overwrites its
  input and keeps that one tensor (its output); nothing new is created, so its row shows 0 and
  the bytes appear under the batch norm that made the tensor.
- **Max-pool** keeps the *indices* of the maxima, as int64: 8 bytes per output element, twice its
  float32 output.

Per op (`aten.*` is what autograd really calls), summed over the whole step:
"""),
    code(r"""
for op in sorted(baseline.ops, key=lambda o: -o.saved_bytes)[:6]:
    print(f"{op.op:32s} {op.count:3d} calls {format_bytes(op.saved_bytes):>12s}")

pool = baseline.module("stem.3")
out_elems = 1
for d in pool.output_shape:
    out_elems *= d
print(f"\nmax-pool output {pool.output_shape}: {format_bytes(out_elems * 4)} float32 + "
      f"{format_bytes(out_elems * 8)} int64 indices = {format_bytes(out_elems * 12)}; "
      f"measured: {format_bytes(pool.saved_bytes)}")
"""),
    md(r"""
## torchinfo's estimate is not the truth

`torchinfo.summary` prints a "Forward/backward pass size": twice the outputs of the layers that
have parameters. It does not run backward, so it cannot know what autograd keeps: it ignores
parameter-free ops (max-pool indices, additions), in-place ops, freezing and checkpointing.
Below: its estimate for the model as it is and with the stem frozen, against the measurement.
(torchinfo runs a forward pass that updates batch-norm statistics, so it gets a copy.)
"""),
    code(r"""
shape = tuple(workload.batch.shape)
estimate = torchinfo.summary(copy.deepcopy(workload.model), input_size=shape, verbose=0).total_output_bytes

frozen_copy = copy.deepcopy(workload.model)
frozen_copy.stem.requires_grad_(False)
estimate_frozen = torchinfo.summary(frozen_copy, input_size=shape, verbose=0).total_output_bytes
measured_frozen = session.run(Plan(name="freeze stem", frozen=("stem",))).measurement.saved_bytes

print(f"{'':22s}{'torchinfo':>12s}{'measured':>12s}")
print(f"{'all trainable':22s}{format_bytes(estimate):>12s}{format_bytes(baseline.saved_bytes):>12s}")
print(f"{'stem frozen':22s}{format_bytes(estimate_frozen):>12s}{format_bytes(measured_frozen):>12s}")
"""),
    md(r"""
## Your turn: the explorer

Each row of the **Layers** tab has a *freeze* box (its parameters stop requiring gradients), a
*memsave* switch (memory-saving layers, notebook 2) and a *checkpoint* menu (notebook 3).
Every change measures the step again; the header shows the new saved total and the change
against the baseline. The **Results** tab has the peak's split and a timeline of the step.

**Question.** Freeze the `stem` (tick its box) and note the saved total. Untick it and freeze
`layers.0` (the first stage) instead. Which saves more? Why does the other one save almost
nothing with stock PyTorch layers?
"""),
    code(r"""
explorer = explore(session)
explorer
"""),
    md("**Answer** (open the hidden cell below)."),
    code(r"""
stem = session.run(Plan(name="freeze stem", frozen=("stem",))).measurement
stage = session.run(Plan(name="freeze layers.0", frozen=("layers.0",))).measurement
print(f"baseline          {format_bytes(baseline.saved_bytes)}")
print(f"freeze stem       {format_bytes(stem.saved_bytes)} ({stem.saved_bytes / baseline.saved_bytes:.0%})")
print(f"freeze layers.0   {format_bytes(stage.saved_bytes)} ({stage.saved_bytes / baseline.saved_bytes:.0%})")
print('''
Freezing the stem saves the most. Nothing before the stem needs a gradient (the images do not),
so once its own parameters are frozen autograd records nothing there: no input kept for a weight
gradient, no batch-norm input, no max-pool indices.
Freezing layers.0 saves (almost) nothing: the stem before it still trains, so the gradient must
flow back through layers.0, and stock convolution and batch norm keep their inputs whenever
anything in them needs a gradient -- even though, with frozen weights, those inputs are only ever
needed for the weight gradient that is no longer computed. Notebook 2 fixes exactly that.''')
""", hidden=True),
    md(r"""
## What this notebook claims

Checked from the numbers measured above, so a change in the engine that would teach a wrong
figure fails here.
"""),
    code(r"""
stem_frozen = session.run(Plan(frozen=("stem",))).measurement
stage_frozen = session.run(Plan(frozen=("layers.0",))).measurement

# max-pool keeps int64 indices: 8 bytes per output element beside its 4-byte float output
assert pool.saved_bytes == out_elems * (4 + 8), (pool.saved_bytes, out_elems)
# freezing the stem drops over a quarter of what backward keeps ...
assert stem_frozen.saved_bytes < 0.75 * baseline.saved_bytes
# ... freezing the first stage drops less than 1% with stock layers (gradients still flow through it)
assert stage_frozen.saved_bytes > 0.99 * baseline.saved_bytes
# torchinfo's estimate is off by more than 30% and does not see freezing
assert abs(estimate - baseline.saved_bytes) > 0.3 * baseline.saved_bytes
assert estimate_frozen == estimate and measured_frozen < baseline.saved_bytes
print("all claims hold")
"""),
]


NOTEBOOKS: dict[str, list] = {
    "01-what-backward-keeps.ipynb": NB01,
}


def build(name: str, cells: list) -> nbformat.NotebookNode:
    nb = new_notebook(cells=copy.deepcopy(cells))
    for i, cell in enumerate(nb.cells):  # stable ids: regenerating gives the same file
        cell["id"] = f"cell-{i:02d}"
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.validate(nb)
    return nb


def main(argv: list[str]) -> int:
    """Write every notebook (or only those named); ``--check`` fails when one differs on disk."""
    check = "--check" in argv
    wanted = [a for a in argv if not a.startswith("-")]
    ROOT.mkdir(exist_ok=True)
    stale = []
    for name, cells in NOTEBOOKS.items():
        if wanted and not any(w in name for w in wanted):
            continue
        text = nbformat.writes(build(name, cells)) + "\n"
        path = ROOT / name
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
            continue
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT.parent)}")
    if stale:
        print("out of date (run python scripts/make_notebooks.py): " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
