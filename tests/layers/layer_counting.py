"""A test-local counter of saved activation bytes, independent of memsave_nb.measure.

It watches every tensor created under a TorchDispatchMode and, after forward, sums the bytes
of the storages still alive, each storage once, excluding the ones given (parameters,
inputs, the loss). It sees tensors kept outside autograd's saved-tensor hooks too.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memsave_nb.layers import compact


class LiveStorages(TorchDispatchMode):
    """Records (weakly) each storage created by an op under this mode."""

    def __init__(self) -> None:
        super().__init__()
        self.created: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                seen = self.created.get(key)
                if seen is None or seen[0].expired():
                    self.created[key] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive_bytes(self, exclude: Iterable[Tensor] = ()) -> int:
        skip = {t.untyped_storage()._cdata for t in exclude}
        return sum(nbytes for key, (ref, nbytes) in self.created.items() if not ref.expired() and key not in skip)


def saved_bytes(fn: Callable[..., Tensor], *inputs: Tensor, params: Iterable[Tensor] = ()) -> int:
    """Bytes kept alive after ``loss = fn(*inputs).sum()`` beyond inputs, params and the loss."""
    mode = LiveStorages()
    with mode:
        out = fn(*inputs)
        loss = out.float().sum()
        del out
        compact()  # what convert's root hook does after a model's forward
    return mode.alive_bytes(exclude=[loss, *inputs, *params])


def module_saved_bytes(module: nn.Module, x: Tensor) -> int:
    """Saved bytes of ``module(x * 1)``: the input copy counts when the module keeps it."""
    params = [*module.parameters(), *module.buffers()]
    return saved_bytes(lambda t: module(t * 1), x, params=params)
