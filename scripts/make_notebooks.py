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


ANSWER_FOOTER = r"""
from IPython.display import HTML, display
import html
display(HTML("<details><summary><b>Show the answer</b></summary><pre style='white-space:pre-wrap'>"
             + html.escape("\n".join(out)) + "</pre></details>"))
"""


def answer(text: str):
    """The answer to a notebook's question: a collapsed cell that appends lines to ``out`` and
    shows them folded in a <details> element (Lab expands a hidden cell's outputs when it runs;
    the fold keeps the answer closed in Lab, Voila and a static render alike)."""
    return code("out = []  # the answer, shown folded\n" + text.strip() + "\n" + ANSWER_FOOTER.strip(), hidden=True)


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
    md("**Answer**, folded: click *Show the answer* below (in JupyterLab, run the collapsed cell under this one first; as an app it is already there)."),
    answer(r"""
stem = session.run(Plan(name="freeze stem", frozen=("stem",))).measurement
stage = session.run(Plan(name="freeze layers.0", frozen=("layers.0",))).measurement
out.append(f"baseline          {format_bytes(baseline.saved_bytes)}")
out.append(f"freeze stem       {format_bytes(stem.saved_bytes)} ({stem.saved_bytes / baseline.saved_bytes:.0%})")
out.append(f"freeze layers.0   {format_bytes(stage.saved_bytes)} ({stage.saved_bytes / baseline.saved_bytes:.0%})")
out.append('''
Freezing the stem saves the most. Nothing before the stem needs a gradient (the images do not),
so once its own parameters are frozen autograd records nothing there: no input kept for a weight
gradient, no batch-norm input, no max-pool indices.
Freezing layers.0 saves (almost) nothing: the stem before it still trains, so the gradient must
flow back through layers.0, and stock convolution and batch norm keep their inputs whenever
anything in them needs a gradient -- even though, with frozen weights, those inputs are only ever
needed for the weight gradient that is no longer computed. Notebook 2 fixes exactly that.''')
"""),
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


# -- 2. Freezing and selective differentiation ----------------------------------------
NB02 = [
    md(r"""
# 2. Freezing and selective differentiation

Fine-tuning often trains only part of a network: the last layers, the normalisation layers, or
nothing but the input (adversarial examples, saliency maps). Freezing removes the gradients of
frozen weights, so you would expect the activations kept *for* those gradients to go too.

With stock PyTorch layers they mostly do not. A convolution or batch norm needs its input only
for its *weight* gradient, yet stock PyTorch keeps it whenever anything in the layer needs a
gradient. Bhatia & Dangel, *Lowering PyTorch's Memory Consumption for Selective
Differentiation* (2024), replace those layers with drop-ins that decide at forward time what
backward will need. memsave_nb ships such layers (`memsave_nb.layers`); a plan switches them on
with `memsave=("*",)`.

This notebook reproduces the paper's cases on the demo CNN (8 images of 3x32x32), with stock and
memory-saving layers, as a table and a plot.
"""),
    code(r"""
import pandas as pd
from bokeh.io import show
from bokeh.models import ColumnDataSource, FactorRange, HoverTool
from bokeh.plotting import figure

from memsave_nb import presets, zoo
from memsave_nb.session import Session
from memsave_nb.ui.explorer import explore
from memsave_nb.ui.format import format_bytes
from memsave_nb.ui.plots import load_bokehjs

load_bokehjs()  # BokehJS from the installed package, once per kernel: works offline

workload = zoo.make("cnn", batch_size=8)
model = workload.model
session = Session(workload, repeats=1)
baseline = session.baseline  # stock layers, everything trainable
print(f"stock, all trainable: {format_bytes(baseline.saved_bytes)} kept for backward")
"""),
    md(r"""
## The cases

As in the paper: everything trainable; only the input needs a gradient (all weights frozen);
the same with batch norm in eval mode (running statistics); only the normalisation layers
train; "surgical" fine-tuning of the first or the last quarter of the layers (the last quarter
with the input requiring a gradient, as there). Each runs once with stock layers and once with
the memory-saving ones. The last column is the reference implementation's ratio for ResNet-18,
measured the same way on this CPU (memory-saving / stock, same case).
"""),
    code(r"""
CASES = {
    "all trainable": presets.all_trainable(model),
    "input only": presets.input_only(model),
    "input only, BN eval": presets.input_only(model, bn_eval=True),
    "norm layers only": presets.norm_only(model),
    "first quarter": presets.first_quarter(model),
    "last quarter + input": presets.last_quarter(model, input_requires_grad=True),
}
REFERENCE = {"all trainable": 0.954, "input only": 0.642, "input only, BN eval": 0.182,
             "norm layers only": 0.642, "first quarter": 0.828, "last quarter + input": 0.665}

saved = {}  # (case, layers) -> saved bytes
peak = {}
for case, plan in CASES.items():
    for layers, p in (("stock", plan), ("memsave", plan.replace(memsave=("*",)))):
        m = session.run(p.replace(name=f"{case} ({layers})")).measurement
        saved[case, layers], peak[case, layers] = m.saved_bytes, m.peak_bytes

base = saved["all trainable", "stock"]
table = pd.DataFrame(
    [
        {
            "case": case,
            "stock": format_bytes(saved[case, "stock"]),
            "memsave": format_bytes(saved[case, "memsave"]),
            "stock / all": round(saved[case, "stock"] / base, 3),
            "memsave / all": round(saved[case, "memsave"] / base, 3),
            "memsave / stock": round(saved[case, "memsave"] / saved[case, "stock"], 3),
            "reference (ResNet-18)": REFERENCE[case],
            "peak stock": format_bytes(peak[case, "stock"]),
            "peak memsave": format_bytes(peak[case, "memsave"]),
        }
        for case in CASES
    ]
).set_index("case")
table
"""),
    code(r"""
factors = [(case, layers) for case in CASES for layers in ("stock", "memsave")]
source = ColumnDataSource(dict(
    x=factors,
    mib=[saved[f] / 2**20 for f in factors],
    label=[format_bytes(saved[f]) for f in factors],
    color=["#9e9e9e" if layers == "stock" else "#54a24b" for _, layers in factors],
))
fig = figure(x_range=FactorRange(*factors), height=320, width=820, toolbar_location=None,
             title="Saved activations per case: stock vs memory-saving layers", y_axis_label="MiB")
fig.vbar(x="x", top="mib", width=0.85, color="color", source=source)
fig.add_tools(HoverTool(tooltips=[("", "@x"), ("kept", "@label")]))
fig.xaxis.major_label_orientation = 0.9
fig.xgrid.grid_line_color = None
fig.y_range.start = 0
show(fig)
"""),
    md(r"""
What the table says:

- **Stock layers gain almost nothing from freezing** here: every case keeps about what "all
  trainable" keeps, because the input (or an early layer) still needs a gradient, so every
  convolution and batch norm on the way keeps its input.
- **Memory-saving layers** keep a convolution's input only when its weight trains, a ReLU's
  1-bit mask instead of its float output, and a batch norm's input only when batch statistics
  or its weight need it. With batch norm in eval mode and all weights frozen almost nothing is
  left: a few per-channel statistics, the bit masks and the pool indices.
- Unlike the reference layers (1.09x on ResNet-101), these **never keep more than stock**, even
  when everything trains. Saved activations are not the whole peak, though: compare the peak
  columns (the memory-saving layers rebuild masks and inputs in backward, which costs
  temporaries; where nothing is frozen the peak can end up higher).
"""),
    md(r"""
## Your turn

**Question.** In the explorer, pick the preset *input only* from the plan preset menu, then tick
*memsave* on the model's row (the first row). Now tick *batch norm in eval mode*. Roughly how
much does eval mode cut, and why does batch norm in training mode need its input even when its
weight and bias are frozen?
"""),
    code(r"""
explorer = explore(session)
explorer
"""),
    md("**Answer**, folded: click *Show the answer* below (in JupyterLab, run the collapsed cell under this one first; as an app it is already there)."),
    answer(r"""
train_bn = saved["input only", "memsave"]
eval_bn = saved["input only, BN eval", "memsave"]
out.append(f"input only, memsave layers: {format_bytes(train_bn)}; with BN eval: {format_bytes(eval_bn)} "
      f"({eval_bn / train_bn:.0%} of it)")
out.append('''
In training mode batch norm normalises with the batch's own mean and variance, which depend on
every input; the gradient with respect to the input runs through them, so it needs the
(normalised) input whatever the weight does. In eval mode the statistics are constants: batch
norm is a fixed per-channel affine map whose input gradient needs only the weight and the running
variance. Then a frozen network keeps almost nothing: per-channel statistics, ReLU bit masks and
the max-pool indices.''')
"""),
    md("## What this notebook claims"),
    code(r"""
def ratio(case, layers):
    return saved[case, layers] / base

# the paper's headline: input only with BN eval keeps less than a fifth of all-trainable ...
assert ratio("input only, BN eval", "memsave") < 0.2, ratio("input only, BN eval", "memsave")
# ... while stock layers keep nearly everything in that case
assert ratio("input only, BN eval", "stock") > 0.95, ratio("input only, BN eval", "stock")
# memory-saving layers cut every frozen case by at least a quarter against stock ...
for case in ("input only", "norm layers only", "first quarter", "last quarter + input"):
    assert saved[case, "memsave"] < 0.75 * saved[case, "stock"], case
# ... and never keep more than stock when everything trains
assert saved["all trainable", "memsave"] <= saved["all trainable", "stock"]
print("all claims hold")
"""),
]


