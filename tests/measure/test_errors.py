"""User mistakes: one line naming what went wrong (and where), the model left exactly as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_nb import StepError, Workload, WorkloadError, measure, zoo
from memsave_nb.model_state import ModelSnapshot


class RaisesOOM(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.fc(x)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore detail on a second line")


class RootRaises(nn.Module):
    """Fails in its own forward, after its child ran (as T5's top-level forward can)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).view(3, -1)


def _failing_loss(out):
    return out.sum() + torch.ones(2, 3) @ torch.ones(4, 5)


def _small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


ERRORS = {
    # name: (build the call, error type, pieces of the message)
    "wrong_shape": (
        lambda: measure(zoo.make("cnn", 2).replace(batch=torch.randn(2, 5, 32, 32)), repeats=0),
        StepError,
        ["step failed during forward in module 'stem.0' (Conv2d)", "expected input[2, 5, 32, 32] to have 3 channels"],
    ),
    "wrong_shape_fake": (
        lambda: measure(zoo.make("cnn", 2).replace(batch=torch.randn(2, 5, 32, 32)), "fake"),
        StepError,
        ["step failed during forward in module 'stem.0' (Conv2d)"],
    ),
    "wrong_shape_nested": (
        lambda: measure(zoo.make("cnn", 2).replace(batch=torch.randn(2, 3, 32, 32, 1)), repeats=0),
        StepError,
        ["step failed during forward in module 'stem.0' (Conv2d)"],
    ),
    "non_scalar_loss": (
        lambda: measure(zoo.make("mlp", 4).replace(loss=lambda out: out), repeats=0),
        WorkloadError,
        ["the loss must be a scalar, got shape (4, 10)"],
    ),
    "loss_not_a_tensor": (
        lambda: measure(zoo.make("mlp", 4).replace(loss=lambda out: 1.0), repeats=0),
        WorkloadError,
        ["the loss function returned float, not a tensor"],
    ),
    "nothing_to_differentiate": (
        lambda: measure(Workload(_small().requires_grad_(False), torch.randn(4, 4)), repeats=0),
        WorkloadError,
        ["nothing to differentiate"],
    ),
    "loss_detached": (
        lambda: measure(Workload(_small(), torch.randn(4, 4), loss=lambda out: out.detach().sum()), repeats=0),
        WorkloadError,
        ["the loss does not depend on anything that requires grad"],
    ),
    "unknown_zoo_name": (
        lambda: zoo.make("resnet-9000"),
        WorkloadError,
        ["unknown demo model 'resnet-9000'", "cnn, gpt, mlp, gpt-7b"],
    ),
    "unknown_mode": (lambda: measure(zoo.make("mlp", 4), mode="fast"), WorkloadError, ["unknown mode 'fast'"]),
    "unknown_optimizer": (
        lambda: Workload(_small(), torch.randn(4, 4), optimizer="sophia"),
        WorkloadError,
        ["unknown optimizer 'sophia'"],
    ),
    "batch_without_tensor": (
        lambda: measure(Workload(_small(), "hello"), repeats=0),
        WorkloadError,
        ["the batch holds no tensor"],
    ),
    "model_not_a_module": (
        lambda: Workload(lambda x: x, torch.randn(2)),
        WorkloadError,
        ["model must be a torch.nn.Module"],
    ),
    "fake_model_in_real_mode": (
        lambda: measure(zoo.make("gpt-7b"), repeats=0),
        WorkloadError,
        ["measure it with mode='fake'"],
    ),
    "out_of_memory": (
        lambda: measure(Workload(nn.Sequential(nn.Linear(4, 4), RaisesOOM()), torch.randn(2, 4)), repeats=0),
        StepError,
        [
            "step failed during forward in module '1' (RaisesOOM): out of memory: CUDA out of memory. Tried to allocate 20.00 GiB"
        ],
    ),
}
ERRORS.update(
    {
        "root_forward": (
            lambda: measure(Workload(RootRaises(), torch.randn(2, 4)), repeats=0),
            StepError,
            ["step failed during forward in module <root> (RootRaises): RuntimeError: shape '[3, -1]' is invalid"],
        ),
        "root_forward_fake": (
            lambda: measure(Workload(RootRaises(), torch.randn(2, 4)), "fake"),
            StepError,
            ["step failed during forward in module <root> (RootRaises)"],
        ),
        "loss_raises": (
            lambda: measure(Workload(_small(), torch.randn(4, 4), loss=_failing_loss), repeats=0),
            StepError,
            ["step failed in the loss: RuntimeError: mat1 and mat2 shapes cannot be multiplied"],
        ),
        "repeats_text": (
            lambda: measure(zoo.make("mlp", 4), repeats="3"),
            WorkloadError,
            ["repeats must be a whole number >= 0, got '3'"],
        ),
        "repeats_negative": (
            lambda: measure(zoo.make("mlp", 4), repeats=-1),
            WorkloadError,
            ["repeats must be a whole number >= 0, got -1"],
        ),
        "repeats_float": (
            lambda: measure(zoo.make("mlp", 4), repeats=2.0),
            WorkloadError,
            ["repeats must be a whole number >= 0, got 2.0"],
        ),
    }
)
if not torch.cuda.is_available():
    ERRORS["no_cuda_workload"] = (
        lambda: Workload(_small(), torch.randn(4, 4), device="cuda"),
        WorkloadError,
        ["device 'cuda' is not available"],
    )
    ERRORS["no_cuda_zoo"] = (
        lambda: zoo.make("cnn", device="cuda:0"),
        WorkloadError,
        ["device 'cuda:0' is not available"],
    )


@pytest.mark.parametrize("name", list(ERRORS))
def test_one_line_error(name):
    call, kind, pieces = ERRORS[name]
    with pytest.raises(kind) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    for piece in pieces:
        assert piece in message


def test_step_error_names_phase_module_and_keeps_cause():
    wl = zoo.make("cnn", 2).replace(batch=torch.randn(2, 5, 32, 32))
    with pytest.raises(StepError) as info:
        measure(wl, repeats=0)
    assert info.value.phase == "forward"
    assert info.value.module == "stem.0"
    assert isinstance(info.value.cause, RuntimeError)


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_model_restored_after_failure(mode):
    """The model fails half-way through (after BN statistics moved and grads may exist)."""

    class FailsLate(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _small()

        def forward(self, x):
            out = self.body(x)
            if out.shape[0] == 4:
                raise RuntimeError("late failure")
            return out

    model = FailsLate()
    model.body[0].weight.grad = torch.ones_like(model.body[0].weight)
    model.body[3].requires_grad_(False)
    model.body[1].eval()
    handle = model.body[2].register_forward_hook(lambda *a: None)
    before = ModelSnapshot.capture(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StepError, match="late failure"):
        measure(Workload(model, torch.randn(4, 4)), mode, repeats=0)
    assert before.differences(model) == []
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    handle.remove()


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_cancelled_run_restores_model(mode):
    import threading

    from memsave_nb import Cancelled

    wl = zoo.make("cnn", 2)
    before = ModelSnapshot.capture(wl.model)
    event = threading.Event()
    event.set()
    with pytest.raises(Cancelled):
        measure(wl, mode, repeats=0, cancel_event=event)
    assert before.differences(wl.model) == []
