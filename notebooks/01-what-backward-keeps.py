# %% [markdown]
# # 1. What backward keeps
#
# A training step runs the model forward, computes a loss, runs backward and lets the optimizer
# update the parameters. Backward needs some of the tensors forward computed: autograd **keeps
# them alive** from the moment forward makes them until backward has used them. Those are the
# *saved activations*, and on most models they are the largest part of a step's memory that you
# can change.
#
# This notebook measures them, layer by layer, on a small ResNet-style CNN (8 images of 3x32x32),
# explains why each kind of layer keeps what it keeps, and compares the measurement with the
# estimate `torchinfo` prints. At the end you get an **explorer**: tick a box, the step is
# measured again, and the numbers change.
#
# *memsave_nb counts a tensor as "saved" when its storage was created during forward and is
# still alive when forward ends; parameters and the batch itself are not counted; a storage shared
# by several views counts once.*

# %%
import copy

import torch
import torchinfo

from memsave_nb import zoo, Plan, Session, explore
from memsave_nb.ui.format import format_bytes, layer_table, render_table

BATCH = 8
workload = zoo.make("cnn", batch_size=BATCH)  # ResNet-style: stem, 3 stages of 2 blocks, linear head
session = Session(workload, repeats=1)  # one Session: a baseline and every plan tried against it
baseline = session.baseline  # one measured training step, nothing changed

print(f"saved for backward: {format_bytes(baseline.saved_bytes)}")
print(f"peak of the step:   {format_bytes(baseline.peak_bytes)}")
for category, nbytes in baseline.peak_split.as_dict().items():
    print(f"  {category.replace('_', ' '):16s} {format_bytes(nbytes):>10s}")

# %% [markdown]
# ## Layer by layer
#
# The ten layers that keep the most. A layer's *saved activations* are the storages **created in
# it** that backward still needs: the output of a convolution shows up in the convolution's row
# even though it is the following batch norm that keeps it.

# %%
print(render_table(*layer_table(baseline, top=10)))

# %% [markdown]
# ## Why each layer keeps what it keeps
#
# Backward of a layer needs whatever its derivative formula reads:
#
# - **Convolution** `y = w * x`: the weight gradient needs the input `x`; the input gradient needs
#   only `w` (a parameter, not counted). Stock PyTorch saves `x` whenever *anything* in the layer
#   needs a gradient.
# - **Batch norm** (training mode): normalises with the batch's mean and variance, so backward needs
#   its input plus the per-channel mean and inverse standard deviation (small).
# - **ReLU** needs only *where* its input was positive. The in-place ReLU of this CNN overwrites its
#   input and keeps that one tensor (its output); nothing new is created, so its row shows 0 and
#   the bytes appear under the batch norm that made the tensor.
# - **Max-pool** keeps the *indices* of the maxima, as int64: 8 bytes per output element, twice its
#   float32 output.
#
# Per op (`aten.*` is what autograd really calls), summed over the whole step:

# %%
for op in sorted(baseline.ops, key=lambda o: -o.saved_bytes)[:6]:
    print(f"{op.op:32s} {op.count:3d} calls {format_bytes(op.saved_bytes):>12s}")

pool = baseline.module("stem.3")
out_elems = 1
for d in pool.output_shape:
    out_elems *= d
print(
    f"\nmax-pool output {pool.output_shape}: {format_bytes(out_elems * 4)} float32 + "
    f"{format_bytes(out_elems * 8)} int64 indices = {format_bytes(out_elems * 12)}; "
    f"measured: {format_bytes(pool.saved_bytes)}"
)

# %% [markdown]
# ## torchinfo's estimate is not the truth
#
# `torchinfo.summary` prints a "Forward/backward pass size": twice the outputs of the layers that
# have parameters. It does not run backward, so it cannot know what autograd keeps: it ignores
# parameter-free ops (max-pool indices, additions), in-place ops, freezing and checkpointing.
# Below: its estimate for the model as it is and with the stem frozen, against the measurement.
# (torchinfo runs a forward pass that updates batch-norm statistics, so it gets a copy.)

# %%
shape = tuple(workload.batch.shape)
estimate = torchinfo.summary(copy.deepcopy(workload.model), input_size=shape, verbose=0).total_output_bytes

frozen_copy = copy.deepcopy(workload.model)
frozen_copy.stem.requires_grad_(False)
estimate_frozen = torchinfo.summary(frozen_copy, input_size=shape, verbose=0).total_output_bytes
measured_frozen = session.run(Plan(name="freeze stem", frozen=("stem",))).measurement.saved_bytes

print(f"{'':22s}{'torchinfo':>12s}{'measured':>12s}")
print(f"{'all trainable':22s}{format_bytes(estimate):>12s}{format_bytes(baseline.saved_bytes):>12s}")
print(f"{'stem frozen':22s}{format_bytes(estimate_frozen):>12s}{format_bytes(measured_frozen):>12s}")

# %% [markdown]
# ## Your turn: the explorer
#
# Each row of the **Layers** tab has a *freeze* box (its parameters stop requiring gradients), a
# *memsave* switch (memory-saving layers, notebook 2) and a *checkpoint* menu (notebook 3).
# Every change measures the step again; the header shows the new saved total and the change
# against the baseline. The **Results** tab has the peak's split and a timeline of the step.
#
# **Question.** Freeze the `stem` (tick its box) and note the saved total. Untick it and freeze
# `layers.0` (the first stage) instead. Which saves more? Why does the other one save almost
# nothing with stock PyTorch layers?

# %%
explorer = explore(session)
explorer

# %% [markdown]
# **Answer**, folded: click *Show the answer* below (in JupyterLab, run the collapsed cell under this one first; as an app it is already there).

# %% jupyter={"outputs_hidden": true, "source_hidden": true} tags=["answer"]
out = []  # the answer, shown folded
stem = session.run(Plan(name="freeze stem", frozen=("stem",))).measurement
stage = session.run(Plan(name="freeze layers.0", frozen=("layers.0",))).measurement
out.append(f"baseline          {format_bytes(baseline.saved_bytes)}")
out.append(f"freeze stem       {format_bytes(stem.saved_bytes)} ({stem.saved_bytes / baseline.saved_bytes:.0%})")
out.append(f"freeze layers.0   {format_bytes(stage.saved_bytes)} ({stage.saved_bytes / baseline.saved_bytes:.0%})")
out.append("""
Freezing the stem saves the most. Nothing before the stem needs a gradient (the images do not),
so once its own parameters are frozen autograd records nothing there: no input kept for a weight
gradient, no batch-norm input, no max-pool indices.
Freezing layers.0 saves (almost) nothing: the stem before it still trains, so the gradient must
flow back through layers.0, and stock convolution and batch norm keep their inputs whenever
anything in them needs a gradient -- even though, with frozen weights, those inputs are only ever
needed for the weight gradient that is no longer computed. Notebook 2 fixes exactly that.""")
from IPython.display import HTML, display
import html

display(
    HTML(
        "<details><summary><b>Show the answer</b></summary><pre style='white-space:pre-wrap'>"
        + html.escape("\n".join(out))
        + "</pre></details>"
    )
)

# %% [markdown]
# ## What this notebook claims
#
# Checked from the numbers measured above, so a change in the engine that would teach a wrong
# figure fails here.

# %%
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