# -- 3. Activation checkpointing and SAC ----------------------------------------------
NB03 = [
    md(r"""
# 3. Activation checkpointing and selective checkpointing (SAC)

**Activation checkpointing (AC)** marks a *region* (here: a transformer block) whose forward
keeps nothing but its inputs; backward runs the region's forward again to get what it needs.
Less memory, more compute:
`torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`.

**Selective activation checkpointing (SAC)** decides per op inside the region: a
`policy_fn(ctx, op, *args, **kwargs)` returns `CheckpointPolicy.MUST_SAVE` (keep this op's
output) or `PREFER_RECOMPUTE`, passed as
`context_fn=functools.partial(create_selective_checkpoint_contexts, policy_fn)`. The usual
choice: keep the expensive matmuls, recompute the cheap pointwise ops.

The workload: a small GPT-style decoder (2 blocks, width 64, 4 sequences of 64 tokens).
"""),
    code(r"""
import contextlib
import functools

import pandas as pd
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memsave_nb import measure, zoo
from memsave_nb.checkpointing import POLICY_PRESETS, OpChoice, RegionKind, RegionPolicy, suggest_regions
from memsave_nb.plan import Plan
from memsave_nb.session import Session
from memsave_nb.ui.explorer import explore
from memsave_nb.ui.format import format_bytes, format_seconds

config = zoo.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64, dropout=0.0)
workload = zoo.gpt(config, batch_size=4)
model = workload.model
session = Session(workload, repeats=2)
baseline = session.baseline
blocks = suggest_regions(model)  # the repeated blocks: ['blocks.0', 'blocks.1']
print("regions:", blocks, "| eager keeps", format_bytes(baseline.saved_bytes))
"""),
    md(r"""
## Regions and the policy presets

A plan's `regions` maps module names to a `RegionPolicy`: `full()`, or selective with per-op
choices. The presets: `full`, `save_matmuls` (keep `mm`/`addmm`/`bmm` outputs),
`save_compute_intensive` (matmuls, convolutions, attention), `recompute_all` (selective, but
every op recomputed).
"""),
    code(r"""
rows, results = [], {}
for name, policy in POLICY_PRESETS.items():
    m = session.run(Plan(name=name, regions={b: policy for b in blocks})).measurement
    results[name] = m
    rows.append({"policy": name, "saved": format_bytes(m.saved_bytes),
                 "saved / eager": round(m.saved_bytes / baseline.saved_bytes, 3),
                 "peak": format_bytes(m.peak_bytes), "step": format_seconds(m.step_seconds)})
pd.DataFrame(rows).set_index("policy")
"""),
    md(r"""
What eager keeps, by op (summed over the step): the matmul outputs (`addmm`) are the inputs of
the next layer, GELU keeps its input, layer norm its input and statistics.
"""),
    code(r"""
for op in sorted(baseline.ops, key=lambda o: -o.saved_bytes)[:7]:
    print(f"{op.op:50s} {op.count:3d} calls {format_bytes(op.saved_bytes):>12s}")
"""),
    md(r"""
## Pitfall 1: a policy receives an `OpOverload`

A policy is called with `op = torch.ops.aten.addmm.default`, an *overload*. Comparing it with
the *packet* `torch.ops.aten.addmm` is always False, so the policy below silently recomputes
everything: it is full checkpointing under another name. Compare `op.overloadpacket`.
Both are written here by hand, exactly as in a training script, and measured with `measure()`.
"""),
    code(r"""
MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm}  # overload packets


def wrong_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def right_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def blocks_under(policy_fn):
    # every block's forward checkpointed with this SAC policy; put back afterwards
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, context_fn=context_fn)
    try:
        yield
    finally:
        for block in model.blocks:
            del block.forward  # the instance attribute; the class's forward shows again


with blocks_under(wrong_policy):
    wrong = measure(workload, repeats=1)
with blocks_under(right_policy):
    right = measure(workload, repeats=1)
print(f"op in MATMULS (wrong):               {format_bytes(wrong.saved_bytes)}")
print(f"op.overloadpacket in MATMULS (right): {format_bytes(right.saved_bytes)}")
print(f"full checkpointing:                   {format_bytes(results['full'].saved_bytes)}")
"""),
    md(r"""
## Pitfall 2: SAC can keep *more* than no checkpointing

A policy that saves every op's output keeps tensors eager autograd would have freed: the output
of a projection that only feeds an addition, say, which backward never reads. Selective is not
automatically smaller.
"""),
    code(r"""
save_all = RegionPolicy(RegionKind.SELECTIVE, {}, OpChoice.SAVE)  # selective, default "save"
greedy = session.run(Plan(name="save everything", regions={b: save_all for b in blocks})).measurement
print(f"eager:                    {format_bytes(baseline.saved_bytes)}")
print(f"SAC saving every op:      {format_bytes(greedy.saved_bytes)} "
      f"({greedy.saved_bytes / baseline.saved_bytes:.2f}x eager)")
"""),
    md(r"""
## Your turn

In the explorer, each row's *checkpoint* menu makes that module a region. Selecting a row shows
its ops in the **SAC per op** tab (count, bytes kept, FLOPs, save or recompute).

**Question.** Put both blocks under *full checkpoint*, then under *recompute all*. Why are the
saved totals identical? Then try *save matmuls*: what does keeping the matmul outputs cost in
memory against full checkpointing, and what does it buy?
"""),
    code(r"""
explorer = explore(session)
explorer
"""),
    md("**Answer**, folded: click *Show the answer* below (in JupyterLab, run the collapsed cell under this one first; as an app it is already there)."),
    answer(r"""
full, rec, mm = (results[k] for k in ("full", "recompute_all", "save_matmuls"))
out.append(f"full {format_bytes(full.saved_bytes)}, recompute all {format_bytes(rec.saved_bytes)}, "
      f"save matmuls {format_bytes(mm.saved_bytes)}, eager {format_bytes(baseline.saved_bytes)}")
out.append('''
A selective region that recomputes every op keeps exactly what full checkpointing keeps: the
region's inputs. "save matmuls" also keeps each matmul's output, so backward does not have to
run the matmuls again (the expensive part of the recomputation) and only redoes the cheap
pointwise ops; it costs the bytes of those outputs. On this tiny model on a CPU the step times
are too close to call; on a GPU-sized model the recomputed matmuls are most of AC's overhead.''')
"""),
    md("## What this notebook claims"),
    code(r"""
eager, full = baseline.saved_bytes, results["full"].saved_bytes
# full AC of both blocks keeps less than half of eager
assert full < 0.5 * eager, (full, eager)
# recompute-all SAC keeps exactly what full AC keeps
assert results["recompute_all"].saved_bytes == full
# save_matmuls lies strictly between full AC and eager
assert full < results["save_matmuls"].saved_bytes < eager
# pitfall 1: comparing the OpOverload with packets silently turns SAC into full AC ...
assert abs(wrong.saved_bytes - full) <= 0.01 * full, (wrong.saved_bytes, full)
# ... while comparing op.overloadpacket keeps the matmul outputs
assert right.saved_bytes > 1.5 * wrong.saved_bytes, (right.saved_bytes, wrong.saved_bytes)
# pitfall 2: a SAC policy that saves everything keeps more than eager
assert greedy.saved_bytes > eager, (greedy.saved_bytes, eager)
print("all claims hold")
"""),
]


