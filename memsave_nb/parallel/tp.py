"""Tensor parallel: a ``ParallelSpec``'s TP plan resolved on a model and applied with PyTorch's
``parallelize_module`` on the mesh's ``tp`` dimension.

The default plan is the Megatron / torchtitan one for decoders: attention q, k, v (or a fused
qkv) and the MLP's up / gate column-wise, the attention output and MLP down row-wise (one
all-reduce after each), the input embedding row-wise over the vocabulary (token ids replicated),
the output head column-wise with the logits gathered (no loss parallel); with sequence parallel the
norms run on sequence shards and the row-wise outputs are reduce-scattered over the sequence.
Module names are matched by their last part, so Hugging Face Llama/Mistral/Qwen-style decoders
and the zoo GPT get it without a plan of their own; a user plan names modules by pattern.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

from ..parallel_spec import ParallelError, ParallelSpec

COLWISE = frozenset({"q_proj", "k_proj", "v_proj", "qkv", "query", "key", "value", "wq", "wk", "wv",
                     "gate_proj", "up_proj", "gate", "up", "fc", "fc1", "w1", "w3"})
ROWWISE = frozenset({"o_proj", "out_proj", "proj", "down_proj", "down", "fc2", "w2", "wo"})
EMBEDDINGS = frozenset({"wte", "embed_tokens", "tok_embeddings"})  # when the model does not say
HEADS = frozenset({"head", "lm_head", "output"})


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
    for name, mod in model.named_modules():
        linear = isinstance(mod, nn.Linear)
        if not name:
            continue
        if mod is emb or (emb is None and isinstance(mod, nn.Embedding) and leaf(name) in EMBEDDINGS):
            plan.append((name, "embedding"))
        elif mod is head or (head is None and linear and leaf(name) in HEADS):
            plan.append((name, "head"))
        elif linear and leaf(name) in COLWISE:
            plan.append((name, "colwise"))
        elif linear and leaf(name) in ROWWISE:
            plan.append((name, "rowwise"))
        elif sequence_parallel and (isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) or type(mod).__name__.endswith("RMSNorm")):
            plan.append((name, "norm"))
    return plan


def matched_tp_plan(model, rules):
    """A user plan's ``(pattern, style)`` rules as module names (the first matching rule wins)."""
    plan = {}
    for pattern, style in rules:
        for name, _ in model.named_modules():
            if name and name not in plan and fnmatch.fnmatchcase(name, pattern):
                plan[name] = style
    return list(plan.items())


def resolve_tp_plan(model: nn.Module, spec: ParallelSpec) -> list[tuple[str, str]]:
    """The spec's plan as concrete module names (its patterns expanded), checked against ``model``."""
    if not spec.tp_plan:
        plan = default_tp_plan(model, spec.sequence_parallel)
        if not any(s == "colwise" for _, s in plan):
            raise ParallelError("tensor_parallel: no attention or MLP projections found for the default plan; pass tp_plan")
    else:
        names = [n for n, _ in model.named_modules() if n]
        for pattern, _ in spec.tp_plan:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise ParallelError(f"tp_plan: no module matches {pattern!r}")
        plan = matched_tp_plan(model, spec.tp_plan)
    modules = dict(model.named_modules())
    for name, style in plan:
        mod = modules[name]
        if style == "norm":
            continue
        if not isinstance(mod, (nn.Linear, nn.Embedding)):
            raise ParallelError(f"tp_plan: {name!r} is a {type(mod).__name__}; style {style!r} splits a Linear or Embedding")
    _check_divisible(model, plan, spec.tensor_parallel)
    return plan


def _sharded_dims(mod: nn.Module, style: str) -> dict[str, int | None]:
    """Parameter name -> the dim TP splits (None: replicated), as PyTorch's styles shard them."""
    if style == "norm":
        return {n: None for n, _ in mod.named_parameters(recurse=False)}
    # torch shards an Embedding's weight on dim 1 column-wise and dim 0 row-wise; a Linear's on
    # dim 0 column-wise (its bias too) and dim 1 row-wise (its bias replicated)
    colwise = style in ("colwise", "head")
    if isinstance(mod, nn.Embedding):
        return {"weight": 1 if colwise else 0}
    return {"weight": 0 if colwise else 1, "bias": 0 if colwise else None}


