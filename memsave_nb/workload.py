"""What one training step is: model, batch, loss, optimizer, device.

A Workload holds no measurement logic. It knows how to build a fresh batch, call the model on it
(plain tensors, tuples or Hugging Face style dicts), turn the output into a scalar loss, and make an
optimizer over the trainable parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from .errors import WorkloadError, not_one_of, quoted
from .vocabulary import DEFAULT_LOOP, LOOPS, NO_OPTIMIZER, OPTIMIZER_ALIASES, OPTIMIZER_STATE, OPTIMIZERS

AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)

# the most micro-steps a sized step runs (each is run; trainers use up to a few hundred)
MAX_ACCUMULATION_STEPS = 1024

OptimizerSpec = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | str | None


# Built for each name of vocabulary.OPTIMIZERS (the plan's optimizer knob reads the same list), so
# every registered optimizer is one a Workload takes. Old spellings: vocabulary.OPTIMIZER_ALIASES.
def unknown_optimizer(name: Any) -> str:
    """The one-line refusal naming every registered optimizer (within 200 characters as it grows)."""
    return not_one_of("unknown optimizer", name, f"{', '.join(sorted(OPTIMIZERS))} or 'none'")


def optimizer_factory(name: str) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """A factory ``params -> Optimizer`` for a registered optimizer name (or an old alias)."""
    key = OPTIMIZER_ALIASES.get(name.lower(), name.lower())
    if key not in OPTIMIZERS:
        raise WorkloadError(unknown_optimizer(name))
    moments, bits = OPTIMIZER_STATE[key]
    if bits in (8, 32):  # bitsandbytes' layouts, in plain torch (fake mode runs them)
        from .optimizers_extra import LayoutOptimizer

        emb32 = key.endswith("_embed32")  # nn.Embedding weights in 32 bits, as the HF Trainer keeps them
        return lambda params: LayoutOptimizer(params, moments=moments, bits=bits, lr=1e-3, embeddings32=emb32)
    return _TORCH_OPTIMIZERS[key]


def follow_model(optimizer: Any, model: nn.Module, params: list[nn.Parameter]) -> None:
    """Tell an optimizer that chooses by module (``follow_model``: a layout optimizer keeping
    embeddings in 32 bits) the model it steps; through a master-weights wrapper (``_inner`` over
    ``_masters``, one per parameter) it is told which copy stands for which parameter."""
    inner = getattr(optimizer, "_inner", None)
    target = optimizer if inner is None else inner
    follow = getattr(target, "follow_model", None)
    if not callable(follow):
        return
    masters = getattr(optimizer, "_masters", None) if inner is not None else None
    follow(model, None if masters is None else {id(p): m for p, m in zip(params, masters)})


_TORCH_OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adamw_foreach": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),
}


def output_dropped(loop: str, point: str) -> bool:
    """Whether ``loop`` has dropped the last micro-step's output by ``point``: "backward" (before
    it starts) or "step" (before the optimizer step). One answer for every runner of the loop."""
    if point == "backward":
        return loop == "loss_only"
    if point == "step":
        return loop != "keep_output_step"
    raise ValueError(f"unknown point {point!r}")


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in a nested tuple/list/dict structure, keeping the structure."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(v, fn) for k, v in obj.items()}  # a plain dict, whatever the mapping
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def iter_tensors(obj: Any) -> Iterable[torch.Tensor]:
    """Yield every tensor in a nested structure (model outputs, batches)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from iter_tensors(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))
    elif hasattr(obj, "to_tuple"):  # transformers ModelOutput
        yield from iter_tensors(obj.to_tuple())