# -- 4. The memory budget of torch.compile --------------------------------------------
NB04 = [
    md(r"""
# 4. The memory budget of `torch.compile`

`torch.compile` does its own activation checkpointing. Its partitioner splits the compiled
graph into forward and backward and decides which intermediate tensors to keep; with
`torch._functorch.config.activation_memory_budget` (a number from 0 to 1) you tell it how much
to keep. **0** behaves like full checkpointing (recompute whatever can be recomputed), **1** like
default compile; in between it solves a knapsack: keep the tensors that are most expensive to
recompute per byte until the budget is used. The budget is a *ratio between those two ends*,
not bytes.

A plan's `compile_budget` compiles the model with that budget (CPU inductor here; it needs a C
compiler). Compiling takes a while, so this notebook uses a tiny decoder (2 blocks, width 32, 2
sequences of 32 tokens) and three budgets. Inside a compiled graph allocations bypass Python, so
compiled steps are measured from the profiler's memory events: totals only, no per-layer rows.
"""),
    code(r"""
import pandas as pd
from bokeh.io import show
from bokeh.models import ColumnDataSource, HoverTool, LabelSet
from bokeh.plotting import figure

from memsave_nb import zoo
from memsave_nb.checkpointing import RegionPolicy, suggest_regions
from memsave_nb.plan import Plan
from memsave_nb.session import Session
from memsave_nb.ui.explorer import explore
from memsave_nb.ui.format import format_bytes, format_seconds
from memsave_nb.ui.plots import load_bokehjs

load_bokehjs()  # BokehJS from the installed package, once per kernel: works offline

config = zoo.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
workload = zoo.gpt(config, batch_size=2)
session = Session(workload, repeats=3)
blocks = suggest_regions(workload.model)
baseline = session.baseline
"""),
    md("## The eager choices"),
    code(r"""
eager = {
    "eager": baseline,
    "eager, full AC": session.run(Plan(name="full AC", regions={b: RegionPolicy.full() for b in blocks})).measurement,
    "eager, save matmuls": session.run(Plan(name="save matmuls", regions={b: "save_matmuls" for b in blocks})).measurement,
}
for name, m in eager.items():
    print(f"{name:22s} keeps {format_bytes(m.saved_bytes):>10s}, step {format_seconds(m.step_seconds)}")
"""),
    md(r"""
## The budget sweep

`Session.sweep_budgets` runs the same plan compiled at each budget (each budget compiles afresh:
this cell takes the longest).
"""),
    code(r"""
BUDGETS = (0.0, 0.5, 1.0)
points = session.sweep_budgets(BUDGETS)
compiled = {p.budget: p for p in points}
compile_seconds = [e.seconds for e in session.history[-len(BUDGETS):]]
pd.DataFrame([
    {"budget": p.budget, "saved": format_bytes(p.saved_bytes), "saved / eager": round(p.saved_bytes / baseline.saved_bytes, 3),
     "step": format_seconds(p.step_seconds), "compile + measure": f"{s:.0f} s"}
    for p, s in zip(points, compile_seconds)
]).set_index("budget")
"""),
    md(r"""
## Memory against time

Each point is one way to run the same step: the line is the compiled sweep, the squares are the
eager choices. Down is less memory kept for backward, left is a faster step. (Step times on a
busy 2-core CPU are noisy, and on a model this small eager SAC's per-op policy calls in Python
cost more than the ops they save; the memory axis is exact.)
"""),
    code(r"""
def ms(seconds):
    return 1e3 * seconds if seconds is not None else float("nan")

sweep_src = ColumnDataSource(dict(
    x=[ms(p.step_seconds) for p in points], y=[p.saved_bytes / 1024 for p in points],
    label=[f"budget {p.budget:g}" for p in points],
))
eager_src = ColumnDataSource(dict(
    x=[ms(m.step_seconds) for m in eager.values()], y=[m.saved_bytes / 1024 for m in eager.values()],
    label=list(eager),
))
fig = figure(width=700, height=380, title="Saved activations vs step time",
             x_axis_label="step time (ms)", y_axis_label="saved activations (KiB)", toolbar_location=None)
fig.line("x", "y", source=sweep_src, line_width=2, color="#1f77b4", legend_label="torch.compile, budget sweep")
fig.scatter("x", "y", source=sweep_src, size=10, color="#1f77b4")
fig.scatter("x", "y", source=eager_src, size=11, marker="square", color="#ff7f0e", legend_label="eager")
for src in (sweep_src, eager_src):
    fig.add_layout(LabelSet(x="x", y="y", text="label", source=src, x_offset=6, y_offset=4, text_font_size="9pt"))
fig.add_tools(HoverTool(tooltips=[("", "@label"), ("KiB", "@y{0.0}"), ("ms", "@x{0.00}")]))
fig.y_range.start = 0
fig.x_range.range_padding = 0.25  # room for the labels
fig.legend.location = "top_right"
show(fig)
"""),
    md(r"""
## Your turn

The explorer's **Compile budget** tab has the same controls: tick *compile with a memory
budget*, move the slider (each new budget compiles, give it half a minute here), or press
*sweep*.

**Question.** Compare the compiled step at budget 0 with eager full checkpointing of both blocks
(Layers tab, *full checkpoint* on `blocks.0` and `blocks.1`). Both "recompute everything they
can": why does the compiled one keep less?
"""),
    code(r"""
explorer = explore(session)
explorer
"""),
    md("**Answer**, folded: click *Show the answer* below (in JupyterLab, run the collapsed cell under this one first; as an app it is already there)."),
    answer(r"""
out.append(f"compiled, budget 0: {format_bytes(compiled[0.0].saved_bytes)}; "
      f"eager full AC: {format_bytes(eager['eager, full AC'].saved_bytes)}; eager: {format_bytes(baseline.saved_bytes)}")
out.append('''
Eager checkpointing works at module boundaries: each block keeps its input, and everything
outside the blocks (embeddings, the final norm, the head and the loss) is kept as eager keeps it.
The compiler sees the whole step as one graph: at budget 0 its partitioner keeps only what cannot
be recomputed cheaply anywhere in the model, and fuses the recomputation into the backward
kernels. The budget turns that into a dial instead of an on/off per module.''')
"""),
    md("## What this notebook claims"),
    code(r"""
s0, s5, s1 = (compiled[b].saved_bytes for b in BUDGETS)
# the budget is a dial: less budget, fewer bytes kept (budget 0 keeps under half of budget 1)
assert s0 <= s5 <= s1 and s0 < 0.5 * s1, (s0, s5, s1)
# default compile (budget 1) keeps no more than eager
assert s1 <= baseline.saved_bytes, (s1, baseline.saved_bytes)
# budget 0 keeps less than eager full checkpointing of the blocks
assert s0 < eager["eager, full AC"].saved_bytes, (s0, eager["eager, full AC"].saved_bytes)
# and eager full AC keeps less than eager
assert eager["eager, full AC"].saved_bytes < baseline.saved_bytes
print("all claims hold")
"""),
]