def _check_divisible(model: nn.Module, plan: list[tuple[str, str]], tp: int) -> None:
    modules = dict(model.named_modules())
    for name, style in plan:
        mod = modules[name]
        for pname, dim in _sharded_dims(mod, style).items():
            p = getattr(mod, pname, None)
            if p is not None and dim is not None and p.shape[dim] % tp:
                raise ParallelError(f"tensor_parallel {tp} does not divide {name}.{pname} dim {dim} ({p.shape[dim]})")
    heads = []
    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads", "n_head"):
        heads.append((attr, getattr(config, attr, None)))
    heads += [("n_head", getattr(m, "n_head", None)) for m in model.modules()]
    for attr, n in heads:
        if isinstance(n, int) and n % tp:
            raise ParallelError(f"tensor_parallel {tp} does not divide {attr} ({n}): each rank holds whole heads")


def tp_local_shapes(model: nn.Module, spec: ParallelSpec) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape on one TP rank (every TP rank alike: the split dims divide evenly)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if spec.tensor_parallel == 1:
        return shapes
    modules = dict(model.named_modules())
    for name, style in resolve_tp_plan(model, spec):
        for pname, dim in _sharded_dims(modules[name], style).items():
            full = f"{name}.{pname}" if name else pname
            if dim is not None and full in shapes:
                s = list(shapes[full])
                s[dim] //= spec.tensor_parallel
                shapes[full] = tuple(s)
    return shapes


def tp_styles(plan: list[tuple[str, str]], sequence_parallel: bool) -> dict[str, Any]:
    """PyTorch ``ParallelStyle`` objects for ``parallelize_module``, torchtitan's layouts."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    seq = Shard(1) if sequence_parallel else Replicate()
    make = {
        "colwise": lambda: ColwiseParallel(input_layouts=seq),
        "rowwise": lambda: RowwiseParallel(output_layouts=seq),
        "embedding": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": lambda: ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
        "norm": SequenceParallel,
    }
    return {name: make[style]() for name, style in plan}


def apply_tensor_parallel(model: nn.Module, spec: ParallelSpec, tp_mesh: Any) -> nn.Module:
    """``parallelize_module`` with the spec's plan on the ``tp`` mesh (in place)."""
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, tp_mesh, tp_styles(resolve_tp_plan(model, spec), spec.sequence_parallel))


def measure_tp_rank(workload, spec: ParallelSpec, plan: Any = None, *, rank: int = 0,
                    ranks: tuple[int, ...] | None = None, steady: bool | str = True):
    """One rank under TP (and FSDP2 over the rest of the mesh), in fake mode.

    FSDP2 x TP cannot be set up inside ``FakeTensorMode`` (the mesh's ``_concatenate`` runs
    ``nonzero``): the twin is built on ``meta``, TP and ``fully_shard`` are applied outside fake
    mode, then ``to_empty`` inside it. The first step under DTensor over-counts (sharding
    propagation runs once and is cached), so the steady state is a whole first step, untracked,
    then the tracked step with a fresh tracker; ``steady=False`` measures that first step as is.
    """
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    from .apply import apply_parallel
    from .measure import _fake_batch, entries_restored
    from .process_group import fake_process_group
    from .step import tracked_step
    from .twin import fake_twin

    with fake_process_group(spec, rank) as mesh:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        twin = fake_twin(workload.model, fake_mode, meta=True)
        twin_workload = workload.replace(model=twin)
        applied = plan.apply(twin_workload) if plan is not None else contextlib.nullcontext(twin_workload)
        with applied as wl, entries_restored(wl.model):
            called = apply_parallel(wl.model, spec, mesh, fake=True)
            with fake_mode:
                wl.model.to_empty(device="cpu")
                batch = _fake_batch(wl, fake_mode)
                try:
                    return tracked_step(wl, called, batch, rank=rank, ranks=ranks or (rank,),
                                        steady="full" if steady is True else steady)
                except RuntimeError as exc:
                    if not spec.sequence_parallel:
                        raise
                    # e.g. position embeddings or masks sized from the local (sharded) sequence
                    raise ParallelError("sequence_parallel: the model's forward does not run on sequence shards "
                                        f"({str(exc).splitlines()[0][:160]})") from None
