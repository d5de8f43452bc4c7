"""Call an autograd Function without the Python wrapper's per-call work where it has none to do.

``Function.apply`` (torch/autograd/function.py) inspects ``setup_context``, checks for
functorch transforms and unwraps dead functorch wrappers before calling the C++ apply; that
costs about 7 us per call here, paid by every converted layer in forward. Outside compilers
and functorch transforms only the unwrapping matters, and it is one C++ call per tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_transforms_active = torch._C._are_functorch_transforms_active
_C_APPLY = torch._C._FunctionBase.__dict__["apply"]
_bound: dict[type, Any] = {}


def apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)`` for a Function without ``setup_context`` (forward takes ctx)."""
    if torch.compiler.is_compiling() or _transforms_active():
        return fn.apply(*args)  # dynamo and functorch handle Functions through this entry
    call = _bound.get(fn)
    if call is None:
        call = _bound[fn] = _C_APPLY.__get__(None, fn)
    return call(*[_unwrap_if_dead(a) if isinstance(a, Tensor) else a for a in args])


def stock_refuses_inplace(x: Tensor) -> bool:
    """True for a tensor that requires grad and on which stock's autograd refuses an in-place
    op: a leaf, or a view whose base is a leaf (autograd's ``check_inplace`` asks just that).
    Stock raises before touching the data; a Function would change the data first and fail
    only after (at ``mark_dirty``), so the layers run stock's op there, which raises its own
    error and leaves the tensor as it was."""
    if x.is_leaf:
        return True
    base = x._base
    return base is not None and base.is_leaf
