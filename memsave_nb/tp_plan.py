"""A tensor-parallel plan as module names and PyTorch ``ParallelStyle`` objects.

Plain functions of a model (no process group, no fake mode): ``parallel/tp.py`` sizes with them and
``export/parallel.py`` writes their source into the training script, so both split the same modules
the same way. Styles are named in ``parallel_spec.TP_STYLES``.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

COLWISE = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "qkv",
        "query",
        "key",
        "value",
        "wq",
        "wk",
        "wv",
        "gate_proj",
        "up_proj",
        "gate",
        "up",
        "fc",
        "fc1",
        "w1",
        "w3",
    }
)
ROWWISE = frozenset({"o_proj", "out_proj", "proj", "down_proj", "down", "fc2", "w2", "wo"})
EMBEDDINGS = frozenset({"wte", "embed_tokens", "tok_embeddings"})  # when the model does not say
HEADS = frozenset({"head", "lm_head", "output"})
POSITIONS = frozenset({"wpe"})  # a learned position table added to the token embedding (GPT-2, the zoo GPT)


def default_tp_plan(model, sequence_parallel=False):
    """``(module name, style)`` for every module the default decoder plan splits (by the last part
    of the name; the embedding and head as the model's get_input/output_embeddings say)."""

    def leaf(name):
        return name.rsplit(".", 1)[-1]

    def ask(method):
        get = getattr(model, method, None)
        return get() if callable(get) else None

    emb, head = ask("get_input_embeddings"), ask("get_output_embeddings")
    plan = []
    wrapped = set()  # peft's LoRA layers: the base linear split as named, lora_B / lora_A to match
    for name, mod in model.named_modules():
        linear = isinstance(mod, nn.Linear)
        if not name or name in wrapped:
            continue
        base = getattr(mod, "base_layer", None)
        if isinstance(base, nn.Linear) and (leaf(name) in COLWISE or leaf(name) in ROWWISE) and mod is not head:
            col = leaf(name) in COLWISE  # colwise: lora_B splits its outputs; rowwise: lora_A its inputs
            plan.append((name + ".base_layer", "colwise" if col else "rowwise"))
            wrapped.add(name + ".base_layer")
            for adapter in getattr(mod, "lora_B" if col else "lora_A", {}):
                plan.append((f"{name}.lora_{'B' if col else 'A'}.{adapter}", "colwise" if col else "rowwise"))
                wrapped.add(plan[-1][0])
            continue
        if mod is emb or (emb is None and isinstance(mod, nn.Embedding) and leaf(name) in EMBEDDINGS):
            plan.append((name, "embedding"))
        elif mod is head or (head is None and linear and leaf(name) in HEADS):
            plan.append((name, "head"))
        elif linear and leaf(name) in COLWISE:
            plan.append((name, "colwise"))
        elif linear and leaf(name) in ROWWISE:
            plan.append((name, "rowwise"))
        elif sequence_parallel and isinstance(mod, nn.Embedding) and leaf(name) in POSITIONS:
            plan.append((name, "positions"))
        elif sequence_parallel and (
            isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) or type(mod).__name__.endswith("RMSNorm")
        ):
            plan.append((name, "norm"))
    if sequence_parallel:  # as torchtitan: attention and MLP gather the sequence once, at their input
        modules = dict(model.named_modules())
        parents = [p for p in dict.fromkeys(n.rpartition(".")[0] for n, style in plan if style == "colwise") if p]
        # a norm inside a gathered module (Qwen3's q_norm / k_norm on each head) sees the whole sequence
        plan = [(n, style) for n, style in plan if style != "norm" or not any(n.startswith(p + ".") for p in parents)]
        plan += [(p, "gather_hidden_states" if _takes_hidden_states(modules[p]) else "gather_input") for p in parents]
    return plan


def _takes_hidden_states(module):
    """Hugging Face attention is called with ``hidden_states=`` as a keyword (its decoder layers
    call ``self_attn(hidden_states=..., position_embeddings=..., ...)``); other modules positionally."""
    import inspect

    params = list(inspect.signature(module.forward).parameters)
    return bool(params) and params[0] == "hidden_states" and "position_embeddings" in params


def matched_tp_plan(model, rules):
    """A user plan's ``(pattern, style)`` rules as module names (the first matching rule wins)."""
    plan = {}
    for pattern, style in rules:
        for name, _ in model.named_modules():
            if name and name not in plan and fnmatch.fnmatchcase(name, pattern):
                plan[name] = style
    return list(plan.items())


def tp_styles(plan: list[tuple[str, str]], sequence_parallel: bool) -> dict[str, Any]:
    """PyTorch ``ParallelStyle`` objects for ``parallelize_module``, torchtitan's layouts.

    Under sequence parallel the residual stream is sharded on dim 1 (the sequence): a module marked
    ``gather_input`` all-gathers its first input once, and the column-wise layers inside it take it
    whole; a column-wise layer without such a parent gathers its own input.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    seq = Shard(1) if sequence_parallel else Replicate()
    gathered = {name for name, style in plan if style in ("gather_input", "gather_hidden_states")}

    def colwise(name):
        whole = not sequence_parallel or name.rpartition(".")[0] in gathered
        return ColwiseParallel(input_layouts=Replicate() if whole else seq)

    make = {
        "colwise": colwise,
        "rowwise": lambda name: RowwiseParallel(output_layouts=seq, use_local_output=not sequence_parallel),
        "embedding": lambda name: RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq, use_local_output=not sequence_parallel
        ),
        "head": lambda name: ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
        "norm": lambda name: SequenceParallel(),
        # positions (T, C) split over T: a Shard(0) DTensor that adds to the (B, T, C) Shard(1) embedding
        "positions": lambda name: RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(0), use_local_output=False
        ),
        "gather_input": lambda name: PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "gather_hidden_states": lambda name: PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        ),
    }
    return {name: make[style](name) for name, style in plan}