# -- 5. Tuning a fine-tuning setup ----------------------------------------------------
NB05 = [
    md(r"""
# 5. Tuning a fine-tuning setup

You have a pretrained transformer and a budget. Which parameters should train? Each choice
changes three parts of the peak at once:

- **gradients**: one per trainable parameter;
- **optimizer state**: AdamW keeps two more tensors per trainable parameter (first and second
  moments), often the largest single item of a full fine-tuning step;
- **saved activations**: a frozen layer with nothing trainable before it keeps nothing.

This notebook compares full fine-tuning, the last block only, bias-only (BitFit) and LoRA-style
adapters on a small decoder, then exports the winning plan as code for a training script. With
Hugging Face `transformers` installed it uses a small, randomly initialised Llama (nothing is
downloaded); otherwise the GPT-style demo model.
"""),
    code(r"""
import copy
import importlib.util

import pandas as pd
import torch
from torch import nn

from memsave_nb import presets, zoo
from memsave_nb.session import Session
from memsave_nb.ui.explorer import explore
from memsave_nb.ui.format import format_bytes
from memsave_nb.workload import Workload

torch.manual_seed(0)
USE_HF = importlib.util.find_spec("transformers") is not None
if USE_HF:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                            attention_bias=True, mlp_bias=True, use_cache=False)
    model = LlamaForCausalLM(hf_config)  # random weights
    ids = torch.randint(0, hf_config.vocab_size, (4, 64))
    batch = {"input_ids": ids, "labels": ids}  # the model computes its own loss (output.loss)
    ADAPT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
else:
    config = zoo.GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
    demo = zoo.gpt(config, batch_size=4)
    model, batch = demo.model, demo.batch  # {"idx": ..., "targets": ...}; output.loss is the loss
    ADAPT = ("qkv", "proj", "fc")
print(type(model).__name__, f"{sum(p.numel() for p in model.parameters()):,} parameters")
"""),
    md(r"""
## LoRA-style adapters

LoRA freezes a linear layer `W` and learns a low-rank update beside it:
`y = W x + (B A x) * alpha / r`, with `A` (r x in) and `B` (out x r), `B` starting at zero so the
model is unchanged at first. The adapter below wraps every linear layer named in `ADAPT`; its
parameters are named `lora_a` / `lora_b`, which is how `presets.lora_only` finds them.
"""),
    code(r"""
class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0):
        super().__init__()
        self.base = base
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scale


def add_adapters(model, names, rank=4):
    targets = [(n, m) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in names]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, LoRALinear(module, rank))
    return len(targets)


print("adapted", add_adapters(model, ADAPT), "linear layers")
workload = Workload(model, batch, optimizer="adamw", name="fine-tune")
session = Session(workload, repeats=1)
"""),
    md(r"""
## Four ways to fine-tune

Presets build each plan from the model's own names: `all_trainable`, `last_blocks(n=1)`,
`bias_only` and `lora_only`. Every run includes an AdamW step, so the optimizer's state is part
of the peak.
"""),
    code(r"""
# presets take the workload (a Hugging Face model's own `.model` attribute is its inner decoder)
PLANS = {
    "full fine-tuning": presets.all_trainable(workload),
    "last block": presets.last_blocks(workload, 1),
    "bias only (BitFit)": presets.bias_only(workload),
    "LoRA adapters": presets.lora_only(workload),
}
entries = {label: session.run(plan.replace(name=label)) for label, plan in PLANS.items()}


def trainable_bytes(plan):
    names = set(plan.trainable_parameter_names(model))
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n in names)


def optimizer_state_max(m):
    # the largest optimizer state live at any moment of the step (from the measured timeline)
    return max(m.timeline.by_category["optimizer_state"], default=0)


rows = []
for label, e in entries.items():
    m, split = e.measurement, e.measurement.peak_split
    rows.append({
        "plan": label,
        "trainable": format_bytes(trainable_bytes(e.plan)),
        "peak": format_bytes(m.peak_bytes),
        "peak during": m.peak_phase,
        "params at peak": format_bytes(split.parameters),
        "grads at peak": format_bytes(split.gradients),
        "optimizer state at peak": format_bytes(split.optimizer_state),
        "activations + temps at peak": format_bytes(split.activations + split.temporaries),
        "optimizer state (largest)": format_bytes(optimizer_state_max(m)),
        "saved for backward": format_bytes(m.saved_bytes),
        "peak vs full": round(m.peak_bytes / entries["full fine-tuning"].measurement.peak_bytes, 3),
    })
pd.DataFrame(rows).set_index("plan")
"""),
    md(r"""
Full fine-tuning pays for gradients and two AdamW moments for every parameter; on the demo
model its peak is in the optimizer step, when all of them are live at once ("peak during"). The partial plans shrink those in
proportion to what trains, and their peak moves into forward/backward: AdamW creates its state
in the first `step()`, after the activations are gone, so at *their* peak it is 0 (the
"largest" column shows how big it gets). Activations behave differently: freezing all
but the last block leaves nothing to differentiate before it, so the earlier blocks keep
nothing; bias-only and LoRA still need gradients to flow through every block, so most
activations stay (a LoRA adapter even keeps its layer's input for `A`'s gradient).
"""),
    md(r"""
## Your turn

**Question.** In the explorer pick the presets *adapters only (LoRA)* and *bias only (BitFit)*
from the menu and compare their peak split (Results tab). Which part differs most between them,
and which would you pick if the peak must drop below half of full fine-tuning's?
"""),
    code(r"""
explorer = explore(session)
explorer
"""),
    md("**Answer**, folded: click *Show the answer* below (in JupyterLab, run the collapsed cell under this one first; as an app it is already there)."),
    answer(r"""
full = entries["full fine-tuning"].measurement.peak_bytes
for label in ("LoRA adapters", "bias only (BitFit)", "last block"):
    m = entries[label].measurement
    out.append(f"{label:20s} peak {format_bytes(m.peak_bytes):>10s} ({m.peak_bytes / full:.0%} of full), "
          f"optimizer state up to {format_bytes(optimizer_state_max(m))}, saved {format_bytes(m.saved_bytes)}")
out.append('''
Both train very few parameters, so gradients and optimizer state nearly vanish in both; what
differs is the activations. Bias-only needs no layer inputs (a bias gradient is a sum of the
output gradient), while every LoRA adapter keeps its input for the gradient of A. The cheapest
plan is the one at the top of the next cell's ranking.''')
"""),
    md(r"""
## Export the winner

The plan with the smallest peak, written as a standalone snippet for a training script: run it
after building the model, before building the optimizer (which should get only the trainable
parameters).
"""),
    code(r"""
ranking = sorted((e.measurement.peak_bytes, label) for label, e in entries.items())
winner_label = ranking[0][1]
winner = entries[winner_label].plan
print("winner:", winner_label, format_bytes(ranking[0][0]))
code = winner.to_code()
print(code)
"""),
    md("## What this notebook claims"),
    code(r"""
full_m = entries["full fine-tuning"].measurement
param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
# AdamW keeps two moments per trainable parameter: in full fine-tuning that is twice the parameters
assert optimizer_state_max(full_m) >= 2 * param_bytes, (optimizer_state_max(full_m), param_bytes)
# LoRA's optimizer state is under 10% of full fine-tuning's
assert 0 < optimizer_state_max(entries["LoRA adapters"].measurement) < 0.1 * optimizer_state_max(full_m)
# every partial plan has a lower peak than full fine-tuning, and the winner is below 60% of it
for label, e in entries.items():
    if label != "full fine-tuning":
        assert e.measurement.peak_bytes < full_m.peak_bytes, label
assert ranking[0][0] < 0.6 * full_m.peak_bytes, (winner_label, ranking[0][0], full_m.peak_bytes)
# the exported code, run on a fresh copy of the model, trains exactly what was measured
fresh = copy.deepcopy(model)
exec(code, {"model": fresh})
assert [n for n, p in fresh.named_parameters() if p.requires_grad] == winner.trainable_parameter_names(model)
print("all claims hold")
"""),
]


