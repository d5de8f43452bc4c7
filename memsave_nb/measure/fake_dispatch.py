"""Fake mode's dispatch, driven more cheaply while memsave_nb runs a fake step.

Most of a fake step's time is ``FakeTensorMode``'s own work per op, and most ops are hits in its
dispatch cache (a 7B-shaped step: about 9,000 hits, 340 misses, 630 bypasses). On a hit torch
still pays for (torch 2.13): the cache key, built by a generic walk (``_prep_args_for_hash``:
every tensor argument becomes a 17-field ``TensorMetadata`` dataclass, flattened field by field
with sparse checks); ``torch._dynamo.disable``'s wrapper and a call counter around each
``__torch_dispatch__``; a debug-log line formatted under ``no_dispatch()``.

While a fake step runs, ``quick_dispatch(mode)`` swaps the mode's class for a subclass that answers
cache hits from the same class-wide cache (``FakeTensorMode.cache``) and its entries, keyed by a
flat tuple of each tensor's metadata built in one pass; a hit's output is made as torch's
``_get_output_tensor_from_cache_entry`` makes it without a shape environment, its kernel guard
inlined and the ``FakeTensor``'s attributes those torch's own constructor gives one
(``_fake_tensor_fields``), set in one update instead of through five memo descriptors.

The key is at least as fine as torch's: dtype, shape, strides, device, storage offset and bytes, ``requires_grad``, conj/neg bits and inference flag (torch's other fields follow from
those for a strided tensor: memory format from shape and strides, quantization from dtype), the
default dtype and device, inference mode and tracing, as torch's key has them; it starts with a
marker of its own, so it never equals one of torch's keys. Anything else goes torch's way: misses
and bypasses (they are then stored under the quick key), arguments the quick key does not cover
(another mode's or a constant fake tensor, a real tensor, symbolic sizes, any other Python type),
a mode with a shape environment, cross-checking or debug logging, another ``FakeTensorMode``
subclass, or a torch whose internals differ (``supported()``). The mode's class is put back on
exit. ``tests/measure/test_fake_dispatch.py`` checks whole measurements equal to torch's path
(every case, optimizer knob and Hugging Face model), the key never coarser, the tensors alike.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from types import ModuleType
from typing import Any, Iterator

import torch

_ft: ModuleType | None  # None: this torch lacks the internals below
try:  # torch's private fake-tensor internals: without any of them, torch's path is kept
    from torch._subclasses import fake_tensor as _fake_tensor
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    _KEY = _fake_tensor._DispatchCacheKey
    _VALID = _fake_tensor._DispatchCacheValidEntry
    _META_HANDLERS = _fake_tensor._DISPATCH_META_HANDLERS
    _DIRECTLY = _fake_tensor._DISPATCH_HANDLE_DIRECTLY
    _LOG = _fake_tensor.log
    _normalize = FakeTensor._normalize_fake_device
    from torch.fx.experimental.proxy_tensor import get_proxy_mode as _proxy_mode

    _ft = _fake_tensor
except (ImportError, AttributeError):  # pragma: no cover - another torch
    _ft = None

_MARK = ("memsave_nb quick fake-dispatch key",)
_SCALARS = frozenset(
    {int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
)
_STRIDED = torch.strided
_FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE
_get_mode = torch._C._get_dispatch_mode
_default_device = torch._C._get_default_device
_DEBUG = logging.DEBUG
_DisableTorchDispatch, _PreserveKeys = torch._C._DisableTorchDispatch, torch._C._PreserveDispatchKeyGuard
_set_meta_in_tls, _empty_strided = torch._C._set_meta_in_tls_dispatch_include, torch.empty_strided
_set_conj, _set_neg = torch._C._set_conj, torch._C._set_neg
_OVERLOAD = torch._ops.OpOverload
_make_subclass = torch.Tensor._make_subclass
_throw_on_data_ptr, _warn_on_data_ptr = (
    torch._C._set_throw_on_mutable_data_ptr,
    torch._C._set_warn_deprecated_on_mutable_data_ptr,
)


@functools.lru_cache(maxsize=None)
def supported() -> bool:
    """Whether this torch's fake mode has the internals the quick path stands on, as 2.13 has them."""
    if _ft is None:
        return False
    try:
        params = tuple(inspect.signature(FakeTensorMode._cache_key).parameters)
        out_params = tuple(inspect.signature(FakeTensorMode._output_from_cache_entry).parameters)
    except (AttributeError, TypeError, ValueError):  # pragma: no cover
        return False
    mode = FakeTensorMode()
    info_fields = set(getattr(_ft._DispatchCacheEntryOutputInfo, "__dataclass_fields__", ()))
    return (
        params == ("self", "state", "func", "args", "kwargs")
        and out_params == ("self", "state", "entry", "key", "func", "args")
        and isinstance(getattr(FakeTensorMode, "cache", None), dict)
        and callable(getattr(FakeTensorMode, "_cached_dispatch_impl", None))
        and callable(getattr(FakeTensorMode, "dispatch", None))
        and all(
            hasattr(mode, a)
            for a in (
                "_allow_unsafe_data_ptr_access",
                "allow_meta",
                "in_kernel_invocation",
                "cache_enabled",
                "cache_crosscheck_enabled",
                "shape_env",
            )
        )
        and {"inplace_idx", "metadata", "view_idx", "constant_value"} <= info_fields
        and {"output_infos", "is_output_tuple"} <= set(getattr(_VALID, "__dataclass_fields__", ()))
    )


