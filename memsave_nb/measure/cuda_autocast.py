"""Autocast as CUDA runs it, on the CPU twin: CUDA's op lists in place of the CPU's.

Why: the twin runs ``torch.autocast("cpu")``, whose lists differ from CUDA's. CUDA runs
``layer_norm``, ``softmax``, ``log_softmax``, ``sum``, ``exp``, ``pow``, ... in fp32 (and saves their
fp32 tensors) where the CPU keeps the input's bf16/fp16; CUDA casts ``einsum``, ``mv``, ``addmv``,
``convolution`` to the low dtype where the CPU does not; the CPU promotes ``cat``/``stack``, CUDA not.

The lists are torch 2.13's ``aten/src/ATen/autocast_mode.h`` (``AT_FORALL_LOWER_PRECISION_FP``,
``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``,
``AT_FORALL_PROMOTE``) and ``autocast_mode.cpp`` (``TORCH_LIBRARY_IMPL(aten, Autocast/AutocastCPU,
m)``); the installed torch's own registrations (which ops have an ``AutocastCUDA`` / ``AutocastCPU``
kernel) check them in ``tests/measure/test_cuda_autocast.py``.

How: while a step sized for CUDA runs under autocast, every op whose CUDA policy differs from the
CPU's gets a Python kernel on the ``AutocastCPU`` dispatch key (above autograd, like autocast's own
kernels, so the casts are recorded and a checkpoint's recomputation casts again). On the thread that
opened ``cuda_autocast`` it applies CUDA's policy; on any other thread the CPU's. The C++ kernels come
back when the last user leaves. Not followed: autocast's cast cache for CUDA-only low-precision ops
(a weight used twice by ``einsum`` is cast twice here, once on CUDA), named-tensor overloads.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Iterator

import torch
from torch._C import DispatchKey, DispatchKeySet

from ..errors import WorkloadError

LOWER, FP32, SET_DTYPE, APPEND_DTYPE, PROMOTE, BANNED, NONE = (
    "lower_precision_fp",
    "fp32",
    "fp32_set_opt_dtype",
    "fp32_append_dtype",
    "promote",
    "banned",
    "none",
)


def _names(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# autocast_mode.h, torch 2.13: AT_FORALL_LOWER_PRECISION_FP, plus cudnn_convolution(_transpose) (.cpp)
CUDA_LOWER = _names("""
    _convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
    conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv
    linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
    _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention
    scaled_dot_product_attention cudnn_convolution cudnn_convolution_transpose""")
# AT_FORALL_FP32
CUDA_FP32 = _names("""
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar
    pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim
    nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
    hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
    multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss
    binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d
    _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
    _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa
    upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa""")
# AT_FORALL_FP32_SET_OPT_DTYPE (the Dimname overloads left out: named tensors)
CUDA_SET_DTYPE = _names("""
    prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm linalg_matrix_norm
    linalg_matrix_norm.str_ord sum sum.dim_IntList""")
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: norm without a dtype -> the overload with one, fp32
CUDA_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
# AT_FORALL_PROMOTE
CUDA_PROMOTE = _names("addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add")

# autocast_mode.cpp, TORCH_LIBRARY_IMPL(aten, AutocastCPU, m): lower_precision_fp and promote; every
# other op registered there is fp32 (the test holds the installed torch's registrations to this).
CPU_LOWER = _names("""
    conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm linalg_vecdot baddbmm addmm
    _addmm_activation addbmm linear _convolution.deprecated matmul conv_tbc mkldnn_rnn_layer conv_transpose1d
    conv_transpose2d.input conv_transpose3d.input prelu scaled_dot_product_attention _native_multi_head_attention""")
CPU_PROMOTE = _names("stack cat index_copy")


def cuda_policy(name: str) -> str:
    """CUDA autocast's policy for ``aten::name`` (``"op"`` or ``"op.overload"``); NONE: not listed."""
    for names, policy in (
        (CUDA_LOWER, LOWER),
        (CUDA_FP32, FP32),
        (CUDA_SET_DTYPE, SET_DTYPE),
        (tuple(CUDA_APPEND_DTYPE), APPEND_DTYPE),
        (CUDA_PROMOTE, PROMOTE),
    ):
        if name in names:
            return policy
    return BANNED if name == "binary_cross_entropy" else NONE


def cpu_policy(name: str) -> str:
    """The CPU's policy for ``aten::name``, from the installed torch's ``AutocastCPU`` registrations."""
    if name in CPU_LOWER:
        return LOWER
    if name in CPU_PROMOTE:
        return PROMOTE
    return FP32 if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "AutocastCPU") else NONE


def differing_ops() -> tuple[str, ...]:
    """The ops whose CUDA policy is not the CPU's (the ones the twin answers itself)."""
    cpu_fp32 = [
        n.removeprefix("aten::").removesuffix(".default")
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCPU")
    ]
    listed = set(CUDA_LOWER + CUDA_FP32 + CUDA_SET_DTYPE + CUDA_PROMOTE + tuple(CUDA_APPEND_DTYPE))
    listed |= {"binary_cross_entropy", *CPU_LOWER, *CPU_PROMOTE, *cpu_fp32}
    return tuple(sorted(n for n in listed if _exists(n) and cuda_policy(n) != cpu_policy(n)))