# -- 6. Sizing a model you cannot run ------------------------------------------------
NB06 = [
    md(r"""
# 6. Sizing a model you cannot run

Will fine-tuning a 7B model fit on a 24, 40 or 80 GB GPU, and with which choices? You do not
need the GPU to find out. Under PyTorch's `FakeTensorMode` tensors have shapes, dtypes and
devices but no data: every op computes only the shapes of its results. memsave_nb's tracker
still sees every storage born and freed, so `mode="fake"` measures a whole training step of a
Llama-7B-shaped decoder (32 blocks, width 4096, bf16, 2048 tokens) in seconds on this CPU with a
few hundred MB of RAM.

(The model is built on a fake CPU device: building it on `cuda` runs CUDA's random initialisers,
which a CPU-only PyTorch lacks. Byte sizes are the same on either device.
What fake mode cannot see: the CUDA context, allocator fragmentation and kernel workspaces, so
the table below keeps 10% of each GPU free.)
"""),
    code(r"""
import dataclasses

import pandas as pd
import torch

from memsave_nb import presets, zoo
from memsave_nb.checkpointing import RegionPolicy, suggest_regions
from memsave_nb.session import Session, run_plan
from memsave_nb.ui.explorer import explore

GiB = 2**30
GPUS = (24, 40, 80)  # GiB
HEADROOM = 0.9       # usable share of a GPU


def gpu_adamw(params):
    return torch.optim.AdamW(params, foreach=True)  # AdamW as torch runs it on a GPU: the foreach step


# batch 1 x 2048 tokens, built under FakeTensorMode
workload = dataclasses.replace(zoo.make("gpt-7b"), optimizer=gpu_adamw)
workload8 = dataclasses.replace(zoo.make("gpt-7b", batch_size=8), optimizer=gpu_adamw)
model = workload.model
n_params = sum(p.numel() for p in model.parameters())
blocks = suggest_regions(model)
ac = {b: RegionPolicy.full() for b in blocks}   # full activation checkpointing of every block


def plain_sgd(params):
    return torch.optim.SGD(params, lr=1e-4)    # no momentum: no optimizer state


print(f"{n_params / 1e9:.2f} B parameters, {len(blocks)} blocks")
"""),
    md(r"""
## Plans against GPU sizes

Each row is one fake training step (forward, backward, optimizer step).
"""),
    code(r"""
from memsave_nb.plan import Plan

CASES = {
    "full fine-tuning, AdamW": (workload, Plan()),
    "full fine-tuning, AdamW, AC": (workload, Plan(regions=ac)),
    "full fine-tuning, plain SGD, AC": (dataclasses.replace(workload, optimizer=plain_sgd), Plan(regions=ac)),
    "last 4 blocks, AdamW, AC": (workload, presets.last_blocks(model, 4).replace(regions=ac)),
    "batch 8, full, AdamW": (workload8, Plan()),
    "batch 8, full, AdamW, AC": (workload8, Plan(regions=ac)),
}
results = {label: run_plan(wl, plan, mode="fake") for label, (wl, plan) in CASES.items()}


def gib(n):
    return round(n / GiB, 1)


rows = []
for label, m in results.items():
    s = m.peak_split
    row = {"plan": label, "peak GiB": gib(m.peak_bytes), "params": gib(s.parameters), "grads": gib(s.gradients),
           "optimizer": gib(s.optimizer_state), "activations + temps": gib(s.activations + s.temporaries),
           "saved for backward": gib(m.saved_bytes), "peak during": m.peak_phase}
    for gpu in GPUS:
        row[f"{gpu} GB"] = "fits" if m.peak_bytes <= HEADROOM * gpu * GiB else "-"
    rows.append(row)
pd.DataFrame(rows).set_index("plan")
"""),
    md(r"""
Reading the table:

- The weights alone are 2 bytes x 6.7 B = 12.6 GiB in bf16; gradients are as much again, and
  AdamW's two moments twice that. Full fine-tuning with AdamW peaks in the **optimizer step**, at
  about 5x the weights: the fifth is the temporaries of the foreach step torch runs on a GPU,
  which updates all parameters at once (the single-tensor loop, `foreach=False`, needs about 4x
  but is slower). An 80 GB card, nothing smaller.
- At batch 1, **activation checkpointing does not move that peak**: it shrinks what backward
  keeps, but the peak is not in backward. At batch 8 the activations dominate and AC is what
  brings the step back under 80 GB.
- **Optimizer choice** is worth as much as AC here: plain SGD keeps no state.
- **Freezing** most of the model removes its gradients and optimizer state *and*, with nothing
  trainable before the last blocks, their activations: a 24 GB card is enough.
"""),
    md(r"""
## Your turn

The explorer works on the fake model too (sizes only, no step time).

**Question.** Pick the preset *last block* from the menu. Which of the three GPUs does full
fine-tuning of only the last block fit, and which part of the peak is now the largest?
"""),
    code(r"""
session = Session(workload, mode="fake")
explorer = explore(session)
explorer
"""),
    md("**Answer**, folded: click *Show the answer* below (in JupyterLab, run the collapsed cell under this one first; as an app it is already there)."),
    answer(r"""
last = session.run(presets.last_blocks(model, 1)).measurement
fits = [g for g in GPUS if last.peak_bytes <= HEADROOM * g * GiB]
split = last.peak_split.as_dict()
largest = max(split, key=split.get)
out.append(f"last block: peak {gib(last.peak_bytes)} GiB, fits {fits} GB; largest part: {largest} "
      f"({gib(split[largest])} GiB)")
out.append('''
The frozen weights themselves (12.6 GiB in bf16) are now most of the peak: one block's gradients
and AdamW state are small, and nothing before the last block keeps activations. To go lower
you would quantise the frozen weights (QLoRA-style), which this sizing leaves out.''')
"""),
    md("## What this notebook claims"),
    code(r"""
full = results["full fine-tuning, AdamW"]
# bf16: 2 bytes per parameter; AdamW: two moments per parameter
assert full.peak_split.parameters == 2 * n_params
assert full.peak_split.optimizer_state >= 2 * full.peak_split.parameters
# full fine-tuning with AdamW fits an 80 GB GPU and not a 40 GB one
assert 40 * HEADROOM * GiB < full.peak_bytes <= 80 * HEADROOM * GiB, gib(full.peak_bytes)
# at batch 1 AC leaves the peak (in the optimizer step) within 2% ...
assert abs(results["full fine-tuning, AdamW, AC"].peak_bytes - full.peak_bytes) <= 0.02 * full.peak_bytes
# ... at batch 8 it cuts the peak by more than a third and brings it under 80 GB
b8, b8_ac = results["batch 8, full, AdamW"].peak_bytes, results["batch 8, full, AdamW, AC"].peak_bytes
assert b8_ac < 0.67 * b8 and b8_ac <= 80 * HEADROOM * GiB < b8, (gib(b8), gib(b8_ac))
# plain SGD with AC fits 40 GB; the last 4 blocks with AC fit 24 GB
assert results["full fine-tuning, plain SGD, AC"].peak_bytes <= 40 * HEADROOM * GiB
assert results["last 4 blocks, AdamW, AC"].peak_bytes <= 24 * HEADROOM * GiB
print("all claims hold")
"""),
]


