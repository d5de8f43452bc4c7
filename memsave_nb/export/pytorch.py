"""``Plan.to_code``'s snippet: plain PyTorch that makes a plan's choices on a model in a
training script (memory-saving layers, freezing, batch-norm eval, checkpointed and offloaded
regions, the parallel wrap, compile, the workload knobs).

Reads a plan's fields (it never imports the plan: ``plan.py`` calls it) and writes text.
"""

from __future__ import annotations

import inspect
import keyword
import textwrap
from typing import Any, Iterable

from memsave_nb.checkpointing import RegionKind, RegionPolicy, show
from memsave_nb.errors import PlanError
from memsave_nb.naming import memsave_include, selects

from memsave_nb.workload import DEFAULT_LOOP

from .hf import cache_off_code
from .knobs import knob_code, step_code
from .parallel import parallel_code
from .pipeline import pipeline_code

__all__ = ["plan_code"]


def plan_code(plan: Any, model_var: str = "model", loop: str = DEFAULT_LOOP) -> str:
    """A standalone snippet that makes ``plan``'s choices on ``model_var`` (see ``Plan.to_code``)."""
    if not isinstance(model_var, str) or not model_var.isidentifier() or keyword.iskeyword(model_var):
        raise PlanError(f"model_var {show(model_var)} is not a Python identifier")
    m = model_var
    # names reach the snippet only as literals (repr) or, in this comment, ASCII-escaped:
    # no newline or other control character can end the comment
    title = f"memsave_nb plan{': ' + plan.name if plan.name else ''} -- {plan.describe()}"
    lines: list[str] = [f"# {_comment(title)}"]
    imports = ["import torch"]
    body: list[str] = []
    needs_selects = bool(plan.frozen or plan.trainable or plan.bn_eval)
    if plan.memsave:
        imports.append("from memsave_nb.layers import convert")
        include = memsave_include(plan.memsave)
        call = f"convert({m})" if include is None else f"convert({m}, include={include!r})"
        body += ["", "# memory-saving layers, swapped in place", call]
    if plan.frozen or plan.trainable:
        body += [
            "",
            "# freezing: frozen first, then trainable (a module name selects all its parameters)",
            f"frozen = {list(plan.frozen)!r}",
            f"trainable = {list(plan.trainable)!r}",
            f"for name, param in {m}.named_parameters(remove_duplicate=False):",
            "    if selects(name, frozen):",
            "        param.requires_grad_(False)",
            f"for name, param in {m}.named_parameters(remove_duplicate=False):",
            "    if selects(name, trainable):",
            "        param.requires_grad_(True)",
        ]
    if plan.input_requires_grad is not None:
        body += [
            "",
            "# the batch: set requires_grad on its floating tensors (x.requires_grad_(True)) or not",
            f"input_requires_grad = {plan.input_requires_grad!r}",
        ]
    if plan.bn_eval:
        body += [
            "",
            "# batch norm in eval mode (running statistics, no batch statistics);",
            f"# {m}.train() turns it back on: repeat this after every {m}.train()",
            f"bn_eval = {list(plan.bn_eval)!r}",
            f"for name, module in {m}.named_modules():",
            "    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and selects(name, bn_eval):",
            "        module.eval()",
        ]
    regions = plan.active_regions
    if regions:
        imports.append("import functools")
        imports.append(
            "from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts"
        )
        body += ["", *cache_off_code(m)]
        helper = _CHECKPOINT_HELPER
        if plan.memsave:  # as Plan.apply's regions do: shrink held outputs before a region
            imports.append("from memsave_nb.layers import compact")
            helper = helper.replace(_REGION_ENTRY, _REGION_ENTRY + _COMPACT_AT_ENTRY)
        body += ["", "", "# activation checkpointing per region", *helper.splitlines(), ""]
        selective = list(dict.fromkeys(p for p in regions.values() if p.kind is RegionKind.SELECTIVE))
        policies = {p: "policy_fn" if len(selective) == 1 else f"policy_{i}" for i, p in enumerate(selective)}
        if selective:
            body += ["", "", *_OPS_HELPER.splitlines()]
        for policy, fn_name in policies.items():
            body += [""] + _policy_code(policy, fn_name).splitlines()
        body += ["", ""]
        if any(p.kind in (RegionKind.OFFLOAD, RegionKind.FULL_OFFLOAD) for p in regions.values()):
            body += [*_OFFLOAD_HELPER.splitlines(), "", ""]
        for region, policy in regions.items():
            target = f"{m}.get_submodule({region!r})" if region else m
            if policy.kind is RegionKind.OFFLOAD:
                body.append(f"offload_region({target})")
            elif policy.kind is RegionKind.FULL_OFFLOAD:  # offload outside: the checkpoint's kept inputs go
                body.append(f"checkpoint_region({target})")
                body.append(f"offload_region({target})")
            elif policy.kind is RegionKind.FULL:
                body.append(f"checkpoint_region({target})")
            else:
                body.append(f"checkpoint_region({target}, {policies[policy]})")
    pipeline = plan.parallel is not None and plan.parallel.pipeline_parallel > 1
    if pipeline:  # m becomes this rank's stages; the schedule's step replaces training_step below
        more_imports, more_body = pipeline_code(plan.parallel, m, loop)
        imports += more_imports
        body += more_body
    elif plan.parallel is not None:  # after the model's own changes, before compiling
        more_imports, more_body = parallel_code(plan.parallel, m)
        imports += more_imports
        body += more_body
    if plan.compile_budget is not None:
        imports.append("import torch._functorch.config")
        body += [
            "",
            "# torch.compile with an activation memory budget (0: recompute most, 1: default compile)",
            f"torch._functorch.config.activation_memory_budget = {plan.compile_budget!r}",
            f"{m} = torch.compile({m})",
        ]
    if plan.has_knobs:
        knob_imports, knob_body = knob_code(plan, m)
        imports += knob_imports
        body += knob_body
    if not pipeline:
        body += step_code(plan, m, loop)
    if needs_selects:
        imports.append("import fnmatch")
        source = inspect.getsource(selects).splitlines()
        source[0] = "def selects(name, patterns):"  # no annotations: the snippet runs anywhere
        body = ["", "", *source, ""] + body
    order = ("import fnmatch", "import functools", "import torch", "import torch._functorch.config")
    imports = sorted(set(imports), key=lambda line: (order.index(line) if line in order else len(order), line))
    return "\n".join(lines + imports + body) + "\n"


