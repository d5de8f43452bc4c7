"""The names of every choice a user makes, one list per setting, each member with one line.

Why one module: the same choice used to be listed in several places with different members
(``Workload`` took "adam" and refused "adafactor", ``Plan`` the opposite). ``Workload``, ``Plan``
and its knobs, the CLI, the magics, the trainers' configs and the UI all read these dicts, so a
new optimizer, precision or loss is added here once. It imports nothing, so it sits at the
bottom of the import graph and any module may read it. Each dict maps name -> one-line meaning,
in menu order.
"""

from __future__ import annotations

__all__ = [
    "OPTIMIZERS",
    "NO_OPTIMIZER",
    "OPTIMIZER_ALIASES",
    "OPTIMIZER_STATE",
    "PRECISIONS",
    "REGION_KINDS",
    "SEARCHED_REGION_KINDS",
    "LOOPS",
    "DEFAULT_LOOP",
    "LOSSES",
    "STRATEGIES",
    "SCHEDULES",
]

# Optimizers: how each is built and what state it keeps per trainable parameter (its layout).
OPTIMIZERS: dict[str, str] = {
    "adamw": "torch.optim.AdamW(lr=1e-3), torch picks foreach/fused; state: exp_avg, exp_avg_sq (param dtype) + step",
    "adamw_foreach": "torch.optim.AdamW(lr=1e-3, foreach=True); state: exp_avg, exp_avg_sq + step",
    "adamw_fused": "torch.optim.AdamW(lr=1e-3, fused=True); state: exp_avg, exp_avg_sq + step",
    "adam": "torch.optim.Adam(lr=1e-3); state: exp_avg, exp_avg_sq + step (same bytes as AdamW)",
    "sgd_momentum": "torch.optim.SGD(lr=1e-2, momentum=0.9); state: one momentum buffer",
    "sgd": "torch.optim.SGD(lr=1e-2); no state",
    "adafactor": "torch.optim.Adafactor(lr=1e-2); state: factored second moments (a row and a column per matrix)",
    "adamw_8bit": "AdamW in bitsandbytes' blockwise 8-bit layout, in plain torch (optimizers_extra; fake mode runs it); "
    "state: two uint8 moments + a float32 absmax per 256 elements",
    "lion": "Lion (optimizers_extra); state: one moment per parameter (float32)",
    "lion_8bit": "Lion in bitsandbytes' blockwise 8-bit layout (optimizers_extra); state: one uint8 moment + absmax",
    "adamw_8bit_embed32": "adamw_8bit as the HF Trainer builds it (optim='adamw_bnb_8bit' and the other 8-bit "
    "bitsandbytes names): every nn.Embedding weight keeps two float32 moments (create_optimizer's override)",
    "lion_8bit_embed32": "lion_8bit as the HF Trainer builds it (optim='lion_8bit', 'paged_lion_8bit'): every "
    "nn.Embedding weight keeps one float32 moment (create_optimizer's override)",
}
# Each optimizer's state layout, as OPTIMIZERS words it: (moments per trainable parameter, bits per
# moment; 0 = the parameter's own dtype). Step counters, blockwise scales (absmax) and factored
# rows/columns are left out: what a bound computed before any step may count (layout_estimate.py).
OPTIMIZER_STATE: dict[str, tuple[int, int]] = {
    "adamw": (2, 0),
    "adamw_foreach": (2, 0),
    "adamw_fused": (2, 0),
    "adam": (2, 0),
    "sgd_momentum": (1, 0),
    "sgd": (0, 0),
    "adafactor": (0, 0),
    "adamw_8bit": (2, 8),
    "lion": (1, 32),
    "lion_8bit": (1, 8),
    "adamw_8bit_embed32": (2, 8),  # the embeddings' 32-bit moments are above this lower bound
    "lion_8bit_embed32": (1, 8),
}
# "no optimizer" (a forward and backward only): a Workload's and the magics' value, not a plan knob
NO_OPTIMIZER = "none"
# old spellings still accepted -> the registered name
OPTIMIZER_ALIASES: dict[str, str] = {"sgd-nomomentum": "sgd"}

PRECISIONS: dict[str, str] = {
    "fp32": "float32 parameters, no autocast",
    "autocast_bf16": "fp32 parameters, forward under torch.autocast(bfloat16)",
    "autocast_fp16": "fp32 parameters, forward under torch.autocast(float16)",
    "bf16": "parameters, buffers and batch held in bfloat16 (optimizer state follows)",
    "bf16_master": "bf16 parameters and gradients + fp32 master weights kept by the optimizer",
}

# Activation-checkpointing region kinds: the presets of checkpointing.POLICY_PRESETS and the editor's menu
REGION_KINDS: dict[str, str] = {
    "none": "no checkpoint: autograd keeps what the region saves",
    "full": "full checkpoint: keep the region's inputs, recompute all in backward",
    "save_matmuls": "selective: keep matmul outputs, recompute the rest",
    "save_compute_intensive": "selective: keep matmuls, attention and convolutions, recompute the rest",
    "recompute_all": "selective with every op recomputed",
    "offload": "keep what the region saves on the host (CPU) until backward",
    "full_offload": "full checkpoint with its kept inputs on the host until backward "
    "(TRL's activation_offloading with gradient checkpointing)",
}
# the kinds the single-GPU planner tries on every region (the layout search leaves out "offload")
SEARCHED_REGION_KINDS = ("full", "save_matmuls", "offload")

# How long the model's output lives in the training loop (the loss always lives to the end of the
# step: a trainer keeps it to log it). The output of a causal LM holds its logits and KV cache, which
# autograd did not save: dropping it before backward frees them for the whole backward pass.
LOOPS: dict[str, str] = {
    "loss_only": "the output is dropped once the loss is computed: only the loss goes into backward "
    "(Hugging Face's Trainer, TRL, the exported code)",
    "keep_output_backward": "the output is kept through backward and dropped before the optimizer step",
    "keep_output_step": "the output is kept through backward and the optimizer step "
    "(out = model(**batch); out.loss.backward(); opt.step())",
}
DEFAULT_LOOP = "loss_only"

LOSSES: dict[str, str] = {
    "full": "the model's own loss over the whole batch x seq x vocab logits",
    "chunked": "cross-entropy through the LM head in chunks of tokens (TRL's SFTTrainer default): no full logits",
    # TRL's fused head as TRL runs it, per device (memsave_nb.loss_trl)
    "trl_cpu": "TRL's fused LM head as it runs without Triton (CPU): every position, torch folds, a tokens x 32768 tile",
    "trl_cuda": "TRL's fused LM head as it runs with Triton (CUDA): valid positions only, tiles folded in place",
    "trl_smooth_cpu": "TRL with label smoothing (CPU): full logits through the smoother, then a no-grad fused pass",
    "trl_smooth_cuda": "TRL with label smoothing (CUDA): full logits through the smoother, then a no-grad fused pass",
    # Hugging Face Trainer's label_smoothing_factor > 0 (memsave_nb.loss)
    "hf_smooth": "Hugging Face Trainer's label smoother: the model's full logits, their log-softmax, gather and sum",
}

# Data-parallel strategies (parallel/apply.py applies them; a new style is one entry here and its branch there)
STRATEGIES: dict[str, str] = {
    "fsdp": "FSDP2 fully_shard: parameters, gradients and optimizer state sharded over the ranks",
    "ddp": "DistributedDataParallel: a whole replica per rank, gradients all-reduced in buckets",
}

# Pipeline schedules -> the torch.distributed.pipelining class that runs them
SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}
