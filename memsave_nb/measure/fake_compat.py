"""Fake mode takes the path a real step takes, on Hugging Face models.

transformers never reads the values of a fake tensor: ``transformers.utils.import_utils.is_tracing(t)``
is True for any ``FakeTensor`` (``is_fake_tensor``), as it is under dynamo or ``torch.jit``. Two checks
in ``transformers.masking_utils`` read values on a real step and decide what the step allocates:

- ``find_packed_sequence_indices(position_ids)``: when the model made its own consecutive positions
  (no ``position_ids`` and no ``attention_mask`` in the batch, no KV cache: a checkpointed training
  step) a real step finds no packed sequences and hands SDPA ``is_causal=True``; under fake tensors it
  returns the "packed" index tensor, so a (B, 1, T, T) bool mask is built and passed to every block,
  and a checkpointed region keeps it (B*T*T bytes more saved).
- ``_ignore_causal_mask_sdpa`` / ``_ignore_bidirectional_mask_sdpa`` (and the XPU variant): a
  real step with an all-ones ``attention_mask`` drops the mask; under fake tensors it is built.

While memsave_nb runs a fake step on a model with modules from transformers, ``same_path_as_real``
replaces those functions in ``transformers.masking_utils`` (restored on exit) by wrappers that answer
the value question from the real batch: the keys the model is called with (a forward pre-hook on the
root module) and, when the workload's batch is a mapping of real tensors, their values. Where the
answer is not known (fake or factory-made position ids or masks) the wrapper keeps transformers'
behaviour and a ``UserWarning`` says how many bytes fake mode may over-count.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeGuard

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..workload import Workload

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensor

_SKIP_CHECKS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa", "_can_skip_bidirectional_mask_xpu")
_PACKED_CHECK = "find_packed_sequence_indices"


def _is_fake(t: Any) -> TypeGuard[FakeTensor]:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def uses_transformers(model: nn.Module) -> bool:
    """Whether any module of ``model`` is a transformers class (peft wrappers included)."""
    if "transformers" not in sys.modules:
        return False
    return any(type(m).__module__.startswith("transformers.") for m in model.modules())


@dataclass
class _Facts:
    """What a real step would read from the batch; None: not known in fake mode."""

    positions_packed: bool | None = None
    masks_full: bool | None = None
    unknown_bytes: dict[str, int] = field(default_factory=dict)  # what -> bytes the built mask takes
    ones: dict[int, weakref.ref] = field(default_factory=dict)  # id -> tensor the model filled with ones

    def all_ones(self, t: Any) -> bool:
        ref = self.ones.get(id(t))
        return ref is not None and ref() is t

    def note_ones(self, t: torch.Tensor) -> None:
        self.ones[id(t)] = weakref.ref(t)


_ONES_OPS = ("ones.default", "new_ones.default", "ones_like.default")
_KEEPS_ONES = (
    "_to_copy.default",
    "clone.default",
    "view.default",
    "unsqueeze.default",
    "expand.default",
    "slice.Tensor",
    "alias.default",
    "contiguous.default",
    "detach.default",
)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _OnesTracker(TorchDispatchMode):
    """Notes the tensors a fake step fills with ones (``torch.ones``, ``new_ones``, ``ones_like``) and
    what keeps them all ones (dtype casts, views, slices): an encoder-decoder model (BART) makes its
    decoder's ``attention_mask`` this way when the batch has none, and a real step's value check
    then finds no padding.

    It sits on every op of a fake step, so it does little per op: which op it is comes from a
    dictionary by overload (names formatted once), and it runs without dynamo's wrapper."""

    def __init__(self, facts: _Facts):
        super().__init__()
        self.facts = facts
        self._kind: dict[Any, int] = {}  # op -> 0 (other), 1 (makes ones), 2 (keeps ones)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # eager fake steps only (as the tracker's own mode): no torch._dynamo.disable wrapper per op

    def _kind_of(self, func: Any) -> int:
        name = f"{func._opname}.{func._overloadname}"
        kind = self._kind[func] = 1 if name in _ONES_OPS else 2 if name in _KEEPS_ONES else 0
        return kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        facts = self.facts
        if facts.ones and func._schema.is_mutable:
            # written in place (a mask padded by hand): no tensor on that storage is known to be ones
            written = {_storage_key(a) for a in args if isinstance(a, torch.Tensor)}
            facts.ones = {k: r for k, r in facts.ones.items() if r() is None or _storage_key(r()) not in written}
        out = func(*args, **kwargs) if kwargs else func(*args)
        kind = self._kind.get(func)
        if kind is None:
            kind = self._kind_of(func)
        if (
            kind
            and isinstance(out, torch.Tensor)
            and out.dim() == 2
            and (kind == 1 or (args and facts.all_ones(args[0])))
        ):
            facts.note_ones(out)
        return out


