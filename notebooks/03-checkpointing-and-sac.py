# %% [markdown]
# # 3. Activation checkpointing and selective checkpointing (SAC)
#
# **Activation checkpointing (AC)** marks a *region* (here: a transformer block) whose forward
# keeps nothing but its inputs; backward runs the region's forward again to get what it needs.
# Less memory, more compute:
# `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`.
#
# **Selective activation checkpointing (SAC)** decides per op inside the region: a
# `policy_fn(ctx, op, *args, **kwargs)` returns `CheckpointPolicy.MUST_SAVE` (keep this op's
# output) or `PREFER_RECOMPUTE`, passed as
# `context_fn=functools.partial(create_selective_checkpoint_contexts, policy_fn)`. The usual
# choice: keep the expensive matmuls, recompute the cheap pointwise ops.
#
# The workload: a small GPT-style decoder (2 blocks, width 64, 4 sequences of 64 tokens).

# %%
import contextlib
import functools

import pandas as pd
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memsave_nb import measure, zoo, RegionPolicy, Plan, Session, explore
from memsave_nb.checkpointing import POLICY_PRESETS, OpChoice, RegionKind, suggest_regions
from memsave_nb.ui.format import format_bytes, format_seconds

config = zoo.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64, dropout=0.0)
workload = zoo.gpt(config, batch_size=4)
model = workload.model
session = Session(workload, repeats=2)
baseline = session.baseline
blocks = suggest_regions(model)  # the repeated blocks: ['blocks.0', 'blocks.1']
print("regions:", blocks, "| eager keeps", format_bytes(baseline.saved_bytes))

# %% [markdown]
# ## Regions and the policy presets
#
# A plan's `regions` maps module names to a `RegionPolicy`: `full()`, or selective with per-op
# choices. The presets: `full`, `save_matmuls` (keep `mm`/`addmm`/`bmm` outputs),
# `save_compute_intensive` (matmuls, convolutions, attention), `recompute_all` (selective, but
# every op recomputed).

# %%
rows, results = [], {}
for name, policy in POLICY_PRESETS.items():
    m = session.run(Plan(name=name, regions={b: policy for b in blocks})).measurement
    results[name] = m
    rows.append(
        {
            "policy": name,
            "saved": format_bytes(m.saved_bytes),
            "saved / eager": round(m.saved_bytes / baseline.saved_bytes, 3),
            "peak": format_bytes(m.peak_bytes),
            "step": format_seconds(m.step_seconds),
        }
    )
pd.DataFrame(rows).set_index("policy")

# %% [markdown]
# What eager keeps, by op (summed over the step): the matmul outputs (`addmm`) are the inputs of
# the next layer, GELU keeps its input, layer norm its input and statistics.

# %%
for op in sorted(baseline.ops, key=lambda o: -o.saved_bytes)[:7]:
    print(f"{op.op:50s} {op.count:3d} calls {format_bytes(op.saved_bytes):>12s}")

# %% [markdown]
# ## Pitfall 1: a policy receives an `OpOverload`
#
# A policy is called with `op = torch.ops.aten.addmm.default`, an *overload*. Comparing it with
# the *packet* `torch.ops.aten.addmm` is always False, so the policy below silently recomputes
# everything: it is full checkpointing under another name. Compare `op.overloadpacket`.
# Both are written here by hand, exactly as in a training script, and measured with `measure()`.

# %%
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

# %% [markdown]
# ## Pitfall 2: SAC can keep *more* than no checkpointing
#
# A policy that saves every op's output keeps tensors eager autograd would have freed: the output
# of a projection that only feeds an addition, say, which backward never reads. Selective is not
# automatically smaller.

# %%
save_all = RegionPolicy(RegionKind.SELECTIVE, {}, OpChoice.SAVE)  # selective, default "save"
greedy = session.run(Plan(name="save everything", regions={b: save_all for b in blocks})).measurement
print(f"eager:                    {format_bytes(baseline.saved_bytes)}")
print(
    f"SAC saving every op:      {format_bytes(greedy.saved_bytes)} "
    f"({greedy.saved_bytes / baseline.saved_bytes:.2f}x eager)"
)

# %% [markdown]
# ## Your turn
#
# In the explorer, each row's *checkpoint* menu makes that module a region. Selecting a row shows
# its ops in the **SAC per op** tab (count, bytes kept, FLOPs, save or recompute).
#
# **Question.** Put both blocks under *full checkpoint*, then under *recompute all*. Why are the
# saved totals identical? Then try *save matmuls*: what does keeping the matmul outputs cost in
# memory against full checkpointing, and what does it buy?

# %%
explorer = explore(session)
explorer

# %% [markdown]
# **Answer**, folded: click *Show the answer* below (in JupyterLab, run the collapsed cell under this one first; as an app it is already there).

# %% jupyter={"outputs_hidden": true, "source_hidden": true} tags=["answer"]
out = []  # the answer, shown folded
full, rec, mm = (results[k] for k in ("full", "recompute_all", "save_matmuls"))
out.append(
    f"full {format_bytes(full.saved_bytes)}, recompute all {format_bytes(rec.saved_bytes)}, "
    f"save matmuls {format_bytes(mm.saved_bytes)}, eager {format_bytes(baseline.saved_bytes)}"
)
out.append("""
A selective region that recomputes every op keeps exactly what full checkpointing keeps: the
region's inputs. "save matmuls" also keeps each matmul's output, so backward does not have to
run the matmuls again (the expensive part of the recomputation) and only redoes the cheap
pointwise ops; it costs the bytes of those outputs. On this tiny model on a CPU the step times
are too close to call; on a GPU-sized model the recomputed matmuls are most of AC's overhead.""")
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
