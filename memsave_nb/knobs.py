"""Workload knobs a fine-tuner turns: batch size, sequence length, precision, optimizer,
gradient accumulation and ``zero_grad(set_to_none=...)``.

A :class:`~memsave_nb.plan.Plan` holds them as plain data; :func:`apply_knobs` turns them into
changes of the :class:`~memsave_nb.workload.Workload` to measure (``dataclasses.replace``) plus
undo callbacks for what it changes on the model (parameter dtypes). Nothing here measures.

What each knob does, precisely:

- ``batch_size``: every tensor of the batch whose leading size is the batch's (the largest
  leading size among its tensors of dim >= 1) is sliced (``t[:n]``) or repeated along dim 0
  (tiled, then cut). Tensors a plain-function loss closes over (targets, as in
  ``loss=lambda out: F.cross_entropy(out, y)``) with that leading size are resized the same way.
  A batch factory whose signature has a ``batch_size`` parameter is called with it instead.
- ``seq_len``: token tensors are cut (``t[:, :n]``) or extended (tiled along dim 1, then cut):
  in a dict batch the keys in :data:`TOKEN_KEYS`; in a tensor or tuple batch the integer
  tensors of dim 2. Closed-over targets of the batch's shape follow.
- ``precision``: ``fp32`` (nothing); ``autocast_bf16`` / ``autocast_fp16`` (parameters stay
  fp32, the forward runs under ``torch.autocast``: the engine's ``Workload.autocast_dtype``);
  ``bf16`` (parameters, floating buffers and the batch held in bf16: pure bf16 training, the
  optimizer state follows the parameters' dtype); ``bf16_master`` (bf16 parameters and
  gradients, plus an fp32 master copy of each trainable parameter that the optimizer updates and
  copies back, as Megatron/DeepSpeed-style mixed precision keeps them: 2 + 2 + 4 bytes per
  trainable parameter before the optimizer's own state).
- ``optimizer``: see :data:`OPTIMIZERS`.
- ``accumulation_steps`` / ``set_to_none``: the engine's ``Workload`` fields (k micro-batches of
  the batch, then one optimizer step; ``zero_grad`` semantics).
- ``loss`` / ``loss_chunk``: ``"full"`` (the model's own loss) or ``"chunked"`` (cross-entropy
  through the LM head, ``loss_chunk`` tokens at a time; see :mod:`memsave_nb.loss`).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol

import torch
from torch import nn

from memsave_nb.checkpointing import PlanError, show
from memsave_nb.loss import DEFAULT_LOSS_CHUNK, apply_loss, check_loss
from memsave_nb.vocabulary import NO_OPTIMIZER, OPTIMIZERS, PRECISIONS
from memsave_nb.errors import WorkloadError, not_one_of
from memsave_nb.workload import iter_tensors, map_tensors
from memsave_nb.workload import optimizer_factory as _workload_optimizer

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.workload import Workload

__all__ = [
    "PRECISIONS",
    "OPTIMIZERS",
    "TOKEN_KEYS",
    "KNOB_FIELDS",
    "check_knobs",
    "apply_knobs",
    "describe_knobs",
    "batch_size_of",
    "seq_len_of",
    "resize_batch",
    "max_positions",
    "optimizer_factory",
    "MasterWeightsOptimizer",
]

# dict keys of (B, T, ...) tensors that follow the sequence length: Hugging Face's names (the
# embeddings a model takes instead of ids, the decoder's of an encoder-decoder) and the zoo's
TOKEN_KEYS = (
    "input_ids",
    "labels",
    "attention_mask",
    "token_type_ids",
    "position_ids",
    "inputs_embeds",
    "decoder_input_ids",
    "decoder_attention_mask",
    "decoder_inputs_embeds",
    "idx",
    "targets",
)


class KnobValues(Protocol):
    """The plain values the knobs read: a ``Plan`` holds them, so may any object (knobs never
    import the plan). Read-only: a frozen dataclass (``Plan``) is one."""

    @property
    def batch_size(self) -> int | None: ...

    @property
    def seq_len(self) -> int | None: ...

    @property
    def precision(self) -> str | None: ...

    @property
    def optimizer(self) -> str | None: ...

    @property
    def accumulation_steps(self) -> int | None: ...

    @property
    def set_to_none(self) -> bool | None: ...

    @property
    def loss(self) -> str | None: ...

    @property
    def loss_chunk(self) -> int | None: ...


# Plan fields owned by this module, with their "keep the workload's" value.
KNOB_FIELDS = (
    "batch_size",
    "seq_len",
    "precision",
    "optimizer",
    "accumulation_steps",
    "set_to_none",
    "loss",
    "loss_chunk",
)

# the largest batch size, sequence length or accumulation count a plan takes: int32's maximum
# (no GPU holds 2**31 samples; larger counts overflow the sizes torch multiplies them into)
MAX_KNOB = 2**31 - 1


def _positive(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_KNOB:
        raise PlanError(f"{name} must be a positive integer up to {MAX_KNOB} or None, got {show(value)}")
    return int(value)


def check_knobs(plan: "KnobValues") -> dict[str, Any]:
    """Validated, normalised knob values of a plan (its ``__post_init__`` stores them)."""
    out: dict[str, Any] = {
        "batch_size": _positive(plan.batch_size, "batch_size"),
        "seq_len": _positive(plan.seq_len, "seq_len"),
        "accumulation_steps": _positive(plan.accumulation_steps, "accumulation_steps"),
    }
    precision = plan.precision
    if precision is not None:
        if not isinstance(precision, str) or precision.lower().replace("-", "_") not in PRECISIONS:
            raise PlanError(f"precision {show(precision)}: choose one of {sorted(PRECISIONS)} or None")
        precision = precision.lower().replace("-", "_")
    out["precision"] = precision
    optimizer = plan.optimizer
    if optimizer is not None:
        if not isinstance(optimizer, str) or optimizer.lower().replace("-", "_") not in OPTIMIZERS:
            raise PlanError(not_one_of("optimizer", optimizer, f"{', '.join(sorted(OPTIMIZERS))} or None"))
        optimizer = optimizer.lower().replace("-", "_")
    out["optimizer"] = optimizer
    if plan.set_to_none is not None and not isinstance(plan.set_to_none, bool):
        raise PlanError(f"set_to_none must be True, False or None, got {show(plan.set_to_none)}")
    out["set_to_none"] = plan.set_to_none
    out["loss"], out["loss_chunk"] = check_loss(plan.loss, plan.loss_chunk)
    return out


def describe_knobs(plan: "KnobValues") -> list[str]:
    parts = []
    if plan.batch_size is not None:
        parts.append(f"batch {plan.batch_size}")
    if plan.seq_len is not None:
        parts.append(f"seq {plan.seq_len}")
    if plan.precision is not None:
        parts.append(plan.precision)
    if plan.optimizer is not None:
        parts.append(plan.optimizer)
    if plan.accumulation_steps is not None:
        parts.append(f"accumulate {plan.accumulation_steps}")
    if plan.set_to_none is not None:
        parts.append(f"zero_grad set_to_none={plan.set_to_none}")
    if plan.loss == "chunked":
        parts.append(f"chunked loss ({plan.loss_chunk or DEFAULT_LOSS_CHUNK} tokens)")
    elif plan.loss == "full":
        parts.append("full loss")
    elif plan.loss is not None:  # TRL's head, the label smoother: named as the vocabulary names them
        parts.append(f"loss {plan.loss}")
    return parts


# -- batch and sequence ----------------------------------------------------------------------


def batch_size_of(batch: Any) -> int:
    """The batch's size: the largest leading size among its tensors of dim >= 1."""
    sizes = [t.shape[0] for t in iter_tensors(batch) if t.dim() >= 1]
    if not sizes:
        raise PlanError("batch_size: the batch holds no tensor with a batch dimension")
    return max(sizes)