def _real_answers(raw: Any, packed_check: Callable | None) -> dict[str, bool]:
    """The value checks' answers on the workload's real batch, per key: packed positions, full masks.

    Computed before the fake step, outside any fake mode (fake tensors cannot be read)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    answers: dict[str, bool] = {}
    if not isinstance(raw, Mapping):
        return answers
    with unset_fake_temporarily(), torch.no_grad():
        for key, value in raw.items():
            if not isinstance(value, torch.Tensor) or _is_fake(value) or value.device.type == "meta":
                continue
            if key == "position_ids" and packed_check is not None and value.dim() == 2:
                answers[key] = packed_check(value) is not None
            elif key.endswith("attention_mask") and value.dim() == 2:
                answers[key] = bool(value.bool().all())
    return answers


def _facts_from_call(args: tuple, kwargs: Mapping[str, Any], answers: Mapping[str, bool], facts: _Facts) -> None:
    """Fill ``facts`` from the arguments the model is called with and the real batch's answers."""
    if len(args) > 1:  # masks or positions passed by position: not known, transformers' path is kept
        return
    if kwargs.get("position_ids") is None:
        facts.positions_packed = False  # the model counts positions itself: consecutive, never packed
    elif "position_ids" in answers:
        facts.positions_packed = answers["position_ids"]
    mask_keys = [k for k, v in kwargs.items() if k.endswith("attention_mask") and isinstance(v, torch.Tensor)]
    if mask_keys and all(k in answers for k in mask_keys):
        facts.masks_full = all(answers[k] for k in mask_keys)


# The wrappers are installed in transformers.masking_utils while at least one fake step runs (a count,
# under a lock, so overlapping fake steps in two threads restore the originals exactly once) and
# answer from the facts of the fake step entered last.
_LOCK = threading.Lock()
_ACTIVE: list[_Facts] = []
_ORIGINALS: dict[str, Callable] = {}


def _current() -> _Facts | None:
    return _ACTIVE[-1] if _ACTIVE else None


