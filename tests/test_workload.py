"""Workload: batches of every shape a model takes, the default loss, optimizers, devices."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from memsave_nb import Workload, WorkloadError
from memsave_nb.workload import default_loss, iter_tensors, map_tensors


class TwoArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, a, b=None):
        return self.fc(a) + (0 if b is None else b)


@dataclass
class Out:
    loss: torch.Tensor
    logits: torch.Tensor


Pair = namedtuple("Pair", "a b")

BATCHES = {
    "tensor": lambda: torch.ones(4, 3),
    "tuple": lambda: (torch.ones(4, 3), torch.zeros(4, 2)),
    "list": lambda: [torch.ones(4, 3), torch.zeros(4, 2)],
    "dict": lambda: {"a": torch.ones(4, 3), "b": torch.zeros(4, 2)},
    "factory": lambda: lambda: torch.ones(4, 3),
}


@pytest.mark.parametrize("kind", list(BATCHES))
def test_forward_takes_each_batch_kind(kind):
    wl = Workload(TwoArgs(), BATCHES[kind]())
    out = wl.forward(wl.make_batch())
    assert out.shape == (4, 2)
    assert wl.compute_loss(out).shape == ()


def test_factory_makes_a_fresh_batch_each_time():
    wl = Workload(TwoArgs(), lambda: torch.randn(4, 3))
    assert wl.make_batch() is not wl.make_batch()


def test_dtype_and_input_grad_apply_to_floating_tensors_only():
    wl = Workload(
        nn.Embedding(5, 3),
        {"input": torch.tensor([1, 2]), "x": torch.ones(2)},
        dtype=torch.float64,
        input_requires_grad=True,
    )
    b = wl.make_batch()
    assert b["input"].dtype == torch.int64 and not b["input"].requires_grad
    assert b["x"].dtype == torch.float64 and b["x"].requires_grad


def test_default_loss():
    t = torch.arange(3.0)
    assert default_loss(t).item() == 3.0
    assert default_loss(Out(loss=torch.tensor(2.0), logits=t)).item() == 2.0
    assert default_loss({"loss": torch.tensor(5.0), "logits": t}).item() == 5.0
    assert default_loss((t, t)).item() == 6.0
    with pytest.raises(WorkloadError, match="no floating-point tensor"):
        default_loss((torch.tensor([1, 2]),))


def test_non_scalar_loss_is_one_line():
    wl = Workload(TwoArgs(), torch.ones(4, 3), loss=lambda out: out)
    with pytest.raises(WorkloadError, match=r"the loss must be a scalar, got shape \(4, 2\)"):
        wl.compute_loss(wl.forward(wl.make_batch()))


@pytest.mark.parametrize(
    "spec,kind", [("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD), ("adam", torch.optim.Adam)]
)
def test_optimizer_over_trainable_parameters_only(spec, kind):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    model[0].requires_grad_(False)
    opt = Workload(model, torch.ones(1, 3), optimizer=spec).make_optimizer()
    assert isinstance(opt, kind)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model[1].parameters()}


def test_no_optimizer_cases():
    model = nn.Linear(3, 2)
    assert Workload(model, torch.ones(1, 3), optimizer=None).make_optimizer() is None
    assert Workload(model, torch.ones(1, 3), optimizer="none").make_optimizer() is None
    assert Workload(model.requires_grad_(False), torch.ones(1, 3)).make_optimizer() is None
    factory = Workload(
        nn.Linear(3, 2), torch.ones(1, 3), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)
    ).make_optimizer()
    assert isinstance(factory, torch.optim.SGD)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_devices_that_exist(device):
    assert Workload(nn.Linear(3, 2), torch.ones(1, 3), device=device).device == device


@pytest.mark.parametrize("device,message", [("tpu9", "unknown device"), ("cuda:7", "not available")])
def test_devices_that_do_not(device, message):
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    with pytest.raises(WorkloadError, match=message):
        Workload(nn.Linear(3, 2), torch.ones(1, 3), device=device)


def test_map_and_iter_tensors_keep_structure():
    nested = {"a": [torch.ones(1), (torch.zeros(2), 3)], "p": Pair(torch.ones(3), "x")}
    mapped = map_tensors(nested, lambda t: t + 1)
    assert isinstance(mapped["p"], Pair) and mapped["p"].b == "x"
    assert mapped["a"][1][1] == 3 and torch.equal(mapped["a"][1][0], torch.ones(2))
    assert [t.numel() for t in iter_tensors(nested)] == [1, 2, 3]
    assert [t.numel() for t in iter_tensors(Out(torch.ones(1), torch.ones(4)))] == [1, 4]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("accumulation_steps", 0, "accumulation_steps must be a whole number >= 1, got 0"),
        ("accumulation_steps", "2", "accumulation_steps must be a whole number >= 1, got '2'"),
        ("accumulation_steps", True, "accumulation_steps must be a whole number >= 1, got True"),
        ("set_to_none", "yes", "set_to_none must be True or False, got 'yes'"),
        ("autocast_dtype", torch.float32, "autocast_dtype must be torch.bfloat16, torch.float16 or None"),
        ("autocast_dtype", "bf16", "autocast_dtype must be torch.bfloat16, torch.float16 or None"),
    ],
)
def test_step_knobs_are_validated(field, value, message):
    with pytest.raises(WorkloadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Workload(TwoArgs(), torch.ones(4, 3), **{field: value})


def test_step_knob_defaults():
    wl = Workload(TwoArgs(), torch.ones(4, 3))
    assert (wl.accumulation_steps, wl.set_to_none, wl.autocast_dtype) == (1, True, None)


def test_forward_runs_under_autocast():
    wl = Workload(TwoArgs(), torch.ones(4, 3), autocast_dtype=torch.bfloat16)
    assert wl.forward(wl.make_batch()).dtype == torch.bfloat16
    assert Workload(TwoArgs(), torch.ones(4, 3)).forward(torch.ones(4, 3)).dtype == torch.float32


def test_output_tensors_reach_into_caches():
    from memsave_nb.workload import iter_output_tensors, output_parts

    class Layer:
        def __init__(self):
            self.keys, self.values = torch.ones(2), torch.zeros(2)

    class Cache:
        def __init__(self):
            self.layers = [Layer(), Layer()]

    out = {"logits": torch.ones(3), "past_key_values": Cache(), "hidden": (torch.ones(1), None)}
    assert len(list(iter_output_tensors(out))) == 6
    assert [(name, len(ts)) for name, ts in output_parts(out)] == [("logits", 1), ("past_key_values", 4), ("hidden", 1)]
    assert output_parts(torch.ones(1))[0][0] == "output"


def test_accumulation_steps_past_the_bound_is_one_line_and_fast():
    """Each micro-step is run, so 2**63 of them never ended (issue 38's resources): refused at once."""
    import time

    from memsave_nb.errors import WorkloadError
    from memsave_nb.workload import MAX_ACCUMULATION_STEPS

    model = torch.nn.Linear(4, 2)
    Workload(model, torch.randn(2, 4), accumulation_steps=MAX_ACCUMULATION_STEPS)  # the bound itself is taken
    for k in (MAX_ACCUMULATION_STEPS + 1, 2**63, 10**5000):
        start = time.perf_counter()
        with pytest.raises(WorkloadError, match="at most 1024") as err:
            Workload(model, torch.randn(2, 4), accumulation_steps=k)
        assert time.perf_counter() - start < 1 and len(str(err.value)) <= 200 and "\n" not in str(err.value)
