"""timm models, where timm imports beside the pinned torch. Here it usually does not: timm imports
torchvision, and the only torchvision wheels reachable are CUDA builds that do not import beside
torch 2.13.0+cpu. The test says which of these it met when it skips."""

from __future__ import annotations

import pytest
import torch

from memsave_nb.checkpointing import suggest_regions
from memsave_nb.measure import measure
from memsave_nb.plan import Plan
from memsave_nb.workload import Workload
from .real_steps import assert_same_grads, step_grads


def _timm():
    try:
        import timm
    except ModuleNotFoundError as exc:
        pytest.skip(
            f"timm is not installed ({exc}); it needs a torchvision that imports beside torch {torch.__version__}"
        )
    except Exception as exc:  # noqa: BLE001 - e.g. torchvision built for another torch
        pytest.skip(f"timm does not import beside torch {torch.__version__}: {type(exc).__name__}: {exc}")
    return timm


@pytest.mark.parametrize("name, shape", [("resnet18", (2, 3, 32, 32)), ("vit_tiny_patch16_224", (1, 3, 224, 224))])
def test_timm_model(name, shape):
    timm = _timm()
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10)
    x = torch.randn(*shape)
    wl = Workload(model, x)
    real = measure(wl, "real", repeats=0, flops=False)
    fake = measure(wl, "fake", flops=False)
    assert (fake.peak_bytes, fake.saved_bytes) == (real.peak_bytes, real.saved_bytes)
    blocks = suggest_regions(model)
    assert blocks
    expected = step_grads(wl)
    for policy in ("full", "save_matmuls"):
        with Plan(regions={b: policy for b in blocks}).apply(wl) as applied:
            assert_same_grads(step_grads(applied), expected)
