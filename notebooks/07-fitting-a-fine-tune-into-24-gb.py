# %% [markdown]
# # 7. Fitting a fine-tune into a 24 GB GPU
#
# You have one 24 GB card (an RTX 4090, an L4) and a 1.3 B-parameter Llama-shaped decoder to
# fine-tune on 8 sequences of 2048 tokens. Which setup fits, and which of those is fastest?
#
# This notebook answers it without the GPU, in fake mode (shapes and bytes, no compute):
#
# 1. full fine-tuning vs LoRA vs the last blocks, each against the 24 GB target and its
#    **headroom line** (80% of the card: Fujii et al., arXiv:2411.06465, found that estimates below
#    80% never ran out of memory; the rest is CUDA context, allocator fragmentation and library
#    workspaces that no tensor counter sees);
# 2. the **max batch** that fits, found by bisection;
# 3. the **planner**: per-block checkpointing or offloading choices, ranked by estimated step time
#    on a named GPU's roofline, with their Pareto front;
# 4. the winning plan **exported as code**, run on the model, and re-measured.

# %%
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memsave_nb import presets, zoo, measure, Plan, plan_for, Target, Workload
from memsave_nb.plan import RestorePoint
from memsave_nb.target import fit_of, max_batch, measure_peak

GiB = 2**30
# TinyLlama's shape (22 blocks, width 2048, SwiGLU 5632, RMSNorm, vocab 32000), without grouped-query attention
cfg = zoo.GPTConfig(
    vocab_size=32000,
    block_size=2048,
    n_layer=22,
    n_head=32,
    n_embd=2048,
    mlp_hidden=5632,
    dropout=0.0,
    bias=False,
    mlp="swiglu",
    norm="rmsnorm",
)
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

# %% [markdown]
# ## Three ways to fine-tune, against the target
#
# AdamW; parameters, gradients and optimizer state in bf16 (pure bf16 training).

# %%
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
    rows.append(
        {
            "setup": label,
            "peak GiB": round(m.peak_bytes / GiB, 2),
            "peak during": m.peak_phase,
            "weights": round(s.parameters / GiB, 2),
            "grads + optimizer (most held)": round((held(m, "gradients") + held(m, "optimizer_state")) / GiB, 2),
            "activations + temps at peak": round((s.activations + s.temporaries) / GiB, 2),
            "24 GB": fit_of(target, m).verdict(target),
        }
    )
pd.DataFrame(rows).set_index("setup")

# %% [markdown]
# LoRA removes almost all gradients and optimizer state, but not the activations: backward still
# runs through every block to reach the adapters. The last blocks need no backward below them.
#
# ## The max batch
#
# The largest LoRA batch that fits under the headroom line, by bisection over fake-mode steps
# (`memsave-nb report --target-gb 24 --max-batch` does the same from the command line):

# %%
lora = SETUPS["LoRA (attention, rank 16)"]
best_lora = max_batch(workload, lora, target)
print(f"LoRA: max batch {best_lora.value} ({best_lora.count} probes, peak {best_lora.peak_bytes / GiB:.2f} GiB)")

# %% [markdown]
# ## The planner
#
# For LoRA at batch 8, the planner tries every block as none / full checkpointing / save-matmuls /
# offload (first-n, two-kind splits and a greedy order by seconds per byte saved), estimates each
# candidate's peak from a handful of measurements and its time from the per-op roofline of an
# RTX 4090, then re-measures the fastest that fit. Hover the scatter; the dashed line is the
# headroom line.

# %%
from bokeh.io import show

from memsave_nb.ui.plots import load_bokehjs
from memsave_nb.ui.tuner_panel import pareto

load_bokehjs()  # BokehJS from the installed package, once per kernel: works offline

result = plan_for(workload, target, device="RTX 4090", freezing={"LoRA": lora}, precisions=(None,))
print(result.summary())
plot = pareto(result.candidates, result.front, target.usable_bytes)
show(plot.figure)

# %% [markdown]
# The winning plan as code, run on the model, and the step measured again:

# %%
winner = result.chosen
code = winner.plan.to_code()
print(code)
restore = RestorePoint(model)
try:
    exec(compile(code, "<plan>", "exec", dont_inherit=True), {"model": model})
    exported = measure(workload, mode="fake", repeats=0)
finally:
    restore.restore()
print(f"exported code: peak {exported.peak_bytes / GiB:.2f} GiB; {fit_of(target, exported).verdict(target)}")

# %% [markdown]
# ## What this notebook claims

# %%
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
assert (
    len(result.candidates) >= 100 and winner.measured_peak_bytes is not None and winner.fits
)  # the verdict on its re-measured step (target.fit_of)
# the exported code keeps exactly what the plan keeps
assert exported.peak_bytes == winner.measured_peak_bytes
print("all claims hold")

# %% [markdown]
# ## Your turn: the explorer
#
# The same workload in the explorer, in fake mode (`explore(workload, mode="fake")`), open on its
# **Fit a GPU** tab with the 24 GB target and the RTX 4090's roofline: *find plans* runs the
# planner above and draws its front (click a point to load that plan), *max batch* bisects the
# batch for the plan on display. The Layers tab changes the plan by hand: freeze, checkpoint or
# offload per block, and the header's verdict follows (an offloaded block adds the host memory it
# takes and the bytes moved per step to the header's step line).

# %%
from memsave_nb import explore

explorer = explore(workload, mode="fake", repeats=0, tab="Fit a GPU")
explorer.tuner.device.value = "RTX 4090"
explorer.tuner.set_target(24)
explorer