def iter_output_tensors(obj: Any, _seen: set[int] | None = None, _depth: int = 0) -> Iterable[torch.Tensor]:
    """Every tensor a model's output keeps alive, caches included.

    Like :func:`iter_tensors`, and it also walks the attributes of plain objects in the output
    (Hugging Face ``DynamicCache`` keeps its keys and values in ``cache.layers[i].keys``), so
    ``past_key_values`` counts. Modules are not walked (their parameters are not the step's output).
    """
    seen = set() if _seen is None else _seen
    if id(obj) in seen or _depth > 12 or obj is None or isinstance(obj, (str, bytes, int, float, bool, nn.Module)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from iter_output_tensors(v, seen, _depth + 1)
    elif isinstance(obj, (tuple, list, set, frozenset)):
        for v in obj:
            yield from iter_output_tensors(v, seen, _depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_output_tensors(getattr(obj, f.name, None), seen, _depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj):
        for v in vars(obj).values():
            yield from iter_output_tensors(v, seen, _depth + 1)


def output_parts(output: Any) -> list[tuple[str, list[torch.Tensor]]]:
    """The output split into named parts (``logits``, ``past_key_values``, ...) with their tensors.

    A Hugging Face ``ModelOutput`` or a dict gives one part per key, a tuple one per position,
    a tensor the single part ``output``.
    """
    if isinstance(output, torch.Tensor):
        return [("output", [output])]
    if isinstance(output, Mapping):  # ModelOutput is an OrderedDict of its non-None fields
        return [(str(k), list(iter_output_tensors(v))) for k, v in output.items()]
    if isinstance(output, (tuple, list)):
        return [(f"output[{i}]", list(iter_output_tensors(v))) for i, v in enumerate(output)]
    return [("output", list(iter_output_tensors(output)))]


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` or ``output["loss"]`` when present (Hugging Face style), else the sum of the output."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output.sum()
    tensors = [t for t in iter_tensors(output) if t.is_floating_point() or t.is_complex()]
    if not tensors:
        raise WorkloadError("the model output holds no floating-point tensor to build a loss from; pass loss=...")
    return sum(t.sum() for t in tensors)  # type: ignore[return-value]


@dataclasses.dataclass
class Workload:
    """One training step: ``loss(model(batch)).backward(); optimizer.step()``.

    ``accumulation_steps`` k: k micro-steps of (forward, loss / k, backward), then one optimizer
    step. ``set_to_none``: how grads are cleared between steps (``zero_grad(set_to_none=...)``):
    None at the start of a step when True, zero tensors alive from the start when False.
    ``autocast_dtype``: the forward runs under ``torch.autocast`` with that dtype when set.
    ``loop``: how long the model's output lives (see ``LOOPS``); the default, ``"loss_only"``, is
    what Hugging Face's Trainer and ``Plan.to_code()`` run: only the loss goes into backward.
    ``sized_for``: the device whose step the sizing follows when it is not the one the step runs on.
    ``"cuda"`` (what models by name default to: they are sized for a GPU on a CPU twin) makes an
    optimizer left to pick its implementation run the step torch picks on CUDA (see
    :func:`follow_cuda_default`); None: the step runs as the workload's own device runs it.
    ``gpu``: the GPU generation a ``sized_for="cuda"`` step follows where it matters (SDPA's
    backend; see ``SIZED_GPUS``); None assumes an H100 (sm90).

    ``batch`` is a tensor, a tuple/list (positional arguments), a dict (keyword arguments, as
    Hugging Face models take them) or a zero-argument callable returning one of those.
    """

    model: nn.Module
    batch: Any
    loss: Callable[[Any], torch.Tensor] | None = None
    optimizer: OptimizerSpec = "adamw"
    device: str | torch.device = "cpu"
    dtype: torch.dtype | None = None
    input_requires_grad: bool = False
    name: str = "workload"
    accumulation_steps: int = 1
    set_to_none: bool = True
    autocast_dtype: torch.dtype | None = None
    loop: str = DEFAULT_LOOP
    sized_for: str | None = None
    gpu: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise WorkloadError(f"model must be a torch.nn.Module, got {type(self.model).__name__}")
        k = self.accumulation_steps
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise WorkloadError(f"accumulation_steps must be a whole number >= 1, got {quoted(k)}")
        if k > MAX_ACCUMULATION_STEPS:  # every micro-step is run: 2**63 of them never end
            raise WorkloadError(
                f"accumulation_steps {k if k < 10**12 else f'of {k.bit_length()} bits'}: "
                f"at most {MAX_ACCUMULATION_STEPS} (each micro-step is run)"
            )
        if not isinstance(self.set_to_none, bool):
            raise WorkloadError(f"set_to_none must be True or False, got {quoted(self.set_to_none)}")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            # a string here reaches Tensor.to() as a device name: torch's error then quotes it whole
            raise WorkloadError(f"dtype must be a floating torch.dtype or None, got {quoted(self.dtype)}")
        if self.autocast_dtype is not None and self.autocast_dtype not in AUTOCAST_DTYPES:
            raise WorkloadError(
                f"autocast_dtype must be torch.bfloat16, torch.float16 or None, got {quoted(self.autocast_dtype)}"
            )
        if self.loop not in LOOPS:
            raise WorkloadError(f"unknown loop {quoted(self.loop)}; choose from {', '.join(LOOPS)}")
        if self.sized_for not in SIZED_FOR:
            raise WorkloadError(
                f"sized_for must be one of {', '.join(map(str, SIZED_FOR))}, got {quoted(self.sized_for)}"
            )
        check_gpu(self.gpu)
        if isinstance(self.optimizer, str) and self.optimizer.lower() != NO_OPTIMIZER:
            key = self.optimizer.lower()
            if OPTIMIZER_ALIASES.get(key, key) not in OPTIMIZERS:
                raise WorkloadError(unknown_optimizer(self.optimizer))
        self.device = check_device(self.device)

    # -- batch ------------------------------------------------------------------------------
    def make_batch(self) -> Any:
        """A fresh batch on the workload's device, cast to its dtype, with input grads if asked."""
        raw = self.batch() if callable(self.batch) and not isinstance(self.batch, nn.Module) else self.batch
        if not any(True for _ in iter_tensors(raw)):
            raise WorkloadError(f"the batch holds no tensor (got {type(raw).__name__})")
        device = torch.device(self.device)

        def prepare(t: torch.Tensor) -> torch.Tensor:
            if t.device != device and t.device.type != "meta" and not _is_fake(t):
                t = t.to(device)
            if self.dtype is not None and t.is_floating_point():
                t = t.to(self.dtype)
            if self.input_requires_grad and t.is_floating_point():
                t = t.detach().requires_grad_(True)
            return t

        return map_tensors(raw, prepare)

    def forward(self, batch: Any) -> Any:
        """Call the model the way its batch asks: ``**dict``, ``*tuple`` or a single argument.

        With ``autocast_dtype`` set the call runs under ``torch.autocast(device_type, dtype)``.
        """
        if self.autocast_dtype is not None:
            with torch.autocast(torch.device(self.device).type, dtype=self.autocast_dtype):
                return self._call_model(batch)
        return self._call_model(batch)

    def _call_model(self, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return self.model(**batch)
        if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields"):
            return self.model(*batch)
        return self.model(batch)

    def compute_loss(self, output: Any) -> torch.Tensor:
        """The step's scalar loss; a non-scalar loss is a one-line error."""
        loss = (self.loss or default_loss)(output)
        if not isinstance(loss, torch.Tensor):
            raise WorkloadError(f"the loss function returned {type(loss).__name__}, not a tensor")
        if loss.numel() != 1:
            raise WorkloadError(f"the loss must be a scalar, got shape {tuple(loss.shape)}; reduce it (e.g. .mean())")
        return loss.reshape(())

    # -- optimizer --------------------------------------------------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def make_optimizer(self) -> torch.optim.Optimizer | None:
        """An optimizer over the trainable parameters; None when there is none or none is asked for."""
        spec = self.optimizer
        if spec is None or (isinstance(spec, str) and spec.lower() == NO_OPTIMIZER):
            return None
        params = self.trainable_parameters()
        if not params:
            return None
        factory = optimizer_factory(spec) if isinstance(spec, str) else spec
        optimizer = factory(params)
        follow_model(optimizer, self.model, params)
        if self.sized_for == "cuda":  # the step chosen, for the measurement's note (not a field)
            self.__dict__["cuda_step"] = follow_cuda_default(optimizer) or "its own"
        return optimizer

    def replace(self, **changes: Any) -> "Workload":
        return dataclasses.replace(self, **changes)


SIZED_FOR = (None, "cuda")
# GPU generations by compute capability, as sdp_utils.cpp reads them (measure/cuda_attention.py).
SIZED_GPUS = {
    "v100": (7, 0),
    "t4": (7, 5),
    "a100": (8, 0),
    "a10": (8, 6),
    "l4": (8, 9),
    "rtx4090": (8, 9),
    "h100": (9, 0),
    "h200": (9, 0),
    "b200": (10, 0),
}
DEFAULT_GPU = "h100"


def check_gpu(name: object) -> str:
    """The key of a GPU generation in ``SIZED_GPUS`` (None: ``DEFAULT_GPU``); else a one-line error."""
    key = DEFAULT_GPU if name is None else (name.lower() if isinstance(name, str) else "")
    if key not in SIZED_GPUS:
        raise WorkloadError(f"unknown gpu {str(name)[:40]!r}; choose from {', '.join(SIZED_GPUS)}")
    return key


def follow_cuda_default(optimizer: Any) -> str | None:
    """Make an optimizer that was left to pick its implementation (``foreach=None``, not fused) take
    the step torch picks on CUDA: the foreach step (torch 2.13 ``torch/optim/optimizer.py``,
    ``_default_to_fused_or_foreach``: fused only when asked for, foreach when every parameter is a
    plain tensor on a CUDA device). On the CPU the same constructor runs the single-tensor loop,
    whose temporaries are smaller. A wrapper with an ``_inner`` optimizer (fp32 master weights) is
    followed inside. Returns the implementation now chosen (``"foreach"``, ``"fused"``,
    ``"single-tensor"`` where the user asked for it, or None for an optimizer without the choice)."""
    inner = getattr(optimizer, "_inner", None)
    if isinstance(inner, torch.optim.Optimizer):
        return follow_cuda_default(inner)
    if not isinstance(optimizer, torch.optim.Optimizer) or "foreach" not in optimizer.defaults:
        return None
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(type(p).__name__ == "DTensor" for p in params):
        return None  # sharded steps: the per-rank runners size (and note) the GPU's step themselves
    if any(g.get("fused") for g in optimizer.param_groups):
        return "fused"
    if optimizer.defaults.get("differentiable"):
        return None
    for group in optimizer.param_groups:
        if group.get("foreach") is None:
            group["foreach"] = True
    if optimizer.defaults.get("foreach") is None:
        optimizer.defaults["foreach"] = True
    return "foreach" if all(g.get("foreach") for g in optimizer.param_groups) else "single-tensor"


def check_device(device: str | torch.device) -> str:
    """Validate a device string early: asking for CUDA without one is a one-line error."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise WorkloadError(f"unknown device {quoted(device)}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise WorkloadError(f"device {quoted(device)} is not available: this torch sees no CUDA GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise WorkloadError(
                f"device {quoted(device)} is not available: only {torch.cuda.device_count()} CUDA device(s)"
            )
    elif dev.type not in ("cpu", "meta"):
        if not hasattr(torch, dev.type):
            raise WorkloadError(f"device {quoted(device)} is not supported")
    return str(dev)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