def _flatten(mode: Any, out: list, items: Any) -> bool:
    """Append ``items`` to ``out`` as key values; False where one is not covered (torch's key then)."""
    for a in items:
        kind = type(a)
        if kind in _SCALARS:
            out.append(kind)  # 1, 1.0 and True hash alike but make different outputs
            out.append(a)
        elif kind is FakeTensor:
            if a.fake_mode is not mode or a.constant is not None or a.layout is not _STRIDED:
                return False
            out.append(
                (
                    a.dtype,
                    a.shape,
                    a.stride(),
                    a.device,
                    a.storage_offset(),
                    a.untyped_storage().nbytes(),
                    a.requires_grad,
                    a.is_conj(),
                    a.is_neg(),
                    a.is_inference(),
                )
            )
        elif kind is list or kind is tuple:
            out.append(kind)
            out.append(len(a))
            if not _flatten(mode, out, a):
                return False
        else:
            return False
    return True


def quick_key(mode: Any, func: Any, args: Any, kwargs: Any) -> Any:
    """The quick cache key of one op, or None where it does not cover the arguments."""
    values = [
        _MARK,
        func,
        torch.get_default_dtype(),
        _default_device(),
        torch.is_inference_mode_enabled(),
        _proxy_mode() is not None,
    ]
    if args and not _flatten(mode, values, args):
        return None
    if kwargs:
        values.append(dict)
        values.append(tuple(kwargs))
        if not _flatten(mode, values, kwargs.values()):
            return None
    return _KEY(tuple(values))


if _ft is not None:

    class _QuickFakeTensorMode(FakeTensorMode):
        """``FakeTensorMode`` with cache hits answered on the quick key (see the module doc)."""

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # eager fake steps only: no torch._dynamo.disable wrapper per op

        def _cache_key(self, state: Any, func: Any, args: Any, kwargs: Any) -> Any:
            if self.shape_env is None:
                key = quick_key(self, func, args, kwargs)
                if key is not None:
                    return key
            return FakeTensorMode._cache_key(self, state, func, args, kwargs)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
            if _get_mode(_FAKE_KEY) is not None:
                return FakeTensorMode.__torch_dispatch__(self, func, types, args, kwargs or {})  # torch's error
            handler = _META_HANDLERS.get(func)
            if handler is not None:
                return handler(args)
            if (
                self.cache_enabled
                and self.shape_env is None
                and not self.cache_crosscheck_enabled
                and func not in _DIRECTLY
                and not _LOG.isEnabledFor(_DEBUG)
            ):
                key = quick_key(self, func, args, kwargs)
                if key is not None:
                    entry = FakeTensorMode.cache.get(key)
                    if type(entry) is _VALID:
                        if entry.is_output_tuple:
                            output = tuple(_output(self, info, func, args) for info in entry.output_infos)
                        else:
                            output = _output(self, entry.output_infos[0], func, args)
                        FakeTensorMode.cache_hits += 1
                        return output
            return FakeTensorMode.dispatch(self, func, types, args, kwargs or {})


