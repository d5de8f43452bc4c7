"""Hold an activation's output while someone else keeps it anyway; shrink it to a 1-bit mask
when the holder is the last one left.

Why: a ReLU needs only the sign pattern of its output for backward (1 bit per element), but
when the next layer (a conv with a trainable weight, say) keeps the very same output tensor,
storing a separate mask costs bytes instead of saving them. So a ReLU first holds a detached
alias of its output (no new memory), and :func:`compact` later replaces it by a packed mask
once nothing but this holder keeps the storage alive.

``compact`` runs at the start of every memory-saving layer's forward and after the root
forward of a model converted with :func:`memsave_nb.layers.convert`; call it yourself after a
forward of a model whose last layers are not converted.

The trick works only where autograd's saved-tensor hooks are not active (checkpointing and
saved-tensor hooks must see every saved tensor, so there the layers save the mask at once),
and not while ``torch.compile`` traces.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor

from ._bits import pack_bits, pack_inside, positive
from ._native import pack_nonzero, pack_positive

# A storage held by our alias alone shows two uses: the alias and the temporary Python
# storage object created to ask for the count.
_SOLE_HOLDER_USES = 2


class OutputHolder:
    """A detached alias of an output, or (after compaction) its packed positive mask.

    ``key`` (the layer module, optional) lets the holder remember, per layer, whether the
    output was left to it alone last time (see :func:`pack_early`)."""

    __slots__ = ("output", "version", "packed", "shape", "relu", "bounds", "key", "__weakref__")

    def __init__(
        self, output: Tensor, relu: bool = True, bounds: tuple[float, float] | None = None, key: object = None
    ) -> None:
        self.relu = relu
        self.bounds = bounds  # hardtanh: the gradient passes strictly between the bounds
        self.output: Tensor | None = output.detach()
        self.version = output._version
        self.packed: Tensor | None = None
        self.shape = output.shape
        self.key = None if key is None else weakref.ref(key)

    def pack_now(self) -> None:
        """Pack the mask from the held output now, keeping the output too (until
        :meth:`try_compact` drops it, or :meth:`settle` drops the mask)."""
        output = self.output
        if output is None or self.packed is not None:
            return
        packed = None
        if self.bounds is not None:
            packed = pack_inside(output, *self.bounds)
        elif self.relu:
            packed = pack_nonzero(output)  # one fused pass, where it runs
        else:
            packed = pack_positive(output)  # leaky (slope > 0): positive where its input was
        self.packed = pack_bits(self._passes(output)) if packed is None else packed

    def try_compact(self) -> bool:
        """Swap the output for a packed mask if no one else holds its storage; True when done."""
        output = self.output
        if output is None:
            return True
        if output._version != self.version:
            return False  # modified in place: leave it for backward to report
        uses = torch._C._storage_Use_Count(output.untyped_storage()._cdata)
        if uses > _SOLE_HOLDER_USES:
            return False
        self.pack_now()
        self.output = None
        self._remember(True)
        return True

    def settle(self) -> None:
        """End of the forward: the output is still kept by someone else (a layer saved it for
        backward, or the model returned it), so a mask packed early is not needed: drop it."""
        if self.output is not None and self.packed is not None:
            self.packed = None
        self._remember(False)

    def _remember(self, sole: bool) -> None:
        key = None if self.key is None else self.key()
        if key is not None:
            try:
                _left_alone[key] = sole
            except TypeError:  # not weak-referenceable: no memory of it
                pass

    def _passes(self, output: Tensor) -> Tensor:
        """Where the gradient passes, from the output (bool)."""
        if self.bounds is not None:
            return inside_mask(output, *self.bounds)
        # a ReLU output is >= 0 (or NaN, which backward lets through): nonzero is the test;
        # a leaky output (slope > 0) is positive exactly where its input was
        return output.bool() if self.relu else positive(output)

    def release(self) -> None:
        """Drop what is held (the alias or the mask), as autograd frees saved tensors once
        backward has used them: the graph's nodes, and this holder with them, may outlive
        backward while the step's loss is alive."""
        self.output = None
        self.packed = None

    def held_output(self) -> Tensor | None:
        """The output if still held (checked against in-place changes), else None."""
        output = self.output
        if output is None:
            return None
        if output._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: the output of a memory-saving activation is at version "
                f"{output._version}; expected version {self.version} instead."
            )
        return output

    def packed_mask(self) -> Tensor:
        """The packed mask of where the output passed the gradient (packing it now if the
        output is still held)."""
        self.pack_now()
        assert self.packed is not None
        return self.packed