def _overload(name: str) -> Any:
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def _exists(name: str) -> bool:
    try:
        _overload(name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _eligible(t: Any) -> bool:
    """``is_eligible``: a floating tensor of the device, not float64."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """``cached_cast`` (without its cache): eligible tensors, also inside lists, to ``dtype``."""
    if _eligible(value) and value.dtype != dtype:
        return value.to(dtype)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _promote_type(values: list[Any], low: torch.dtype) -> torch.dtype:
    """``promote_type``: fp32 if any eligible argument is fp32, else the low dtype."""
    flat = [t for v in values for t in (v if isinstance(v, (list, tuple)) else (v,))]
    return torch.float32 if any(_eligible(t) and t.dtype == torch.float32 for t in flat) else low


_AUTOCAST_CPU = DispatchKeySet(DispatchKey.AutocastCPU)
_AFTER_AUTOCAST = torch._C._dispatch_keyset_full_after(DispatchKey.AutocastCPU)


def _apply(policy: str, name: str, keyset: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``aten::name`` as autocast's ``policy`` does: the casts, then the op with autocast off
    (NONE: the fallthrough, the op runs on with autocast still on for the ops inside it)."""
    op = _overload(name)
    if policy == NONE:
        return op.redispatch(keyset & _AFTER_AUTOCAST, *args, **kwargs)
    if policy == BANNED:
        raise WorkloadError(
            "binary_cross_entropy under CUDA autocast is refused by torch (autocast_mode.cpp): "
            "use binary_cross_entropy_with_logits"
        )
    low = torch.get_autocast_dtype("cpu")
    with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
        if policy == LOWER:
            return op(*(_cast(a, low) for a in args), **{k: _cast(v, low) for k, v in kwargs.items()})
        if policy == FP32:
            return op(
                *(_cast(a, torch.float32) for a in args), **{k: _cast(v, torch.float32) for k, v in kwargs.items()}
            )
        if policy == PROMOTE:
            to = _promote_type([*args, *kwargs.values()], low)
            return op(*(_cast(a, to) for a in args), **{k: _cast(v, to) for k, v in kwargs.items()})
        if policy == SET_DTYPE:
            position = [a.name for a in op._schema.arguments].index("dtype")
            given = args[position] if position < len(args) else kwargs.get("dtype")
            if given is None and _eligible(args[0]):
                args, kwargs = args[:position], {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)
        # APPEND_DTYPE: norm without a dtype runs as the overload with one (fp32 for eligible inputs)
        dtype = torch.float32 if _eligible(args[0]) else args[0].dtype
        return _overload(CUDA_APPEND_DTYPE[name])(*_positional(op, args, kwargs), dtype=dtype)


def _positional(op: Any, args: tuple, kwargs: dict) -> list:
    """Every argument of ``op``'s schema by position, defaults filled in (a Python kernel gets the
    trailing defaults left out; the overload redispatched to may have no default for them)."""
    out = []
    for i, a in enumerate(op._schema.arguments):
        out.append(args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
    return out


class CudaAutocast:
    """The ops this thread ran with CUDA's policy where the CPU's differs: ``{op: count}``."""

    def __init__(self) -> None:
        self.ops: dict[str, int] = {}


_LOCAL = threading.local()
_USERS = [0]
_GUARD = threading.Lock()
_LIBRARY: list[Any] = []


def _kernel(name: str):
    cpu = cpu_policy(name)

    def kernel(keyset, *args, **kwargs):
        active = getattr(_LOCAL, "stack", None)
        if not active:
            return _apply(cpu, name, keyset, args, kwargs)
        record = active[-1].ops
        record[name] = record.get(name, 0) + 1
        return _apply(cuda_policy(name), name, keyset, args, kwargs)

    return kernel


def _register() -> None:
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": meant, undone on exit
        warnings.simplefilter("ignore")
        for name in differing_ops():
            library.impl(name, _kernel(name), "AutocastCPU", with_keyset=True)
    _LIBRARY.append(library)


@contextlib.contextmanager
def cuda_autocast() -> Iterator[CudaAutocast]:
    """While open, ``torch.autocast("cpu")`` on this thread follows CUDA's op lists (the dtype stays
    the CPU autocast's, which stands for CUDA's)."""
    answer = CudaAutocast()
    with _GUARD:
        if not _USERS[0]:
            _register()
        _USERS[0] += 1
    stack = _LOCAL.__dict__.setdefault("stack", [])
    stack.append(answer)
    try:
        yield answer
    finally:
        stack.pop()
        with _GUARD:
            _USERS[0] -= 1
            if not _USERS[0]:
                _LIBRARY.pop()._destroy()


@contextlib.contextmanager
def sized_autocast(workload: Any) -> Iterator[CudaAutocast | None]:
    """``cuda_autocast`` for a step sized for CUDA under autocast on CPU tensors (real or fake: the
    engine in either mode, the per-rank runners); else nothing (None). A step on a CUDA device runs
    CUDA's own autocast kernels and needs none of this."""
    if (
        getattr(workload, "sized_for", None) != "cuda"
        or getattr(workload, "autocast_dtype", None) is None
        or torch.device(getattr(workload, "device", "cpu")).type != "cpu"
    ):
        yield None
        return
    with cuda_autocast() as answer:
        yield answer


def autocast_note(answer: CudaAutocast | None) -> tuple[str, ...]:
    """The measurement's note on the ops that ran with CUDA's autocast policy, not the CPU's."""
    if answer is None or not answer.ops:
        return ()
    top = sorted(answer.ops, key=lambda n: -answer.ops[n])
    shown = ", ".join(top[:6]) + (f" and {len(top) - 6} more" if len(top) > 6 else "")
    return (
        f"autocast as CUDA runs it: {shown} followed CUDA's op lists, not the CPU's "
        "(e.g. layer_norm and softmax in fp32; torch's aten/src/ATen/autocast_mode.h)",
    )