def _output(mode: Any, info: Any, func: Any, args: Any) -> Any:
    """One output of a cache hit, as torch's ``_get_output_tensor_from_cache_entry`` makes it for a mode
    without a shape environment (no symbolic sizes to resolve), with its kernel-invocation guard inlined."""
    if info.inplace_idx is not None:
        return args[info.inplace_idx]  # an in-place op returns its argument
    meta = info.metadata
    if meta is None:
        return info.constant_value if info.view_idx is None else None
    prev = mode.in_kernel_invocation
    with _DisableTorchDispatch():
        mode.in_kernel_invocation = True
        with _PreserveKeys():
            _set_meta_in_tls(True)
            try:
                empty = _empty_strided(
                    meta.shape,
                    meta.stride,
                    dtype=meta.dtype,
                    layout=meta.layout,
                    device="meta",
                    requires_grad=meta.requires_grad,
                )
                if meta.is_conj:
                    _set_conj(empty, True)
                if meta.is_neg:
                    _set_neg(empty, True)
                if type(func) is _OVERLOAD and func.is_view:  # a view shares its input's storage
                    storage = args[info.view_idx].untyped_storage()
                    empty.set_(storage, meta.storage_offset, meta.shape, meta.stride)
            finally:
                mode.in_kernel_invocation = prev
    return _new_fake(mode, empty, meta.device)


@functools.lru_cache(maxsize=None)
def _fake_tensor_fields() -> tuple[tuple[str, Any], ...]:
    """The attributes ``FakeTensor.__new__`` gives a new fake tensor, as torch sets them: read off one
    made by torch's own constructor (its mode and device are set per tensor)."""
    with _DisableTorchDispatch():
        reference = FakeTensor(FakeTensorMode(), torch.empty(0, device="meta"), torch.device("cpu"))
    return tuple((k, v) for k, v in vars(reference).items() if k not in ("fake_mode", "_fake_device"))


def _new_fake(mode: Any, empty: torch.Tensor, device: torch.device) -> Any:
    """``FakeTensor(mode, empty, device)``, without its argument parsing and per-attribute descriptors."""
    assert _ft is not None  # installed (hence called) only where the internals imported
    if _ft.FakeTensorConfig.debug or (device.type == "meta" and not mode.allow_meta):
        return FakeTensor(mode, empty, device)  # torch's own (a debug trace, or its error)
    device = _normalize(device)
    t = _make_subclass(FakeTensor, empty, empty.requires_grad, dispatch_device=True, device_for_backend_keys=device)
    if not mode._allow_unsafe_data_ptr_access:
        _throw_on_data_ptr(t)
    else:
        _warn_on_data_ptr(t)
    fields = t.__dict__
    fields.update(_fake_tensor_fields())
    fields["_fake_device"] = device
    fields["fake_mode"] = mode
    return t


ENABLED = True  # False: every fake step takes torch's path (the tests compare both)
_LOCK = threading.Lock()
_USERS: dict[int, int] = {}  # id(mode) -> how many quick_dispatch blocks hold it


@contextlib.contextmanager
def quick_dispatch(mode: Any) -> Iterator[Any]:
    """While the block runs, ``mode`` (a plain ``FakeTensorMode``) answers cache hits the quick way."""
    if mode is None or not ENABLED or not supported() or (type(mode) is not FakeTensorMode and id(mode) not in _USERS):
        yield mode
        return
    with _LOCK:
        _USERS[id(mode)] = _USERS.get(id(mode), 0) + 1
        mode.__class__ = _QuickFakeTensorMode
    try:
        yield mode
    finally:
        with _LOCK:
            _USERS[id(mode)] -= 1
            if not _USERS[id(mode)]:
                del _USERS[id(mode)]
                mode.__class__ = FakeTensorMode