def _token_tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, Mapping):
        return [v for k, v in batch.items() if k in TOKEN_KEYS and isinstance(v, torch.Tensor) and v.dim() >= 2]
    return [t for t in iter_tensors(batch) if t.dim() == 2 and not t.is_floating_point() and not t.is_complex()]


def seq_len_of(batch: Any) -> int:
    tokens = _token_tensors(batch)
    if not tokens:
        raise PlanError(
            f"seq_len: the batch holds no token tensor ({', '.join(TOKEN_KEYS)}, or an integer (B, T) tensor)"
        )
    return max(t.shape[1] for t in tokens)


def _resize_dim(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    size = t.shape[dim]
    if n == size:
        return t
    if n < size:
        return t.narrow(dim, 0, n).clone()
    reps = [1] * t.dim()
    reps[dim] = -(-n // size)
    return t.repeat(*reps).narrow(dim, 0, n).clone()


def resize_batch(batch: Any, batch_size: int | None = None, seq_len: int | None = None) -> Any:
    """The batch with its batch dimension and/or token sequence resized (see the module doc)."""
    if seq_len is not None:
        tokens = _token_tensors(batch)
        if not tokens:
            seq_len_of(batch)  # raises the one-line error
        ids = {id(t) for t in tokens}
        if isinstance(batch, Mapping):
            batch = {k: (_resize_dim(v, 1, seq_len) if id(v) in ids else v) for k, v in batch.items()}
        else:
            batch = map_tensors(batch, lambda t: _resize_dim(t, 1, seq_len) if id(t) in ids else t)
    if batch_size is not None:
        b = batch_size_of(batch)
        batch = map_tensors(batch, lambda t: _resize_dim(t, 0, batch_size) if t.dim() >= 1 and t.shape[0] == b else t)
    return batch


def _factory_takes_batch_size(fn: Any) -> bool:
    try:
        return "batch_size" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _is_factory(batch: Any) -> bool:
    return callable(batch) and not isinstance(batch, (nn.Module, torch.Tensor))


def _resize_loss(loss: Any, old_batch: Any, batch_size: int | None, seq_len: int | None) -> Any:
    """A copy of a plain-function loss whose closed-over tensors of the batch's leading size are
    resized like the batch (targets captured by ``lambda out: F.cross_entropy(out, y)``)."""
    if not isinstance(loss, types.FunctionType) or not loss.__closure__:
        return loss
    try:
        b = batch_size_of(old_batch)
        t_len = seq_len_of(old_batch) if seq_len is not None else None
    except PlanError:
        return loss
    changed = False
    cells = []
    for cell in loss.__closure__:
        try:
            value = cell.cell_contents
        except ValueError:  # empty cell
            cells.append(cell)
            continue
        new = _resized_target(value, b, t_len, batch_size, seq_len)
        if new is not value:
            changed = True
            cells.append(types.CellType(new))
        else:
            cells.append(cell)
    if not changed:
        return loss
    return types.FunctionType(loss.__code__, loss.__globals__, loss.__name__, loss.__defaults__, tuple(cells))


def _resized_target(value: Any, b: int, t_len: int | None, batch_size: int | None, seq_len: int | None) -> Any:
    """A closed-over loss target resized like the batch (leading size ``b``), else ``value``."""
    if not isinstance(value, torch.Tensor) or value.dim() < 1 or value.shape[0] != b:
        return value
    new = value
    if t_len is not None and value.dim() >= 2 and value.shape[1] == t_len:
        new = _resize_dim(new, 1, seq_len)  # type: ignore[arg-type]
    if batch_size is not None:
        new = _resize_dim(new, 0, batch_size)
    return new


def _lazy_loss(loss: Any) -> tuple[Any, list[tuple[Any, torch.Tensor]]]:
    """A copy of a plain-function loss whose closed-over tensors sit in cells of its own, to be
    filled by :class:`_ResizedBatch` with targets built in the step's own mode; and those cells."""
    if not isinstance(loss, types.FunctionType) or not loss.__closure__:
        return loss, []
    cells, mine = [], []
    for cell in loss.__closure__:
        try:
            value = cell.cell_contents
        except ValueError:  # empty cell
            cells.append(cell)
            continue
        if isinstance(value, torch.Tensor):
            cell = types.CellType(value)
            mine.append((cell, value))
        cells.append(cell)
    if not mine:
        return loss, []
    return types.FunctionType(loss.__code__, loss.__globals__, loss.__name__, loss.__defaults__, tuple(cells)), mine


class _ResizedBatch:
    """A batch factory: the workload's batch resized when the step asks for it, so that under
    fake mode the resized batch (and the loss's resized targets) are fake tensors built from
    shapes, whatever the size. In real mode it says in one line when the resized batch alone
    exceeds this machine's free memory, before allocating it.

    ``source_batch`` is the workload's own batch (fake mode's mask checks read its values)."""

    def __init__(
        self,
        source: Any,
        batch_size: int | None,
        seq_len: int | None,
        takes_batch_size: bool,
        loss_cells: list[tuple[Any, torch.Tensor]],
    ):
        self.source_batch = None if _is_factory(source) else source
        self._source = source
        self._n, self._t, self._takes = batch_size, seq_len, takes_batch_size
        self._loss_cells = loss_cells

    def __call__(self) -> Any:
        from torch._guards import detect_fake_mode

        src = self._source
        raw = (src(batch_size=self._n) if (self._takes and self._n is not None) else src()) if _is_factory(src) else src
        n = None if self._takes else self._n
        if detect_fake_mode() is None:
            _check_host_memory(raw, n, self._t)
        with torch.no_grad():
            batch = resize_batch(raw, n, self._t)
            if self._loss_cells:
                self._fill_loss(raw)
        return _same_grad_flags(raw, batch)

    def _fill_loss(self, raw: Any) -> None:
        try:
            b = batch_size_of(raw)
            t_len = seq_len_of(raw) if self._t is not None else None
        except PlanError:
            return
        for cell, value in self._loss_cells:
            cell.cell_contents = _resized_target(value, b, t_len, self._n, self._t)


def _same_grad_flags(raw: Any, batch: Any) -> Any:
    """``batch`` (resized from ``raw`` without autograd) with fresh leaves that require grad where
    ``raw``'s tensors did: the step's input gradients never flow back into the user's tensors."""
    flags = iter([t.requires_grad for t in iter_tensors(raw)])
    return map_tensors(batch, lambda t: t.requires_grad_(True) if next(flags, False) and t.is_leaf else t)


def _resized_bytes(batch: Any, batch_size: int | None, seq_len: int | None) -> int:
    """Bytes the resized batch will take, from shapes alone."""
    tokens = {id(t) for t in _token_tensors(batch)} if seq_len is not None else set()
    b = batch_size_of(batch) if batch_size is not None else None
    total = 0
    for t in iter_tensors(batch):
        shape = list(t.shape)
        if seq_len is not None and id(t) in tokens:
            shape[1] = seq_len
        if batch_size is not None and b is not None and t.dim() >= 1 and shape[0] == b:
            shape[0] = batch_size
        numel = 1
        for d in shape:
            numel *= d
        total += numel * t.element_size()
    return total


def _free_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_host_memory(batch: Any, batch_size: int | None, seq_len: int | None) -> None:
    """Real mode: refuse, in one line, a resized batch larger than this machine's free memory."""
    from memsave_nb.errors import WorkloadError
    from memsave_nb.units import format_bytes

    free = _free_host_bytes()
    need = _resized_bytes(batch, batch_size, seq_len)
    if free is not None and need > free:
        raise WorkloadError(
            f"the resized batch alone needs {format_bytes(need)}, more than this machine's free memory "
            f"({format_bytes(free)}): measure this size with mode='fake'"
        )


def _grows(batch: Any, batch_size: int | None, seq_len: int | None) -> bool:
    try:
        return (batch_size is not None and batch_size > batch_size_of(batch)) or (
            seq_len is not None and seq_len > seq_len_of(batch)
        )
    except PlanError:
        return False  # the eager path raises the one-line error


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model's position embeddings allow, when its config says."""
    cfg = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions", "block_size", "max_seq_len"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _batch_changes(plan: "KnobValues", workload: "Workload") -> dict[str, Any]:
    n, t = plan.batch_size, plan.seq_len
    if n is None and t is None:
        return {}
    if t is not None:
        limit = max_positions(workload.model)
        if limit is not None and t > limit:
            raise PlanError(f"seq_len {t} exceeds the model's {limit} positions")
    batch = workload.batch
    changes: dict[str, Any] = {}
    if _is_factory(batch) or _grows(batch, n, t):
        # built when the step asks: fake under fake mode, whatever its size (never for real)
        takes = _is_factory(batch) and _factory_takes_batch_size(batch)
        loss, cells = _lazy_loss(workload.loss)
        changes["batch"] = _ResizedBatch(batch, n, t, takes, cells)
        if cells:
            changes["loss"] = loss
    else:
        changes["batch"] = resize_batch(batch, n, t)
        if workload.loss is not None:
            changes["loss"] = _resize_loss(workload.loss, batch, n, t)
    return changes


# -- optimizers ------------------------------------------------------------------------------


def optimizer_factory(name: str) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """An optimizer factory ``params -> Optimizer`` for a name in :data:`OPTIMIZERS` (built where
    a Workload builds it, so the knob and the Workload mean the same optimizer)."""
    if name not in OPTIMIZERS:
        raise PlanError(not_one_of("optimizer", name, ", ".join(sorted(OPTIMIZERS))))
    try:
        return _workload_optimizer(name)
    except WorkloadError as exc:  # adamw_8bit without bitsandbytes
        raise PlanError(str(exc)) from None


class MasterWeightsOptimizer(torch.optim.Optimizer):
    """Mixed precision with fp32 master weights: the model's parameters and gradients are bf16;
    this optimizer keeps an fp32 copy of each parameter, steps ``inner`` on the copies (with the
    gradients cast to fp32) and writes the result back in bf16. Its ``state[p]`` holds the master
    copy (``"master"``) and the inner optimizer's state for it, so trackers see all of it."""

    def __init__(self, params: Iterable[nn.Parameter], inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
        params = list(params)
        super().__init__(params, {})
        self._masters = [p.detach().float() if p.dtype != torch.float32 else p.detach().clone() for p in params]
        for master in self._masters:
            master.requires_grad_(True)
        for p, master in zip(params, self._masters):
            self.state[p]["master"] = master
        self._inner = inner(self._masters)

    @property
    def makes_state_on_zero_grads(self) -> bool:
        """Its step on zero gradients makes the inner optimizer's state as a first step would (the
        masters exist from construction) when the engine trusts the inner one to: a steady-state
        measurement then needs no whole first step."""
        from memsave_nb.measure.optimizer_state import makes_state_without_a_step

        return makes_state_without_a_step(self._inner)

    @torch.no_grad()
    def init_state_on_zero_grads(self) -> bool:
        """The state a first step makes, without its update, when the inner optimizer can make its
        own that way (Adam/AdamW: ``init_optimizer_state``); False (nothing made) otherwise."""
        from memsave_nb.measure.optimizer_state import init_optimizer_state

        params = [p for group in self.param_groups for p in group["params"]]
        for p, master in zip(params, self._masters):
            master.grad = None if p.grad is None else torch.zeros_like(master)
        try:
            made = init_optimizer_state(self._inner)
        finally:
            for master in self._masters:
                master.grad = None
        if made:
            for p, master in zip(params, self._masters):
                self.state[p].update(self._inner.state.get(master, {}))
        return made

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102
        params = [p for group in self.param_groups for p in group["params"]]
        for p, master in zip(params, self._masters):
            master.grad = None if p.grad is None else p.grad.float()
        self._inner.step()
        for p, master in zip(params, self._masters):
            master.grad = None
            p.copy_(master)
            self.state[p].update(self._inner.state.get(master, {}))
        return None


def _optimizer_spec(plan: "KnobValues", workload: "Workload") -> Any:
    base: Any = optimizer_factory(plan.optimizer) if plan.optimizer is not None else workload.optimizer
    if plan.precision != "bf16_master":
        return base
    if base is None or (isinstance(base, str) and base.lower() == NO_OPTIMIZER):
        return base
    if isinstance(base, str):
        inner = _workload_optimizer(base)
    else:
        inner = base
    return lambda params, inner=inner: MasterWeightsOptimizer(params, inner)


# -- parameter dtype ---------------------------------------------------------------------------


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> Callable[[], None]:
    """Hold the model's floating parameters and buffers in ``dtype``; returns the undo.

    Parameters keep their identity (``param.data`` is swapped); buffers are replaced in their
    module's ``_buffers`` (the plan's restore point puts the originals back; undo does too).
    A gradient the model already holds (any model after a training cell) is set aside while the
    dtype differs (torch refuses an fp32 ``.grad`` on a bf16 parameter) and given back by undo."""
    originals: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor | None]] = []
    buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
    seen: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            for p in module._parameters.values():
                if p is None or id(p) in seen or not p.is_floating_point() or p.dtype == dtype:
                    continue
                seen.add(id(p))
                originals.append((p, p.data, p.grad))
                p.grad = None
                p.data = p.data.to(dtype)
            for name, b in list(module._buffers.items()):
                if b is None or not b.is_floating_point() or b.dtype == dtype:
                    continue
                buffers.append((module, name, b))
                module._buffers[name] = b.to(dtype)

    def undo() -> None:
        for p, data, grad in originals:
            p.grad = None
            p.data = data
            p.grad = grad
        for module, name, b in buffers:
            module._buffers[name] = b

    return undo


# -- apply -----------------------------------------------------------------------------------


def _workload_has(workload: "Workload", name: str) -> bool:
    return any(f.name == name for f in dataclasses.fields(workload))


def apply_knobs(plan: "KnobValues", workload: "Workload") -> tuple[dict[str, Any], list[Callable[[], None]]]:
    """The workload changes (for ``dataclasses.replace``) and the model undo callbacks of the
    plan's knobs. Called by ``Plan.apply`` after freezing and regions."""
    changes: dict[str, Any] = dict(_batch_changes(plan, workload))
    undo: list[Callable[[], None]] = []
    precision = plan.precision
    if precision in ("autocast_bf16", "autocast_fp16"):
        if not _workload_has(workload, "autocast_dtype"):
            raise PlanError(
                "precision autocast needs Workload.autocast_dtype (the engine's autocast support), which this version lacks"
            )
        changes["autocast_dtype"] = torch.bfloat16 if precision == "autocast_bf16" else torch.float16
    elif precision in ("bf16", "bf16_master"):
        undo.append(cast_parameters(workload.model, torch.bfloat16))
        changes["dtype"] = torch.bfloat16
    if precision in ("fp32", "autocast_bf16", "autocast_fp16"):  # "fp32 parameters": a bf16 model is cast too
        undo.append(cast_parameters(workload.model, torch.float32))
        changes["dtype"] = torch.float32 if workload.dtype is not None else None
    if plan.optimizer is not None or precision == "bf16_master":
        changes["optimizer"] = _optimizer_spec(plan, workload)
    for name in ("accumulation_steps", "set_to_none"):
        value = getattr(plan, name)
        if value is None:
            continue
        if not _workload_has(workload, name):
            raise PlanError(f"{name} needs Workload.{name} (the engine's support), which this version lacks")
        changes[name] = value
    undo += apply_loss(plan.loss, plan.loss_chunk, workload, changes.get("batch", workload.batch))
    return changes, undo
