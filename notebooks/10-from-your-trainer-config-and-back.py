# %% [markdown]
# # 10. From your trainer config and back
#
# You fine-tune through a trainer, not a hand-written loop. Here is a TRL `SFTConfig` for
# Qwen2.5-3B (3.1 B parameters, a 151,936-token vocabulary) on one 24 GB card: batch 4 of 2048
# tokens, bf16, gradient checkpointing off because it is slow. Does it fit, and if not, what
# should the config say instead?
#
# This notebook answers it without the GPU, in fake mode (shapes and bytes, no compute); every
# size it prints is in binary units (GiB = 2^30 bytes):
#
# 1. the config **imported** as the plan `SFTTrainer` would run (`memsave_nb.from_trainer`),
#    measured against the 24 GB target (the allocator replay: the card less the CUDA context);
# 2. the peak **explained**: the optimizer step (weights, gradients, AdamW state), the logits that
#    TRL's chunked loss never builds, and the activations;
# 3. **fixed**: LoRA adapters for the optimizer step, the planner for the activations;
# 4. the fix **exported** back as an `SFTConfig` and a peft `LoraConfig` (`memsave_nb.to_trainer`),
#    then that config imported again and re-measured under the target.

# %%
import re

import pandas as pd
from peft import LoraConfig
from trl import SFTConfig

import memsave_nb
from memsave_nb import from_trainer, to_trainer, Target
from memsave_nb.target import fit_of, measure_peak
from memsave_nb.ui.format import format_bytes

GiB = 2**30
target = Target(24)
# the model from the catalogue, built on the meta device (no memory), bf16 as it is published
workload = memsave_nb.from_pretrained("qwen2.5-3b", batch_size=4, seq_len=2048)
model = workload.model
n_params = sum(p.numel() for p in model.parameters())
vocab = model.config.vocab_size
print(f"{n_params / 1e9:.2f} B parameters, vocabulary {vocab:,}; {target.line()}")

# %% [markdown]
# ## Your config, imported
#
# The fields are what you would write (`activation_checkpointing`, transformers' current name for
# `gradient_checkpointing`). `SFTConfig` checks them here with `use_cpu=True` only because this
# machine has no GPU (it refuses bf16 without one); the fields themselves are imported, so the plan
# is the step as it runs on your GPU (with `use_cpu` TRL would run its head's CPU path, and the plan
# would size that one).

# %%
import warnings

my_fields = dict(per_device_train_batch_size=4, max_length=2048, activation_checkpointing=False, learning_rate=2e-5)
with warnings.catch_warnings(record=True) as config_warnings:
    warnings.simplefilter("always")
    config = SFTConfig(output_dir="out", use_cpu=True, **my_fields)  # the fields, checked as SFTConfig checks them
imported = from_trainer(my_fields, model, trainer="trl")
print(imported.plan.describe())
for note in imported.notes:
    print("-", note)
mine = measure_peak(workload, imported.plan)
print(f"peak {mine.peak_bytes / GiB:.1f} GiB during {mine.peak_phase}: {fit_of(target, mine).verdict(target)}")

# %% [markdown]
# The plan is what `SFTTrainer` runs: batch 4 x 2048, pure bf16 (the model is loaded in bf16 and
# `bf16=True`), fused AdamW (`optim`'s default), no checkpointing, and TRL's loss: `loss_type="nll"`
# in trl 1.16 goes through its fused LM head, which projects 4096 tokens x 32768 vocabulary
# entries at a time and never builds the `batch x seq x vocab` logits (`"chunked_nll"` is now a
# deprecated alias). The plan sizes that head as TRL runs it on a GPU (`loss="trl_cuda"`), in the
# measured step.
#
# ## Where the peak comes from
#
# Three parts, each measured: the optimizer step's tensors (weights, gradients, AdamW's two
# moments: all of them alive from the optimizer step of one step into the next), the logits (the
# same config with the model's own full loss, as a plain `Trainer` would compute it), and what
# autograd keeps for backward.

# %%
full_loss = measure_peak(workload, imported.plan.replace(loss="full", loss_chunk=None))


