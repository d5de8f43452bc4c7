"""The workload knobs in a training script: batch size, sequence length, precision, optimizer,
gradient accumulation and how grads are cleared."""

from __future__ import annotations

from typing import Any

from memsave_nb.errors import PlanError
from memsave_nb.knobs import KNOB_FIELDS

# -- code export -----------------------------------------------------------------------------

_OPTIMIZER_CODE = {
    "adamw": "torch.optim.AdamW(params, lr=1e-3)",
    "adamw_foreach": "torch.optim.AdamW(params, lr=1e-3, foreach=True)",
    "adamw_fused": "torch.optim.AdamW(params, lr=1e-3, fused=True)",
    "adam": "torch.optim.Adam(params, lr=1e-3)",
    "sgd_momentum": "torch.optim.SGD(params, lr=1e-2, momentum=0.9)",
    "sgd": "torch.optim.SGD(params, lr=1e-2)",
    "adafactor": "torch.optim.Adafactor(params, lr=1e-2)",
    "adamw_8bit": "bitsandbytes.optim.AdamW8bit(params, lr=1e-3)",
    "lion": "bitsandbytes.optim.Lion(params, lr=1e-3)",  # 32-bit state: the layout the knob sizes
    "lion_8bit": "bitsandbytes.optim.Lion8bit(params, lr=1e-3)",
    "adamw_8bit_embed32": "bitsandbytes.optim.AdamW8bit(params, lr=1e-3)",  # + the Trainer's override below
    "lion_8bit_embed32": "bitsandbytes.optim.Lion8bit(params, lr=1e-3)",
}


_AUTOCAST_CODE = {"autocast_bf16": "torch.bfloat16", "autocast_fp16": "torch.float16"}


def knob_code(plan: Any, m: str) -> tuple[list[str], list[str]]:
    """(imports, body lines) that make the knobs in a training script."""
    imports: list[str] = []
    body: list[str] = []
    if not any(getattr(plan, f) is not None for f in KNOB_FIELDS):
        return imports, body
    body += ["", "# workload knobs: use these in your data loader and training loop"]
    if plan.batch_size is not None:
        body.append(f"batch_size = {plan.batch_size!r}  # per micro-batch")
    if plan.seq_len is not None:
        body.append(f"seq_len = {plan.seq_len!r}  # cut or pad token tensors to this length")
    k = plan.accumulation_steps or 1
    body.append(f"accumulation_steps = {k!r}")
    body.append(f"set_to_none = {plan.set_to_none if plan.set_to_none is not None else True!r}")
    if plan.loss == "chunked":
        from memsave_nb.loss import DEFAULT_LOSS_CHUNK

        imports.append("from memsave_nb.loss import use_chunked_loss")
        body += [
            "# the loss through the LM head in chunks of tokens (as TRL's SFTTrainer): no batch x seq x vocab logits;",
            f"# {m}(**batch) with labels now returns an output with .loss only",
            f"use_chunked_loss({m}, chunk={plan.loss_chunk or DEFAULT_LOSS_CHUNK!r})",
        ]
    elif plan.loss is not None and plan.loss.startswith("trl_"):
        imports.append("from memsave_nb.loss_trl import use_trl_head")
        body += _trl_lines(plan.loss, m)
    elif plan.loss == "hf_smooth":
        imports.append("from memsave_nb.loss import use_label_smoother")
        body += [
            "# loss 'hf_smooth': Hugging Face Trainer's label smoother, set by TrainingArguments(label_smoothing_factor=0.1)",
            "# (any factor above 0 allocates the same); here the same full logits, log-softmax, gather and sum:",
            f"use_label_smoother({m}, epsilon=0.1)",
        ]
    precision = plan.precision or "fp32"
    if precision in ("bf16", "bf16_master"):
        body.append(f"{m}.to(torch.bfloat16)  # parameters and buffers in bf16; cast floating inputs too")
    body.append(f"params = [p for p in {m}.parameters() if p.requires_grad]")
    opt = _OPTIMIZER_CODE[plan.optimizer or "adamw"]
    if opt.startswith("bitsandbytes."):
        imports.append("import bitsandbytes.optim")
    if precision == "bf16_master":
        body += [
            "# fp32 master weights: the optimizer steps fp32 copies, the model keeps bf16",
            "masters = [p.detach().float().requires_grad_(True) for p in params]",
            "optimizer = " + opt.replace("(params", "(masters"),
        ]
    else:
        body.append("optimizer = " + opt)
    if (plan.optimizer or "").endswith("_embed32"):  # what HF Trainer.create_optimizer registers
        body += [
            "# nn.Embedding weights keep 32-bit optimizer state, as the HF Trainer registers them",
            f"for mod in {m}.modules():",
            "    if isinstance(mod, torch.nn.Embedding):",
            "        bitsandbytes.optim.GlobalOptimManager.get_instance().register_module_override(",
            '            mod, "weight", {"optim_bits": 32}',
            "        )",
        ]
    return imports, body


