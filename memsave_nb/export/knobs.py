"""The workload knobs in a training script: batch size, sequence length, precision, optimizer,
gradient accumulation and how grads are cleared."""

from __future__ import annotations

from typing import Any

from memsave_nb.knobs import KNOB_FIELDS

# -- code export -----------------------------------------------------------------------------

_OPTIMIZER_CODE = {
    "adamw": "torch.optim.AdamW(params, lr=1e-3)",
    "adamw_foreach": "torch.optim.AdamW(params, lr=1e-3, foreach=True)",
    "adamw_fused": "torch.optim.AdamW(params, lr=1e-3, fused=True)",
    "sgd_momentum": "torch.optim.SGD(params, lr=1e-2, momentum=0.9)",
    "sgd": "torch.optim.SGD(params, lr=1e-2)",
    "adafactor": "torch.optim.Adafactor(params, lr=1e-2)",
    "adamw_8bit": "bitsandbytes.optim.AdamW8bit(params, lr=1e-3)",
}


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
    precision = plan.precision or "fp32"
    autocast = None
    if precision == "autocast_bf16":
        autocast = "torch.bfloat16"
    elif precision == "autocast_fp16":
        autocast = "torch.float16"
    if precision in ("bf16", "bf16_master"):
        body.append(f"{m}.to(torch.bfloat16)  # parameters and buffers in bf16; cast floating inputs too")
    body.append(f"params = [p for p in {m}.parameters() if p.requires_grad]")
    opt = _OPTIMIZER_CODE[plan.optimizer or "adamw"]
    if plan.optimizer == "adamw_8bit":
        imports.append("import bitsandbytes.optim")
    if precision == "bf16_master":
        body += [
            "# fp32 master weights: the optimizer steps fp32 copies, the model keeps bf16",
            "masters = [p.detach().float().requires_grad_(True) for p in params]",
            "optimizer = " + opt.replace("(params", "(masters"),
        ]
    else:
        body.append("optimizer = " + opt)
    ctx = f"torch.autocast(device_type=device, dtype={autocast})" if autocast else None
    body += [
        "",
        "# for step, micro_batches in enumerate(batches):  # accumulation_steps micro-batches each",
        "#     for batch in micro_batches:",
        f"#         {'with ' + ctx + ':' if ctx else ''}",
        f"#         {'    ' if ctx else ''}loss = loss_fn({m}(batch)) / accumulation_steps",
        "#         loss.backward()",
    ]
    if precision == "bf16_master":
        body += [
            "#     for p, master in zip(params, masters): master.grad = p.grad.float()",
            "#     optimizer.step()",
            "#     with torch.no_grad():",
            "#         for p, master in zip(params, masters): p.copy_(master)",
            "#     for p in params: p.grad = None",
        ]
    else:
        body += ["#     optimizer.step()", "#     optimizer.zero_grad(set_to_none=set_to_none)"]
    body = [line.replace("#         \n", "") for line in body]
    body = [line for line in body if line.strip() != "#"]
    return imports, body