def held(m, category):  # the most of one category alive at any moment of the step
    return max(m.timeline.by_category[category], default=0)


def gib(n):  # one decimal and its unit (GiB, or MiB for LoRA's small state): bare floats read "58.213472"
    return format_bytes(n)


def split(m):
    s = m.peak_split
    return {
        "peak": gib(m.peak_bytes),
        "weights": gib(s.parameters),
        "grads + AdamW state (most held)": gib(held(m, "gradients") + held(m, "optimizer_state")),
        "activations at peak": gib(s.activations),
        "temporaries at peak": gib(s.temporaries),
        "on 24 GB": "fits" if fit_of(target, m).fits else "does not fit",
    }


optimizer_step = mine.peak_split.parameters + held(mine, "gradients") + held(mine, "optimizer_state")
logits_bytes = 4 * 2048 * vocab * 4  # one float32 batch x seq x vocab tensor
pd.DataFrame({"your config (TRL's chunked loss)": split(mine), "same, full loss (plain Trainer)": split(full_loss)}).T

# %% [markdown]
# - **The optimizer step** alone, weights + gradients + AdamW state, 8 bytes per parameter in pure
#   bf16, is over the headroom line before a single activation: no checkpointing fixes that. Only
#   training fewer parameters does (LoRA), or sharding them over more GPUs (notebook 8).
# - **The logits.** The full loss would add several `4 x 2048 x 151,936` float32 tensors (the
#   widened logits, the log-softmax it keeps, their gradients): TRL's chunked loss already saves
#   that, and the plan measures it instead of assuming it.
# - **The activations** of 36 layers at 8,192 tokens, kept for backward without checkpointing, are
#   the largest part of the peak: that is the planner's job.

# %%
print(f"optimizer step: {optimizer_step / GiB:.1f} GiB against a {target.usable_bytes / GiB:.1f} GiB line")
print(
    f"full loss: +{(full_loss.peak_bytes - mine.peak_bytes) / GiB:.1f} GiB "
    f"({(full_loss.peak_bytes - mine.peak_bytes) / logits_bytes:.1f} float32 logits tensors of {logits_bytes / GiB:.2f} GiB)"
)
print(f"activations at the peak: {mine.peak_split.activations / GiB:.1f} GiB")

# %% [markdown]
# ## The fix: LoRA, then the planner
#
# The same model with rank-16 LoRA adapters (peft, on the meta device too), and the same config
# imported on it. Then the planner (`memsave_nb.planner.plan_for`) starts from that plan and
# searches checkpointing per layer and micro-batching, estimating each candidate's peak from a
# few measured steps and its time from an RTX 4090's roofline.

# %%
from memsave_nb import plan_for

lora_workload = memsave_nb.from_pretrained("qwen2.5-3b", batch_size=4, seq_len=2048, lora="r=16,alpha=32")
lora_model = lora_workload.model
lora_imported = from_trainer(my_fields, lora_model, trainer="trl")
lora_only = measure_peak(lora_workload, lora_imported.plan)
print(
    f"LoRA, your config otherwise: peak {lora_only.peak_bytes / GiB:.1f} GiB: {fit_of(target, lora_only).verdict(target)}"
)
result = plan_for(
    lora_workload,
    target,
    device="RTX 4090",
    base_plan=lora_imported.plan,
    precisions=(lora_imported.plan.precision,),
    region_kinds=("full",),
    micro_batches=(1, 2),
    remeasure=0,
)
print(result.summary().splitlines()[0])
fastest = result.fitting[0]  # candidates come fastest first
print(f"the fastest that fits (estimated): {fastest.plan.describe()}, {fastest.est_peak_bytes / GiB:.1f} GiB")

# %% [markdown]
# ## Back to your trainer
#
# A trainer's config cannot say everything a plan can: `SFTTrainer` checkpoints every n-th layer
# (`gradient_checkpointing_kwargs={"every_n_layers": n}`), not any set of layers. `to_trainer`
# says so in a note for each choice it cannot write exactly, and writes the nearest config that
# keeps at least as much memory back. Here we take, among the planner's candidates that fit, the
# fastest one the config holds exactly (exported and read back, it is the same plan), and export
# it: `SFTConfig` fields and, for the adapters, the peft `LoraConfig`.


