# %% [markdown]
# # 4. The memory budget of `torch.compile`
#
# `torch.compile` does its own activation checkpointing. Its partitioner splits the compiled
# graph into forward and backward and decides which intermediate tensors to keep; with
# `torch._functorch.config.activation_memory_budget` (a number from 0 to 1) you tell it how much
# to keep. **0** behaves like full checkpointing (recompute whatever can be recomputed), **1** like
# default compile; in between it solves a knapsack: keep the tensors that are most expensive to
# recompute per byte until the budget is used. The budget is a *ratio between those two ends*,
# not bytes.
#
# A plan's `compile_budget` compiles the model with that budget (CPU inductor here; it needs a C
# compiler). Compiling takes a while, so this notebook uses a tiny decoder (2 blocks, width 32, 2
# sequences of 32 tokens) and three budgets. Inside a compiled graph allocations bypass Python, so
# compiled steps are measured from the profiler's memory events: totals only, no per-layer rows.

# %%
import pandas as pd
from bokeh.io import show
from bokeh.models import ColumnDataSource, HoverTool, LabelSet
from bokeh.plotting import figure

from memsave_nb import zoo, RegionPolicy, Plan, Session, explore
from memsave_nb.checkpointing import suggest_regions
from memsave_nb.ui.format import format_bytes, format_seconds
from memsave_nb.ui.plots import load_bokehjs

load_bokehjs()  # BokehJS from the installed package, once per kernel: works offline

config = zoo.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
workload = zoo.gpt(config, batch_size=2)
session = Session(workload, repeats=3)
blocks = suggest_regions(workload.model)
baseline = session.baseline

# %% [markdown]
# ## The eager choices

# %%
eager = {
    "eager": baseline,
    "eager, full AC": session.run(Plan(name="full AC", regions={b: RegionPolicy.full() for b in blocks})).measurement,
    "eager, save matmuls": session.run(
        Plan(name="save matmuls", regions={b: "save_matmuls" for b in blocks})
    ).measurement,
}
for name, m in eager.items():
    print(f"{name:22s} keeps {format_bytes(m.saved_bytes):>10s}, step {format_seconds(m.step_seconds)}")

# %% [markdown]
# ## The budget sweep
#
# `Session.sweep_budgets` runs the same plan compiled at each budget (each budget compiles afresh:
# this cell takes the longest).

# %%
BUDGETS = (0.0, 0.5, 1.0)
points = session.sweep_budgets(BUDGETS)
compiled = {p.budget: p for p in points}
compile_seconds = [e.seconds for e in session.history[-len(BUDGETS) :]]
pd.DataFrame(
    [
        {
            "budget": p.budget,
            "saved": format_bytes(p.saved_bytes),
            "saved / eager": round(p.saved_bytes / baseline.saved_bytes, 3),
            "step": format_seconds(p.step_seconds),
            "compile + measure": f"{s:.0f} s",
        }
        for p, s in zip(points, compile_seconds)
    ]
).set_index("budget")


# %% [markdown]
# ## Memory against time
#
# Each point is one way to run the same step: the line is the compiled sweep, the squares are the
# eager choices. Down is less memory kept for backward, left is a faster step. (Step times on a
# busy 2-core CPU are noisy, and on a model this small eager SAC's per-op policy calls in Python
# cost more than the ops they save; the memory axis is exact.)


# %%
def ms(seconds):
    return 1e3 * seconds if seconds is not None else float("nan")


sweep_src = ColumnDataSource(
    dict(
        x=[ms(p.step_seconds) for p in points],
        y=[p.saved_bytes / 1024 for p in points],
        label=[f"budget {p.budget:g}" for p in points],
    )
)
eager_src = ColumnDataSource(
    dict(
        x=[ms(m.step_seconds) for m in eager.values()],
        y=[m.saved_bytes / 1024 for m in eager.values()],
        label=list(eager),
    )
)
fig = figure(
    width=700,
    height=380,
    title="Saved activations vs step time",
    x_axis_label="step time (ms)",
    y_axis_label="saved activations (KiB)",
    toolbar_location=None,
)
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

# %% [markdown]
# ## Your turn
#
# The explorer's **Compile budget** tab has the same controls: tick *compile with a memory
# budget*, move the slider (each new budget compiles, give it half a minute here), or press
# *sweep*.
#
# **Question.** Compare the compiled step at budget 0 with eager full checkpointing of both blocks
# (Layers tab, *full checkpoint* on `blocks.0` and `blocks.1`). Both "recompute everything they
# can": why does the compiled one keep less?

# %%
explorer = explore(session)
explorer

# %% [markdown]
# **Answer**, folded: click *Show the answer* below (in JupyterLab, run the collapsed cell under this one first; as an app it is already there).

# %% jupyter={"outputs_hidden": true, "source_hidden": true} tags=["answer"]
out = []  # the answer, shown folded
out.append(
    f"compiled, budget 0: {format_bytes(compiled[0.0].saved_bytes)}; "
    f"eager full AC: {format_bytes(eager['eager, full AC'].saved_bytes)}; eager: {format_bytes(baseline.saved_bytes)}"
)
out.append("""
Eager checkpointing works at module boundaries: each block keeps its input, and everything
outside the blocks (embeddings, the final norm, the head and the loss) is kept as eager keeps it.
The compiler sees the whole step as one graph: at budget 0 its partitioner keeps only what cannot
be recomputed cheaply anywhere in the model, and fuses the recomputation into the backward
kernels. The budget turns that into a dial instead of an on/off per module.""")
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
