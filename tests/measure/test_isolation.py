"""measure() changes nothing outside the model either: an optimizer the user holds, a batch
leaf that requires grad, a model measured from two threads at once; and meta-device models
measure in fake mode exactly like the same model built under FakeTensorMode."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from memsave_nb import Workload, WorkloadError, measure, zoo
from memsave_nb.model_state import ModelSnapshot


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _state_bits(opt):
    return {
        (i, k): (v.clone() if isinstance(v, torch.Tensor) else v)
        for i, s in enumerate(opt.state.values())
        for k, v in s.items()
    }


@pytest.mark.parametrize("trained_steps", [0, 3])
def test_an_optimizer_the_user_holds_is_left_as_it_was(trained_steps):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(trained_steps):  # the user trained a bit: state exists with step == 3
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    before_state = _state_bits(opt)
    before_objects = {id(p): (s, {k: v for k, v in s.items()}) for p, s in opt.state.items()}
    groups = [dict(g) for g in opt.param_groups]
    snapshot = ModelSnapshot.capture(model)
    m = measure(Workload(model, torch.randn(4, 8), optimizer=lambda params: opt), repeats=2)
    assert m.peak_split.optimizer_state > 0
    assert snapshot.differences(model) == []
    assert bool(opt.state) == bool(trained_steps)  # no state left behind, none taken away
    after = _state_bits(opt)
    assert after.keys() == before_state.keys()
    for key, v in before_state.items():
        assert torch.equal(after[key], v) if isinstance(v, torch.Tensor) else after[key] == v
    for p, s in opt.state.items():  # the same dict and tensor objects
        obj, items = before_objects[id(p)]
        assert s is obj and all(s[k] is items[k] for k in items)
    assert [dict(g) for g in opt.param_groups] == groups


def test_an_optimizer_over_other_tensors_is_refused():
    other = nn.Linear(2, 2)
    wl = Workload(_mlp(), torch.randn(4, 8), optimizer=lambda params: torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(WorkloadError, match="not the model's parameters"):
        measure(wl, repeats=0)


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_a_batch_leaf_that_requires_grad_keeps_no_grad(mode):
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.randn(4, 8, requires_grad=True)
    y.grad = torch.full_like(y, 7.0)  # a grad the user put there stays, untouched
    grad = y.grad
    measure(Workload(_mlp(), x), mode, repeats=1)
    measure(Workload(_mlp(), {"input": y}), mode, repeats=1)
    assert x.grad is None
    assert y.grad is grad and torch.all(y.grad == 7.0)


def test_two_threads_measuring_one_model_take_turns():
    wl = zoo.make("cnn", 2)
    snapshot = ModelSnapshot.capture(wl.model)
    expected = measure(wl, repeats=0)
    results, errors = [], []

    def work(mode):
        try:
            for _ in range(2):
                results.append(measure(wl, mode, repeats=1 if mode == "real" else 0))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(mode,)) for mode in ("real", "fake", "real")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 6
    assert {(r.peak_bytes, r.saved_bytes, r.output_bytes) for r in results} == {
        (expected.peak_bytes, expected.saved_bytes, expected.output_bytes)
    }
    assert snapshot.differences(wl.model) == []


# -- meta device ----------------------------------------------------------------------------------


def _compare_meta_and_fake(build, batch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    with torch.device("meta"):
        meta_model = build()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_model = build()
    on_meta = measure(Workload(meta_model, batch), "fake")
    under_fake = measure(Workload(fake_model, batch), "fake")
    assert on_meta.peak_bytes == under_fake.peak_bytes
    assert on_meta.first_step_peak_bytes == under_fake.first_step_peak_bytes
    assert on_meta.peak_split == under_fake.peak_split
    assert on_meta.saved_bytes == under_fake.saved_bytes and on_meta.output_bytes == under_fake.output_bytes
    assert [(r.name, r.saved_bytes_own, r.output_bytes_own) for r in on_meta.modules] == [
        (r.name, r.saved_bytes_own, r.output_bytes_own) for r in under_fake.modules
    ]
    assert on_meta.timeline.total() == under_fake.timeline.total()
    assert all(p.device.type == "meta" for p in meta_model.parameters())  # left as it was
    return on_meta


def test_meta_device_model_in_fake_mode_equals_fake_built():
    m = _compare_meta_and_fake(
        lambda: nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(4, 8)
    )
    real = measure(Workload(_mlp(), torch.randn(4, 8)), repeats=0)
    assert m.peak_bytes == real.peak_bytes


def test_meta_device_model_in_real_mode_says_use_fake():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(WorkloadError, match="mode='fake'"):
        measure(Workload(model, torch.randn(2, 4)), repeats=0)


def test_meta_device_zoo_gpt_in_fake_mode_equals_fake_built():
    cfg = zoo.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)
    idx = torch.randint(0, 128, (2, 32))
    _compare_meta_and_fake(lambda: zoo.GPT(cfg), {"idx": idx, "targets": idx})


def test_two_sessions_on_one_model_in_threads():
    """Two Sessions, each on its own thread, running plans that freeze and convert layers of the
    same model: every run sees a whole model (the plan's changes happen under the model's lock)."""
    from memsave_nb.plan import Plan
    from memsave_nb.session import Session

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )
    wl = Workload(model, torch.randn(16, 32))
    snapshot = ModelSnapshot.capture(wl.model)
    plans = [Plan(), Plan(frozen=["0"]), Plan(memsave=["*"]), Plan(bn_eval=["*"])] * 2
    expected = [Session(wl, "fake").run(p).measurement.peak_bytes for p in plans]
    results: dict[int, list[int]] = {0: [], 1: []}
    errors = []

    def work(i):
        try:
            session = Session(wl, "real" if i else "fake", repeats=0)
            for p in plans:
                results[i].append(session.run(p).measurement.peak_bytes)
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results[0] == results[1] == expected
    assert snapshot.differences(wl.model) == []