# -- 7. Fitting a fine-tune into a 24 GB GPU (the tuner) --------------------------------------
NB07 = [
    md(r"""
# 7. Fitting a fine-tune into a 24 GB GPU

You have one 24 GB card (an RTX 4090, an L4) and a 1.3 B-parameter Llama-shaped decoder to
fine-tune on 8 sequences of 2048 tokens. Which setup fits, and which of those is fastest?

This notebook answers it without the GPU, in fake mode (shapes and bytes, no compute):

1. full fine-tuning vs LoRA vs the last blocks, each against the 24 GB target and its
   **headroom line** (80% of the card: Fujii et al., arXiv:2411.06465, found that estimates below
   80% never ran out of memory; the rest is CUDA context, allocator fragmentation and library
   workspaces that no tensor counter sees);
2. the **max batch** that fits, found by bisection;
3. the **planner**: per-block checkpointing or offloading choices, ranked by estimated step time
   on a named GPU's roofline, with their Pareto front;
4. the winning plan **exported as code**, run on the model, and re-measured.
"""),
    code(r"""
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memsave_nb import presets, zoo
from memsave_nb.measure import measure
from memsave_nb.plan import Plan, RestorePoint
from memsave_nb.planner import plan_for
from memsave_nb.target import Target, max_batch, measure_peak
from memsave_nb.workload import Workload

GiB = 2**30
# TinyLlama's shape (22 blocks, width 2048, SwiGLU 5632, RMSNorm, vocab 32000), without grouped-query attention
cfg = zoo.GPTConfig(vocab_size=32000, block_size=2048, n_layer=22, n_head=32, n_embd=2048, mlp_hidden=5632,
                    dropout=0.0, bias=False, mlp="swiglu", norm="rmsnorm")
fake = FakeTensorMode()
torch.set_default_dtype(torch.bfloat16)  # parameters in bf16, built with no memory behind them
try:
    with fake:
        model = zoo.GPT(cfg)
finally:
    torch.set_default_dtype(torch.float32)


class LoRALinear(nn.Module):
    def __init__(self, base, rank=16):
        super().__init__()
        self.base, self.scale = base, 1.0 / rank
        self.lora_a = nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scale


with fake:  # adapters on the attention projections, also fake
    for block in model.blocks:
        block.attn.qkv = LoRALinear(block.attn.qkv)
        block.attn.proj = LoRALinear(block.attn.proj)


def batch(batch_size=8):  # called inside the fake mode by measure()
    idx = torch.randint(0, cfg.vocab_size, (batch_size, 2048))
    return {"idx": idx, "targets": idx.roll(-1, dims=1)}


# AdamW as torch runs it on a GPU (the foreach step; fake mode on this CPU would run the loop)
workload = Workload(model, batch, optimizer=lambda params: torch.optim.AdamW(params, foreach=True), name="llama-1.3b")
target = Target(24)
print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters; {target.line()}")
"""),
    md(r"""
## Three ways to fine-tune, against the target

AdamW; parameters, gradients and optimizer state in bf16 (pure bf16 training).
"""),
    code(r"""
import pandas as pd

SETUPS = {
    "full fine-tuning": Plan(),
    "LoRA (attention, rank 16)": presets.lora_only(model),
    "last 2 blocks": presets.last_blocks(model, 2),
}
measured = {label: measure_peak(workload, plan) for label, plan in SETUPS.items()}


def held(m, category):  # the most of one category alive at any moment of the step
    return max(m.timeline.by_category[category], default=0)


rows = []
for label, m in measured.items():
    s = m.peak_split
    rows.append({"setup": label, "peak GiB": round(m.peak_bytes / GiB, 2), "peak during": m.peak_phase,
                 "weights": round(s.parameters / GiB, 2),
                 "grads + optimizer (most held)": round((held(m, "gradients") + held(m, "optimizer_state")) / GiB, 2),
                 "activations + temps at peak": round((s.activations + s.temporaries) / GiB, 2),
                 "24 GB": target.verdict(m.peak_bytes)})
pd.DataFrame(rows).set_index("setup")
"""),
    md(r"""
LoRA removes almost all gradients and optimizer state, but not the activations: backward still
runs through every block to reach the adapters. The last blocks need no backward below them.

## The max batch

The largest LoRA batch that fits under the headroom line, by bisection over fake-mode steps
(`memsave-nb report --target-gb 24 --max-batch` does the same from the command line):
"""),
    code(r"""
lora = SETUPS["LoRA (attention, rank 16)"]
best_lora = max_batch(workload, lora, target)
print(f"LoRA: max batch {best_lora.value} ({best_lora.count} probes, peak {best_lora.peak_bytes / GiB:.2f} GiB)")
"""),
    md(r"""
## The planner

For LoRA at batch 8, the planner tries every block as none / full checkpointing / save-matmuls /
offload (first-n, two-kind splits and a greedy order by seconds per byte saved), estimates each
candidate's peak from a handful of measurements and its time from the per-op roofline of an
RTX 4090, then re-measures the fastest that fit. Hover the scatter; the dashed line is the
headroom line.
"""),
    code(r"""
from bokeh.io import show

from memsave_nb.ui.plots import load_bokehjs
from memsave_nb.ui.tuner_panel import pareto

load_bokehjs()  # BokehJS from the installed package, once per kernel: works offline

result = plan_for(workload, target, device="RTX 4090", freezing={"LoRA": lora}, precisions=(None,))
print(result.summary())
plot = pareto(result.candidates, result.front, target.usable_bytes)
show(plot.figure)
"""),
    md("The winning plan as code, run on the model, and the step measured again:"),
    code(r"""
winner = result.chosen
code = winner.plan.to_code()
print(code)
restore = RestorePoint(model)
try:
    exec(compile(code, "<plan>", "exec", dont_inherit=True), {"model": model})
    exported = measure(workload, mode="fake", repeats=0)
finally:
    restore.restore()
print(f"exported code: peak {exported.peak_bytes / GiB:.2f} GiB; {target.verdict(exported.peak_bytes)}")
"""),
    md("## What this notebook claims"),
    code(r"""
full, lora_m, last = measured.values()
# full fine-tuning does not fit 24 GB; the last 2 blocks do
assert not target.fits(full.peak_bytes) and target.fits(last.peak_bytes)
# LoRA keeps under 2% of full fine-tuning's gradients + optimizer state, but not its activations
state = {k: held(m, "gradients") + held(m, "optimizer_state") for k, m in measured.items()}
assert state["full fine-tuning"] >= 3 * 2 * 1.2e9  # bf16 grads + two bf16 AdamW moments per parameter
assert state["LoRA (attention, rank 16)"] < 0.02 * state["full fine-tuning"]
assert lora_m.peak_split.activations > 0.5 * full.peak_split.activations
assert not target.fits(lora_m.peak_bytes)
# the max batch is a boundary: it fits, one more does not
assert target.fits(best_lora.peak_bytes) and 1 <= best_lora.value < 8
assert not target.fits(measure_peak(workload, lora.replace(batch_size=best_lora.value + 1)).peak_bytes)
# the planner explored many plans and its winner fits when measured in full
assert len(result.candidates) >= 100 and winner.measured_peak_bytes is not None and target.fits(winner.measured_peak_bytes)
# the exported code keeps exactly what the plan keeps
assert exported.peak_bytes == winner.measured_peak_bytes
print("all claims hold")
"""),
    md(r"""
## Your turn: the explorer

The same workload in the explorer, in fake mode (`explore(workload, mode="fake")`), open on its
**Fit a GPU** tab with the 24 GB target and the RTX 4090's roofline: *find plans* runs the
planner above and draws its front (click a point to load that plan), *max batch* bisects the
batch for the plan on display. The Layers tab changes the plan by hand: freeze, checkpoint or
offload per block, and the header's verdict follows.
"""),
    code(r"""
from memsave_nb.ui.explorer import explore

explorer = explore(workload, mode="fake", repeats=0, tab="Fit a GPU")
explorer.tuner.device.value = "RTX 4090"
explorer.tuner.set_target(24)
explorer
"""),
]
# -- 8. Sizing a 70B fine-tune on 8 x 80 GB ------------------------------------------------------
def nb08() -> list:
    """Per-rank sizing under FSDP2 (memsave_nb.parallel) of a Llama-2-70B-shaped fine-tune."""
    return [
        md(r"""
# 8. Sizing a 70B fine-tune on 8 x 80 GB

A 70-billion-parameter model does not fit one GPU: its bf16 weights alone are 129 GiB. Users
shard it with FSDP2 (`fully_shard`): each of N ranks keeps 1/N of the parameters, gradients and
optimizer state, and gathers one layer's full parameters just while that layer runs.

`memsave_nb.parallel` sizes one training step **per rank** with PyTorch's own FSDP2 code: the real
`fully_shard` runs on a *fake process group* under `FakeTensorMode`, in this one process, on a fake
twin of the model. No GPU, no memory, no formula of ours: the bytes are the storages FSDP2 and
autograd allocate, counted by memsave_nb's tracker. What no such counter can see (NCCL buffers,
the CUDA context, fragmentation) is added as explicit lines with their sources.

The model: Llama-2-70B's shape (80 layers, d=8192, 64 heads with 8 KV heads, MLP 28672, vocab
32000), built on the meta device, bf16, AdamW, sequence 4096, batch 1 per rank.

**Units.** The tables and the text count in GiB (2^30 bytes). A GPU sold as "80 GB" holds
80 x 10^9 bytes here, which is 74.5 GiB; its 80% line (below) is 59.6 GiB.
"""),
        code(r"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memsave_nb import Plan
from memsave_nb.parallel import ParallelSpec, measure_parallel
from memsave_nb.workload import Workload

GiB = 1 << 30
cfg = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, use_cache=False,
                  attn_implementation="sdpa")
with torch.device("meta"):
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
n_params = sum(p.numel() for p in model.parameters())


def batch():  # one sequence of 4096 tokens per rank, built inside the fake mode
    ids = torch.randint(0, cfg.vocab_size, (1, 4096))
    return {"input_ids": ids, "labels": ids}


# AdamW as a GPU runs it: torch's default there is the foreach step (fake mode on this CPU would
# otherwise run the single-tensor loop, and the table would add its difference as an unseen line)
workload = Workload(model, batch, optimizer=lambda params: torch.optim.AdamW(params, foreach=True),
                    name="llama-2-70b shape")
print(f"{n_params / 1e9:.1f} B parameters, {2 * n_params / GiB:.0f} GiB in bf16")
"""),
        md(r"""
## FSDP2 on 8 GPUs, no activation checkpointing

Every decoder layer is one `fully_shard` unit (the repeated blocks), the root is another. The
step measured is the second one: AdamW's state exists from the first step on.
"""),
        code(r"""
fsdp8 = measure_parallel(workload, ParallelSpec(world_size=8))
print(fsdp8.table())
"""),
        md(r"""
Per rank, the sharded parameters, gradient shards and AdamW state are 1/8 of the model's
(16 + 16 + 32 GiB at the end of the step). The gathered parameters are one layer's plus the
root's embedding and head, and the all-gather / reduce-scatter buffers are as FSDP2 allocates
them. But the **saved activations** of 80 layers at sequence 4096 are about 130 GiB per rank:
no number of GPUs fixes that, since every rank runs its own sequence.
"""),
        md(r"""
## With every decoder layer checkpointed

The same plan a single-GPU user would write: a full checkpoint region on each
`model.layers.i`. The plan goes onto the fake twin before `fully_shard`, as in a training script.
"""),
        code(r"""
ac = Plan(regions={f"model.layers.{i}": "full" for i in range(cfg.num_hidden_layers)})
fsdp8_ac = measure_parallel(workload, ParallelSpec(world_size=8), ac)
print(fsdp8_ac.table())
"""),
        md(r"""
Checkpointing takes the saved activations from about 130 GiB to under 1 GiB per rank. Now the
peak moves to the **optimizer step**, at about 80 GiB: over the card's 74.5 GiB. torch's default AdamW on a GPU
is its *foreach* step, which works on all of a rank's parameters at once and makes temporaries the
size of the whole shard (here 16 GiB). The single-tensor loop (`foreach=False`, slower) updates
one parameter at a time:
"""),
        code(r"""
loop = workload.replace(optimizer=lambda params: torch.optim.AdamW(params, foreach=False))
fsdp8_ac_loop = measure_parallel(loop, ParallelSpec(world_size=8), ac)
print(f"foreach AdamW: {fsdp8_ac.peak_bytes / GiB:.1f} GiB during {fsdp8_ac.worst.peak_phase}; "
      f"single-tensor AdamW: {fsdp8_ac_loop.peak_bytes / GiB:.1f} GiB during {fsdp8_ac_loop.worst.peak_phase}")
"""),
        md(r"""
With the single-tensor loop the counted peak is under the card's 74.5 GiB, but above the 80% line
(59.6 GiB) under which Fujii et al. (454 runs on A100/H100) never saw an out-of-memory error, and
the unseen lines (NCCL buffers, CUDA context, fragmentation) take it past 74.5 GiB at their high end. Too
close. Doubling the GPUs halves every sharded line, the optimizer's temporaries included:
"""),
        code(r"""
fsdp16_ac = measure_parallel(workload, ParallelSpec(world_size=16), ac)
print(fsdp16_ac.table())
print()
# the same choices as code for the training script (launched with torchrun)
print(ac.replace(regions={"model.layers.0": "full"}, parallel=ParallelSpec(world_size=16)).to_code().split("# FSDP2")[1][:700])
"""),
        md(r"""
## Your turn

**Question.** On 8 GPUs with checkpointing, which line of the per-rank peak is the largest, and
by how much would the peak drop if that line were sharded over 16 GPUs instead of 8?
"""),
        answer(r"""
split = fsdp8_ac.worst.peak_split
largest = max(split, key=split.get)
out.append(f"largest line on 8 GPUs with AC: {largest}, {split[largest] / GiB:.1f} GiB")
out.append(f"on 16 GPUs it is {fsdp16_ac.worst.peak_split[largest] / GiB:.1f} GiB; the whole peak drops "
           f"{(fsdp8_ac.peak_bytes - fsdp16_ac.peak_bytes) / GiB:.1f} GiB (optimizer state, gradients and "
           "parameters are all halved)")
out.append("AdamW keeps two moments per parameter: 32 GiB per rank on 8 GPUs, twice the bf16 shards.")
"""),
        md("## What this notebook claims"),
        code(r"""
end = fsdp8.worst.end_split
# bf16 shards: exactly 1/8 of the model per rank (every dim 0 divides by 8); AdamW: two bf16 moments
# per shard plus one 4-byte step counter per parameter tensor
assert end["sharded_parameters"] == 2 * n_params // 8
n_tensors = len(list(model.parameters()))
assert end["optimizer_state"] == 2 * 2 * n_params // 8 + 4 * n_tensors
# without checkpointing a rank does not fit 80 GB whatever the sharding (activations alone exceed it)
assert fsdp8.peak_bytes > 80e9 and fsdp8.worst.peak_split["activations"] > 80e9
# with it, 8 GPUs are over 80 GB in the GPU's default (foreach) AdamW step; with the single-tensor
# loop they are under 80 GB but above the 80% line; 16 GPUs are under it, unseen lines included
assert fsdp8_ac.worst.peak_phase == "optimizer" and fsdp8_ac.peak_bytes > 80e9, fsdp8_ac.peak_bytes / 1e9
assert 0.8 * 80e9 < fsdp8_ac_loop.peak_bytes < 80e9, fsdp8_ac_loop.peak_bytes / 1e9
assert fsdp16_ac.peak_bytes + fsdp16_ac.unseen_high_bytes < 0.8 * 80e9, fsdp16_ac.peak_bytes / 1e9
assert fsdp8_ac.worst.saved_bytes < fsdp8.worst.saved_bytes / 10
print("all claims hold")
"""),
        md(r"""
## Your turn: the explorer

The same workload in the explorer, in fake mode (`explore(workload, mode="fake")`), open on its
**GPUs** tab with the checkpointing plan above: it sizes that plan per rank on 8 GPUs in the
background (a minute or so here), and again when you change the number of GPUs, the sharding,
bf16 parameters or CPU offload. The header's numbers are one unsharded GPU's, judged against an
80 GB card; they wait for *run* (live reruns are off: each costs a 70B fake step).
"""),
        code(r"""
from memsave_nb.ui.explorer import explore

explorer = explore(workload, mode="fake", repeats=0, live=False, tab="GPUs")
explorer.tuner.set_target(80)  # the verdicts against the notebook's 80 GB cards
explorer.set_plan(ac)
explorer.gpus.refresh(background=True)
explorer
"""),
    ]


NOTEBOOKS: dict[str, list] = {
    "01-what-backward-keeps.ipynb": NB01,
    "02-freezing-and-selective-differentiation.ipynb": NB02,
    "03-checkpointing-and-sac.ipynb": NB03,
    "04-compile-memory-budget.ipynb": NB04,
    "05-tuning-a-fine-tuning-setup.ipynb": NB05,
    "06-sizing-a-model-you-cannot-run.ipynb": NB06,
    "07-fitting-a-fine-tune-into-24-gb.ipynb": NB07,
    "08-sizing-a-70b-fine-tune-on-8-gpus.ipynb": nb08(),
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