_CHECKPOINT_HELPER = textwrap.dedent(
    '''\
    def checkpoint_region(module, policy_fn=None):
        """Run module.forward under non-reentrant checkpointing; selective when policy_fn is given."""
        inner = module.forward
        if policy_fn is None:
            context_fn = None
        else:
            context_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)

        def forward(*args, **kwargs):
            if context_fn is None:
                return checkpoint(inner, *args, use_reentrant=False, **kwargs)
            return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        module.forward = forward'''
)


_REGION_ENTRY = "    def forward(*args, **kwargs):\n"
_COMPACT_AT_ENTRY = "        compact()  # memory-saving layers: outputs held before the region shrink to masks now\n"
assert _REGION_ENTRY in _CHECKPOINT_HELPER

_OPS_HELPER = textwrap.dedent(
    '''\
    def ops(names):
        """Op overload packets by name: "aten.mm" -> torch.ops.aten.mm."""
        packets = set()
        for name in names:
            namespace, op = name.split(".")
            packets.add(getattr(getattr(torch.ops, namespace), op))
        return packets'''
)


def _comment(text: str) -> str:
    """Text safe inside a ``#`` comment: printable ASCII only (``ascii()`` escapes the rest)."""
    return ascii(text)[1:-1]


_OFFLOAD_HELPER = textwrap.dedent(
    '''\
    def offload_region(module):
        """Keep what module.forward saves for backward in pinned host memory until backward, as
        torch.autograd.graph.save_on_cpu(pin_memory=True) does, but leave the module's own
        parameters (and views of them) on the device: moving them would free nothing."""
        inner = module.forward
        params = {id(p) for p in module.parameters()}

        def pack(t):
            if id(t) in params or (t._base is not None and id(t._base) in params):
                return t
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=t.is_cuda)
            host.copy_(t, non_blocking=True)
            return (t.device, host)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=True)

        def forward(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return inner(*args, **kwargs)

        module.forward = forward'''
)


def _policy_code(policy: RegionPolicy, fn_name: str) -> str:
    def ops_literal(names: Iterable[str]) -> str:  # names as string literals, resolved by ops()
        items = sorted(names)
        if not items:
            return "set()"
        return "ops([\n" + "".join(f"    {n!r},\n" for n in items) + "])"

    save = policy.saved_ops
    recompute = policy.recomputed_ops
    default = "CheckpointPolicy.MUST_SAVE" if policy.default.value == "save" else "CheckpointPolicy.PREFER_RECOMPUTE"
    upper = fn_name.upper()
    out = [
        f"{upper}_SAVE = {ops_literal(save)}",
        f"{upper}_RECOMPUTE = {ops_literal(recompute)}",
        "",
        "",
        f"def {fn_name}(ctx, op, *args, **kwargs):",
        "    if op._schema.is_mutable:  # in-place ops (batch-norm statistics): never cache a changing tensor",
        "        return CheckpointPolicy.PREFER_RECOMPUTE",
        "    # op is an OpOverload (aten.mm.default): compare its overload packet (aten.mm)",
        '    packet = getattr(op, "overloadpacket", None)',
        f"    if packet in {upper}_SAVE:",
        "        return CheckpointPolicy.MUST_SAVE",
        f"    if packet in {upper}_RECOMPUTE:",
        "        return CheckpointPolicy.PREFER_RECOMPUTE",
    ]
    if policy.default.value == "save":
        from memsave_nb.checkpointing import CREATION_OPS

        out[3:3] = [
            "",
            "# fresh buffers later filled in place (dropout masks) and views: cheap, never cached",
            f"CHEAP_OPS = {ops_literal(CREATION_OPS)}",
        ]
        out += [
            "    if packet in CHEAP_OPS or op.is_view:",
            "        return CheckpointPolicy.PREFER_RECOMPUTE",
        ]
    out.append(f"    return {default}")
    return "\n".join(out)