def _trl_lines(loss: str, m: str) -> list[str]:
    """The TRL settings a ``trl_*`` loss stands for, and the line that runs TRL's head here."""
    cuda, smoothing = loss.endswith("cuda"), "smooth" in loss
    fields = ["loss_type='nll'"] + (["label_smoothing_factor=0.1"] if smoothing else [])
    fields += [] if cuda else ["use_cpu=True"]
    return [
        f"# loss {loss!r}: TRL's fused LM head as SFTTrainer runs it "
        f"({'with Triton, on CUDA' if cuda else 'without Triton, on the CPU'}); in TRL set SFTConfig({', '.join(fields)})",
        f"# here {m}(**batch) with labels runs the same head and returns its loss",
        f"use_trl_head({m}, cuda={cuda!r}, smoothing={0.1 if smoothing else 0.0!r})",
    ]


_STEP_CODE = """\
def training_step(model, micro_batches, optimizer, loss_fn=lambda output: output.loss, set_to_none=True):
    \"\"\"One optimizer step over micro_batches (dicts of model inputs, tuples or tensors).\"\"\"
    k = len(micro_batches)
    for i, batch in enumerate(micro_batches):
        with FORWARD_CONTEXT:
            if isinstance(batch, dict):
                output = model(**batch)
            else:
                output = model(*batch) if isinstance(batch, (tuple, list)) else model(batch)
        loss = loss_fn(output)
        if k > 1:
            loss = loss / k
DROP_BEFORE_BACKWARD        loss.backward()
        if i < k - 1:
            output = loss = None
DROP_BEFORE_STEP    optimizer.step()
MASTERS_AFTER_STEP    del output, loss  # the loss lived to here: a trainer logs it
    model.zero_grad(set_to_none=set_to_none)"""


def step_code(plan: Any, m: str, loop: str) -> list[str]:
    """The training step the engine measures, as code: the workload's ``loop`` (how long the
    output lives), accumulation, autocast and fp32 master weights written as the engine runs them."""
    from memsave_nb.workload import LOOPS, output_dropped

    if loop not in LOOPS:
        raise PlanError(f"unknown loop {loop!r}; choose from {', '.join(LOOPS)}")
    autocast = _AUTOCAST_CODE.get(plan.precision or "fp32")
    before_backward = (
        "        output = None  # only the loss goes into backward\n" if output_dropped(loop, "backward") else ""
    )
    before_step = (
        "        else:\n            output = None  # kept through backward, dropped before the step\n"
        if output_dropped(loop, "step") and not output_dropped(loop, "backward")
        else ""
    )
    masters = ""
    if plan.precision == "bf16_master":
        before_step += (
            "    for p, master in zip(params, masters):  # fp32 gradients for the fp32 masters\n"
            "        master.grad = None if p.grad is None else p.grad.float()\n"
        )
        masters = (
            "    with torch.no_grad():\n"
            "        for p, master in zip(params, masters):\n"
            "            master.grad = None  # the fp32 master gradients go once the step is done\n"
            "            p.copy_(master)\n"
        )
    code = _STEP_CODE
    if autocast:
        code = code.replace(
            "FORWARD_CONTEXT", f"torch.autocast(next(model.parameters()).device.type, dtype={autocast})"
        )
    else:  # no autocast: the forward's lines without the with block
        head, rest = code.split("        with FORWARD_CONTEXT:\n")
        forward, tail = rest.split("        loss = loss_fn(output)")
        code = (
            head + "".join(line[4:] + "\n" for line in forward.splitlines()) + "        loss = loss_fn(output)" + tail
        )
    code = (
        code.replace("DROP_BEFORE_BACKWARD", before_backward)
        .replace("DROP_BEFORE_STEP", before_step)
        .replace("MASTERS_AFTER_STEP", masters)
    )
    call = (
        f"# training_step({m}, micro_batches, optimizer, set_to_none=set_to_none)"
        if plan.has_knobs
        else f"# training_step({m}, [batch], optimizer)"
    )
    return [
        "",
        "",
        f"# the training step memsave_nb measured (loop {loop!r}: {LOOPS[loop]})",
        *code.splitlines(),
        "",
        "",
        call,
    ]