def _wrap_packed(original: Callable) -> Callable:
    def find_packed_sequence_indices(position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        found = original(position_ids, *args, **kwargs)  # the same index ops a real step runs
        facts = _current()
        if facts is not None and _is_fake(position_ids):
            if facts.positions_packed is False:
                return None  # what the real step's value check returns
            if facts.positions_packed is None and position_ids.dim() == 2:
                b, t = position_ids.shape
                facts.unknown_bytes["position_ids"] = int(b) * int(t) * int(t)
        return found

    return find_packed_sequence_indices


def _wrap_skip(original: Callable) -> Callable:
    def skip_check(padding_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        facts = _current()
        if facts is not None and _is_fake(padding_mask):
            if facts.all_ones(padding_mask):
                return original(None, *args, **kwargs)  # a mask the model filled with ones itself
            if facts.masks_full:
                return original(None, *args, **kwargs)  # all ones answers every value check as no mask
            if facts.masks_full is None and padding_mask.dim() == 2:
                b, kv = padding_mask.shape
                q = args[0] if args and isinstance(args[0], int) else int(kv)
                facts.unknown_bytes["attention_mask"] = int(b) * int(q) * int(kv)
        return original(padding_mask, *args, **kwargs)

    return skip_check


def _install(masking: Any) -> None:
    for name, wrap in [(_PACKED_CHECK, _wrap_packed)] + [(n, _wrap_skip) for n in _SKIP_CHECKS]:
        original = getattr(masking, name, None)
        if original is not None:
            _ORIGINALS[name] = original
            setattr(masking, name, wrap(original))


def _uninstall(masking: Any) -> None:
    for name, original in _ORIGINALS.items():
        setattr(masking, name, original)
    _ORIGINALS.clear()


def _masking_utils() -> Any | None:
    try:
        import transformers.masking_utils as masking
    except Exception:  # noqa: BLE001 - a transformers without masking_utils: nothing to align
        return None
    return masking


@contextlib.contextmanager
def same_path_as_real(workload: Workload) -> Iterator[None]:
    """While a fake step runs: transformers' mask checks answer as on the real batch, and grouped
    matmuls run in the dtype a real CPU step runs them in (see module doc). Everything is restored on exit.
    """
    with grouped_mm_in_any_dtype(), _masks_as_real(workload):
        yield


@contextlib.contextmanager
def _masks_as_real(workload: Workload) -> Iterator[None]:
    """transformers' mask checks answer from the real batch (see the module doc)."""
    model = workload.model
    masking = _masking_utils() if uses_transformers(model) else None
    if masking is None:
        yield
        return
    raw = workload.batch
    if callable(raw) and not isinstance(raw, nn.Module):  # a resized batch keeps its source (knobs)
        raw = getattr(raw, "source_batch", None)
    answers = _real_answers(raw, getattr(masking, _PACKED_CHECK, None))  # a wrapper reads real tensors as is
    facts = _Facts()

    def on_call(module: nn.Module, args: tuple, kwargs: dict) -> None:
        _facts_from_call(args, kwargs, answers, facts)

    handle = model.register_forward_pre_hook(on_call, with_kwargs=True)
    with _LOCK:
        if not _ACTIVE:
            _install(masking)
        _ACTIVE.append(facts)
    try:
        with _OnesTracker(facts):
            yield
    finally:
        with _LOCK:
            _ACTIVE.remove(facts)
            if not _ACTIVE:
                _uninstall(masking)
        handle.remove()
    for what, nbytes in facts.unknown_bytes.items():
        warnings.warn(
            f"fake mode cannot read the values of {what} (fake tensors), so transformers builds an attention mask "
            f"a real step may skip: saved bytes may over-count by {nbytes} bytes (the mask, if checkpointed regions "
            f"keep it), and the peak by more (attention then runs with a mask)",
            UserWarning,
            stacklevel=3,
        )


# -- grouped matmuls (mixture-of-experts layers) in float32 ---------------------------------------------
# transformers' Mixtral-style experts call ``torch._grouped_mm``. Its CPU kernel takes float32, but
# PyTorch's meta kernel (the one fake mode runs) insists on bfloat16, so a fake float32 step failed where
# a real one runs. The output's shape does not depend on the dtype (nor on values: the groups' offsets
# only split rows), so while a fake step runs, a grouped matmul outside bfloat16 gets an output of the
# shape the meta kernel gives, in its inputs' dtype. bfloat16 calls still go to PyTorch's own kernel.
_GROUPED_LOCK = threading.Lock()
_GROUPED_USERS: list[object] = []


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> list[int]:
    """The output shape of ``_grouped_mm(a, b, offs)``, as PyTorch's meta kernel has it."""
    if a.dim() == 2 and b.dim() == 2:
        if offs is None:
            raise RuntimeError("_grouped_mm of two 2-D matrices needs offs")
        return [offs.size(0), a.size(0), b.size(1)]
    if a.dim() == 2:
        return [a.size(0), b.size(-1)]
    if b.dim() == 2:
        return [a.size(1), b.size(1)]
    return [a.size(0), a.size(1), b.size(-1)]


def _is_grouped_mm(func: Any) -> bool:
    return func is torch.ops.aten._grouped_mm.default


def _grouped_mm_fake(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    given = dict(zip(names, args), **kwargs)
    a, b = given["mat_a"], given["mat_b"]
    if a.dtype == torch.bfloat16 or not _GROUPED_USERS or not _is_fake(a):
        return NotImplemented  # PyTorch's meta kernel, as without memsave_nb
    if a.dtype != b.dtype:
        raise RuntimeError(f"_grouped_mm: mat_a is {a.dtype} but mat_b is {b.dtype}")
    dtype = given.get("out_dtype") or a.dtype
    with in_kernel_invocation_manager(fake_mode):
        out = torch.empty(_grouped_mm_shape(a, b, given.get("offs")), dtype=dtype, device="meta")
    return FakeTensor(fake_mode, out, a.fake_device)


@contextlib.contextmanager
def grouped_mm_in_any_dtype() -> Iterator[None]:
    """While a fake step runs: ``aten._grouped_mm`` outside bfloat16 gets its output (see above)."""
    if not hasattr(torch.ops.aten, "_grouped_mm"):
        yield
        return
    from torch._subclasses import fake_impls

    token = object()
    entry = (_is_grouped_mm, _grouped_mm_fake)
    with _GROUPED_LOCK:
        if not _GROUPED_USERS:
            fake_impls.op_implementations_checks.insert(0, entry)
        _GROUPED_USERS.append(token)
    try:
        yield
    finally:
        with _GROUPED_LOCK:
            _GROUPED_USERS.remove(token)
            if not _GROUPED_USERS and entry in fake_impls.op_implementations_checks:
                fake_impls.op_implementations_checks.remove(entry)


# -- optimizers that read values as Python numbers ----------------------------------------------------
# torch.optim.Adafactor's step reads ``step_t.item()``, ``param.norm(2).item()`` and
# ``update.norm(2).item()``: fake tensors have no values (``DataDependentOutputException``), so a fake
# step with Adafactor failed in its optimizer phase. Those numbers only scale the update (learning-rate
# factors, a clipping divisor); no allocation depends on them. While the engine runs the optimizer's
# step in fake mode, ``Tensor.item`` on a fake tensor answers 1 (1.0 for floating tensors, True for
# bool); real tensors, and every other phase (where a value can change the path), are untouched.
_ITEM_LOCK = threading.Lock()
_ITEM_USERS: list[object] = []
_ORIGINAL_ITEM = torch.Tensor.item


def _fake_item(self: torch.Tensor) -> Any:
    # a DTensor (FSDP2's parameters and their optimizer state) is fake when its local shard is
    if not (_is_fake(self) or _is_fake(getattr(self, "_local_tensor", None))):
        return _ORIGINAL_ITEM(self)
    if self.numel() != 1:
        return _ORIGINAL_ITEM(self)  # the usual error for a tensor of several elements
    if self.dtype == torch.bool:
        return True
    return 1.0 if (self.is_floating_point() or self.is_complex()) else 1


@contextlib.contextmanager
def optimizer_numbers() -> Iterator[None]:
    """Around a fake-mode ``optimizer.step()``: ``.item()`` of a fake scalar answers 1 (see above)."""
    token = object()
    with _ITEM_LOCK:
        if not _ITEM_USERS:
            torch.Tensor.item = _fake_item  # type: ignore[method-assign,assignment]  # stub: TensorBase's, Number
        _ITEM_USERS.append(token)
    try:
        yield
    finally:
        with _ITEM_LOCK:
            _ITEM_USERS.remove(token)
            if not _ITEM_USERS:
                del torch.Tensor.item  # back to TensorBase.item