def inside_mask(output: Tensor, low: float, high: float) -> Tensor:
    """Where a hardtanh output lies strictly between its bounds (there the input did too), as
    bool. Stock's own backward kernel run on a nonzero stand-in, then a bool cast: about a
    fifth of the time of two comparisons and an ``&`` on this CPU."""
    nonzero_inside = output if low >= 0 else output - low  # > 0 wherever inside
    return torch.ops.aten.hardtanh_backward(nonzero_inside, output, low, high).bool()


# layer -> whether its last held output was left to the holder alone before the end of the
# forward (then its mask is needed, and packing it at once, while the output is still in the
# cache, costs a fraction of packing it later from memory)
_left_alone: "weakref.WeakKeyDictionary[object, bool]" = weakref.WeakKeyDictionary()


def pack_early(key: object) -> bool:
    """True when the layer ``key``'s held output was left to its holder alone last time: its
    mask is then packed in its forward, beside the held output (see :meth:`OutputHolder.settle`
    for a guess that turns out wrong). A speed choice only: what is kept through backward is
    the same either way, when the root forward hook of :func:`memsave_nb.layers.convert` runs."""
    if key is None:
        return False
    try:
        return _left_alone.get(key, False)
    except TypeError:
        return False


_pending: list[weakref.ref[OutputHolder]] = []
_lock = threading.RLock()  # a UI thread and a measuring thread may both run models


def register(holder: OutputHolder) -> None:
    """Remember a holder so that a later :func:`compact` can shrink it."""
    with _lock:
        _pending.append(weakref.ref(holder))


# Layers look back this many holders: an output dropped by the model's code is usually
# released within a few layers; older ones are kept by a saver (or a long skip connection)
# and are left to the full sweep after the root forward. Keeps forward O(layers).
RECENT = 8
_PRUNE_AT = 4096


def compact(recent: int | None = None, final: bool = False) -> int:
    """Shrink held outputs that no one else keeps to packed masks; returns how many.

    ``recent`` limits the sweep to the latest holders (what layers do at each forward);
    ``None`` sweeps all (what :func:`memsave_nb.layers.convert`'s root hook does, with
    ``final=True``: holders whose output is still kept elsewhere then drop a mask packed
    early, and remember that for the next step).
    """
    if not _pending or torch.compiler.is_compiling() or _inside_saved_tensor_hooks():
        return 0
    return _compact(recent, final)


def _compact(recent: int | None, final: bool) -> int:
    """:func:`compact` once its guards have passed. Only the swept tail of the list is
    rewritten, so a layer's sweep costs O(recent), not O(holders pending)."""
    with _lock:
        if recent is not None and len(_pending) > _PRUNE_AT:
            recent = None  # without convert's root sweep, dead entries would pile up
        start = 0 if recent is None else max(0, len(_pending) - recent)
        done = 0
        still: list[weakref.ref[OutputHolder]] = []
        for ref in _pending[start:]:
            holder = ref()
            if holder is None:
                continue
            if holder.try_compact():
                done += 1
            else:
                if final:
                    holder.settle()
                still.append(ref)
        _pending[start:] = still
    return done


def begin_layer() -> bool:
    """What a holding layer asks at the start of its forward, in one call: sweep the recent
    holders (:func:`compact` with :data:`RECENT`) and return whether this layer may hold its
    output (:func:`lazy_allowed`). Both refuse under a compiler and inside saved-tensor hooks."""
    if torch.compiler.is_compiling() or _inside_saved_tensor_hooks():
        return False
    if _pending:
        _compact(RECENT, False)
    return True


def _inside_saved_tensor_hooks() -> bool:
    """True inside a checkpointed forward or its recomputation (or any saved-tensor hooks).

    Compacting there would run packing ops (``gt``, bit packing) of layers *outside* the region
    inside it: selective checkpointing caches op outputs and hands them back by op order at
    recomputation, so extra or missing ops there give wrong gradients or "not found in storage".
    Pending holders wait for the next compaction outside (the region wrapper's flush, the next
    layer after the region, or convert's root sweep).
    """
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def lazy_allowed() -> bool:
    """True when holding outputs outside autograd's saved tensors is safe and visible to no hook."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None