# %%
def exact(candidate):  # the config holds every choice of this plan: it reads back as the same plan
    fields = to_trainer(candidate.plan, "trl", model=lora_model).fields
    return from_trainer(fields, lora_model, trainer="trl").plan == candidate.plan.replace(name="trl")


chosen = min((c for c in result.fitting if exact(c)), key=lambda c: c.est_seconds)
print(
    "chosen:",
    chosen.plan.describe(),
    f"(estimated {chosen.est_seconds * 1e3:.0f} ms per step, "
    f"{chosen.est_seconds / fastest.est_seconds:.2f}x the fastest that fits)",
)
exported = to_trainer(chosen.plan, "trl", model=lora_model)
print(exported.text)
for note in exported.notes:
    print("-", note)
fixed_config = SFTConfig(output_dir="out", learning_rate=2e-5, use_cpu=True, **exported.fields)  # checked as above
peft_config = LoraConfig(**memsave_nb.trainers.lora_settings(lora_model), task_type="CAUSAL_LM")
print(
    f"LoraConfig(r={peft_config.r}, lora_alpha={peft_config.lora_alpha}, target_modules={sorted(peft_config.target_modules)})"
)
# SFTTrainer(model="Qwen/Qwen2.5-3B", args=fixed_config, peft_config=peft_config, train_dataset=...)

# %% [markdown]
# And the loop closed: the exported fields imported again, as `SFTTrainer` would run them on the
# LoRA model on your GPU, and measured.

# %%
again = from_trainer(exported.fields, lora_model, trainer="trl")
print(again.plan.describe())
fixed = measure_peak(lora_workload, again.plan)
print(f"fixed config: peak {fixed.peak_bytes / GiB:.1f} GiB: {fit_of(target, fixed).verdict(target)}")
summary = pd.DataFrame(
    {
        "your config": split(mine),
        "LoRA, your config otherwise": split(lora_only),
        "fixed config + LoraConfig": split(fixed),
    }
).T
summary

# %% [markdown]
# ## What this notebook claims

# %%
# your config does not fit 24 GB, and its optimizer step alone is over the headroom line
assert not fit_of(target, mine).fits
assert optimizer_step > target.usable_bytes and optimizer_step >= 8 * n_params
# TRL's loss never builds the logits: the full loss would hold at least two more float32 logits tensors
assert imported.plan.loss == "trl_cuda"
assert full_loss.peak_bytes - mine.peak_bytes >= 2 * logits_bytes
# without checkpointing, the activations are the largest part of the peak
assert mine.peak_split.activations > 0.5 * mine.peak_bytes
# LoRA removes the optimizer step's gradients and state (< 2%), not the activations
lora_state = held(lora_only, "gradients") + held(lora_only, "optimizer_state")
assert lora_state < 0.02 * (held(mine, "gradients") + held(mine, "optimizer_state"))
assert not fit_of(target, lora_only).fits
# the planner found plans that fit; the exported plan is one of them, the fastest the config holds exactly
assert len(result.fitting) >= 10 and chosen in result.fitting and chosen.est_seconds >= fastest.est_seconds
# the exported SFTConfig keeps TRL's loss and the batch's tokens; the LoraConfig is the adapters'
assert fixed_config.loss_type == "nll" and fixed_config.max_length == 2048
assert fixed_config.per_device_train_batch_size * fixed_config.gradient_accumulation_steps == 4
assert peft_config.r == 16 and peft_config.lora_alpha == 32
# re-imported, the fixed config fits the target, measured
assert again.plan == chosen.plan.replace(name="trl") and again.plan.loss == "trl_cuda"
assert fit_of(target, fixed).fits
# the tables say their unit on every size; the config this notebook writes uses no deprecated field
assert all(re.fullmatch(r"\d+(\.\d)? (B|KiB|MiB|GiB)", v) for v in summary.drop(columns="on 24 GB").to_numpy().flat)
assert not [w for w in config_warnings if "deprecated" in str(w.message)], [str(w.message) for w in config_warnings]
print("all claims hold")
