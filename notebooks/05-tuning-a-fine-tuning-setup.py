# %% [markdown]
# # 5. Tuning a fine-tuning setup
#
# You have a pretrained transformer and a budget. Which parameters should train? Each choice
# changes three parts of the peak at once:
#
# - **gradients**: one per trainable parameter;
# - **optimizer state**: AdamW keeps two more tensors per trainable parameter (first and second
#   moments), often the largest single item of a full fine-tuning step;
# - **saved activations**: a frozen layer with nothing trainable before it keeps nothing.
#
# This notebook compares full fine-tuning, the last block only, bias-only (BitFit) and LoRA-style
# adapters on a small decoder, then exports the winning plan as code for a training script. With
# Hugging Face `transformers` installed it uses a small, randomly initialised Llama (nothing is
# downloaded); otherwise the GPT-style demo model.

# %%
import copy
import importlib.util

import pandas as pd
import torch
from torch import nn

from memsave_nb import presets, zoo, Session, explore, Workload
from memsave_nb.ui.format import format_bytes

torch.manual_seed(0)
USE_HF = importlib.util.find_spec("transformers") is not None
if USE_HF:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        attention_bias=True,
        mlp_bias=True,
        use_cache=False,
    )
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


# %% [markdown]
# ## LoRA-style adapters
#
# LoRA freezes a linear layer `W` and learns a low-rank update beside it:
# `y = W x + (B A x) * alpha / r`, with `A` (r x in) and `B` (out x r), `B` starting at zero so the
# model is unchanged at first. The adapter below wraps every linear layer named in `ADAPT`; its
# parameters are named `lora_a` / `lora_b`, which is how `presets.lora_only` finds them.


# %%
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
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in names]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, LoRALinear(module, rank))
    return len(targets)


print("adapted", add_adapters(model, ADAPT), "linear layers")
workload = Workload(model, batch, optimizer="adamw", name="fine-tune")
session = Session(workload, repeats=1)

# %% [markdown]
# ## Four ways to fine-tune
#
# Presets build each plan from the model's own names: `all_trainable`, `last_blocks(n=1)`,
# `bias_only` and `lora_only`. Every run includes an AdamW step, so the optimizer's state is part
# of the peak.

# %%
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
    rows.append(
        {
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
        }
    )
pd.DataFrame(rows).set_index("plan")

# %% [markdown]
# Full fine-tuning pays for gradients and two AdamW moments for every parameter; on the demo
# model its peak is in the optimizer step, when all of them are live at once ("peak during"). The partial plans shrink those in
# proportion to what trains, and their peak moves into forward/backward: AdamW creates its state
# in the first `step()`, after the activations are gone, so at *their* peak it is 0 (the
# "largest" column shows how big it gets). Activations behave differently: freezing all
# but the last block leaves nothing to differentiate before it, so the earlier blocks keep
# nothing; bias-only and LoRA still need gradients to flow through every block, so most
# activations stay (a LoRA adapter even keeps its layer's input for `A`'s gradient).

# %% [markdown]
# ## Your turn
#
# **Question.** In the explorer pick the presets *adapters only (LoRA)* and *bias only (BitFit)*
# from the menu and compare their peak split (Results tab). Which part differs most between them,
# and which would you pick if the peak must drop below half of full fine-tuning's?

# %%
explorer = explore(session)
explorer

# %% [markdown]
# **Answer**, folded: click *Show the answer* below (in JupyterLab, run the collapsed cell under this one first; as an app it is already there).

# %% jupyter={"outputs_hidden": true, "source_hidden": true} tags=["answer"]
out = []  # the answer, shown folded
full = entries["full fine-tuning"].measurement.peak_bytes
for label in ("LoRA adapters", "bias only (BitFit)", "last block"):
    m = entries[label].measurement
    out.append(
        f"{label:20s} peak {format_bytes(m.peak_bytes):>10s} ({m.peak_bytes / full:.0%} of full), "
        f"optimizer state up to {format_bytes(optimizer_state_max(m))}, saved {format_bytes(m.saved_bytes)}"
    )
out.append("""
Both train very few parameters, so gradients and optimizer state nearly vanish in both; what
differs is the activations. Bias-only needs no layer inputs (a bias gradient is a sum of the
output gradient), while every LoRA adapter keeps its input for the gradient of A. The cheapest
plan is the one at the top of the next cell's ranking.""")
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
# ## Export the winner
#
# The plan with the smallest peak, written as a standalone snippet for a training script: run it
# after building the model, before building the optimizer (which should get only the trainable
# parameters).

# %%
ranking = sorted((e.measurement.peak_bytes, label) for label, e in entries.items())
winner_label = ranking[0][1]
winner = entries[winner_label].plan
print("winner:", winner_label, format_bytes(ranking[0][0]))
code = winner.to_code()
print(code)

# %% [markdown]
# ## What this notebook claims

# %%
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
