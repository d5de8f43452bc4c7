# %% [markdown]
# # 2. Freezing and selective differentiation
#
# Fine-tuning often trains only part of a network: the last layers, the normalisation layers, or
# nothing but the input (adversarial examples, saliency maps). Freezing removes the gradients of
# frozen weights, so you would expect the activations kept *for* those gradients to go too.
#
# With stock PyTorch layers they mostly do not. A convolution or batch norm needs its input only
# for its *weight* gradient, yet stock PyTorch keeps it whenever anything in the layer needs a
# gradient. Bhatia & Dangel, *Lowering PyTorch's Memory Consumption for Selective
# Differentiation* (2024), replace those layers with drop-ins that decide at forward time what
# backward will need. memsave_nb ships such layers (`memsave_nb.layers`); a plan switches them on
# with `memsave=("*",)`.
#
# This notebook reproduces the paper's cases on the demo CNN (8 images of 3x32x32), with stock and
# memory-saving layers, as a table and a plot.

# %%
import pandas as pd
from bokeh.io import show
from bokeh.models import ColumnDataSource, FactorRange, HoverTool
from bokeh.plotting import figure

from memsave_nb import presets, zoo, Session, explore
from memsave_nb.ui.format import format_bytes
from memsave_nb.ui.plots import load_bokehjs

load_bokehjs()  # BokehJS from the installed package, once per kernel: works offline

workload = zoo.make("cnn", batch_size=8)
model = workload.model
session = Session(workload, repeats=1)
baseline = session.baseline  # stock layers, everything trainable
print(f"stock, all trainable: {format_bytes(baseline.saved_bytes)} kept for backward")

# %% [markdown]
# ## The cases
#
# As in the paper: everything trainable; only the input needs a gradient (all weights frozen);
# the same with batch norm in eval mode (running statistics); only the normalisation layers
# train; "surgical" fine-tuning of the first or the last quarter of the layers (the last quarter
# with the input requiring a gradient, as there). Each runs once with stock layers and once with
# the memory-saving ones. The last column is the reference implementation's ratio for ResNet-18,
# measured the same way on this CPU (memory-saving / stock, same case).

# %%
CASES = {
    "all trainable": presets.all_trainable(model),
    "input only": presets.input_only(model),
    "input only, BN eval": presets.input_only(model, bn_eval=True),
    "norm layers only": presets.norm_only(model),
    "first quarter": presets.first_quarter(model),
    "last quarter + input": presets.last_quarter(model, input_requires_grad=True),
}
REFERENCE = {
    "all trainable": 0.954,
    "input only": 0.642,
    "input only, BN eval": 0.182,
    "norm layers only": 0.642,
    "first quarter": 0.828,
    "last quarter + input": 0.665,
}

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

# %%
factors = [(case, layers) for case in CASES for layers in ("stock", "memsave")]
source = ColumnDataSource(
    dict(
        x=factors,
        mib=[saved[f] / 2**20 for f in factors],
        label=[format_bytes(saved[f]) for f in factors],
        color=["#9e9e9e" if layers == "stock" else "#54a24b" for _, layers in factors],
    )
)
fig = figure(
    x_range=FactorRange(*factors),
    height=320,
    width=820,
    toolbar_location=None,
    title="Saved activations per case: stock vs memory-saving layers",
    y_axis_label="MiB",
)
fig.vbar(x="x", top="mib", width=0.85, color="color", source=source)
fig.add_tools(HoverTool(tooltips=[("", "@x"), ("kept", "@label")]))
fig.xaxis.major_label_orientation = 0.9
fig.xgrid.grid_line_color = None
fig.y_range.start = 0
show(fig)

# %% [markdown]
# What the table says:
#
# - **Stock layers gain almost nothing from freezing** here: every case keeps about what "all
#   trainable" keeps, because the input (or an early layer) still needs a gradient, so every
#   convolution and batch norm on the way keeps its input.
# - **Memory-saving layers** keep a convolution's input only when its weight trains, a ReLU's
#   1-bit mask instead of its float output, and a batch norm's input only when batch statistics
#   or its weight need it. With batch norm in eval mode and all weights frozen almost nothing is
#   left: a few per-channel statistics, the bit masks and the pool indices.
# - Unlike the reference layers (1.09x on ResNet-101), these **never keep more than stock**, even
#   when everything trains. Saved activations are not the whole peak, though: compare the peak
#   columns (the memory-saving layers rebuild masks and inputs in backward, which costs
#   temporaries; where nothing is frozen the peak can end up higher).

# %% [markdown]
# ## Your turn
#
# **Question.** In the explorer, pick the preset *input only* from the plan preset menu, then tick
# *memsave* on the model's row (the first row). Now tick *batch norm in eval mode*. Roughly how
# much does eval mode cut, and why does batch norm in training mode need its input even when its
# weight and bias are frozen?

# %%
explorer = explore(session)
explorer

# %% [markdown]
# **Answer**, folded: click *Show the answer* below (in JupyterLab, run the collapsed cell under this one first; as an app it is already there).

# %% jupyter={"outputs_hidden": true, "source_hidden": true} tags=["answer"]
out = []  # the answer, shown folded
train_bn = saved["input only", "memsave"]
eval_bn = saved["input only, BN eval", "memsave"]
out.append(
    f"input only, memsave layers: {format_bytes(train_bn)}; with BN eval: {format_bytes(eval_bn)} "
    f"({eval_bn / train_bn:.0%} of it)"
)
out.append("""
In training mode batch norm normalises with the batch's own mean and variance, which depend on
every input; the gradient with respect to the input runs through them, so it needs the
(normalised) input whatever the weight does. In eval mode the statistics are constants: batch
norm is a fixed per-channel affine map whose input gradient needs only the weight and the running
variance. Then a frozen network keeps almost nothing: per-channel statistics, ReLU bit masks and
the max-pool indices.""")
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


# %%
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
