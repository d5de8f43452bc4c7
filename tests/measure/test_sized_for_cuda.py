"""A model by name is sized as CUDA runs its step, and every door says so (issue 40, part 2).

torch picks an optimizer's implementation from its parameters' device
(``torch/optim/optimizer.py``, ``_default_to_fused_or_foreach``): the single-tensor loop on the
CPU, the foreach step on CUDA. A CPU twin of a GPU step must run the GPU's choice, and the explorer,
the CLI and a notebook that asks for ``adamw_foreach`` by hand must give one answer."""

from __future__ import annotations

import torch

from memsave_nb import Plan, measure, zoo
from memsave_nb.hub import from_pretrained
from memsave_nb.workload import Workload, follow_cuda_default

SMALL = dict(
    overrides=dict(
        num_hidden_layers=2,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    ),
    seq_len=64,
)


def _groups_foreach(optimizer) -> set:
    optimizer = getattr(optimizer, "_inner", optimizer)
    return {g["foreach"] for g in optimizer.param_groups}


def test_a_model_by_name_runs_the_foreach_step_a_gpu_runs():
    wl = from_pretrained("qwen2.5-0.5b", **SMALL)
    assert wl.sized_for == "cuda"
    assert _groups_foreach(wl.make_optimizer()) == {True}
    cpu = from_pretrained("qwen2.5-0.5b", sized_for=None, **SMALL)
    assert _groups_foreach(cpu.make_optimizer()) == {None}


def test_sized_for_cuda_equals_asking_for_the_foreach_step_by_hand():
    """The explorer's answer (a model by name, default optimizer) equals notebook 09's
    (``Plan(optimizer="adamw_foreach")``), byte for byte, and is larger than the CPU's step."""
    gpu = measure(from_pretrained("qwen2.5-0.5b", **SMALL), mode="fake")
    cpu_wl = from_pretrained("qwen2.5-0.5b", sized_for=None, **SMALL)
    with Plan(optimizer="adamw_foreach").apply(cpu_wl) as applied:
        by_hand = measure(applied, mode="fake")
    cpu = measure(cpu_wl, mode="fake")
    assert gpu.peak_bytes == by_hand.peak_bytes
    assert gpu.peak_bytes > cpu.peak_bytes
    assert any(n.startswith("sized as CUDA runs it") for n in gpu.notes)
    assert not any("single-tensor step" in n for n in gpu.notes)
    assert any("single-tensor step" in n for n in cpu.notes)


def test_fp32_master_weights_follow_the_gpu_default_and_keep_the_cpu_note():
    """``precision="bf16_master"`` wraps the optimizer; its inner optimizer is the one that picks
    (the note once disappeared because the wrapper's own ``defaults`` are empty)."""
    cpu_wl = from_pretrained("qwen2.5-0.5b", sized_for=None, dtype=torch.float32, **SMALL)
    with Plan(precision="bf16_master").apply(cpu_wl) as applied:
        cpu = measure(applied, mode="fake")
    assert any("single-tensor step" in n for n in cpu.notes)
    with Plan(precision="bf16_master", optimizer="adamw_foreach").apply(cpu_wl) as applied:
        by_hand = measure(applied, mode="fake")
    gpu_wl = from_pretrained("qwen2.5-0.5b", dtype=torch.float32, **SMALL)
    with Plan(precision="bf16_master").apply(gpu_wl) as applied:
        assert _groups_foreach(applied.make_optimizer()) == {True}
        gpu = measure(applied, mode="fake")
    assert gpu.peak_bytes == by_hand.peak_bytes > cpu.peak_bytes


def test_an_explicit_choice_is_kept():
    """foreach=False, fused=True and optimizers without the choice are left as the user wrote them."""
    params = [torch.nn.Parameter(torch.zeros(4))]
    off = torch.optim.AdamW(params, foreach=False)
    assert follow_cuda_default(off) == "single-tensor" and off.param_groups[0]["foreach"] is False
    fused = torch.optim.AdamW(params, fused=True)
    assert follow_cuda_default(fused) == "fused"
    assert follow_cuda_default(torch.optim.LBFGS(params)) is None
    w = zoo.make("mlp", 1)
    wl = Workload(w.model, w.batch, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, foreach=False), sized_for="cuda")
    assert _groups_foreach(wl.make_optimizer()) == {False}


def test_sized_for_is_checked():
    import pytest

    from memsave_nb.errors import WorkloadError

    w = zoo.make("mlp", 1)
    with pytest.raises(WorkloadError, match="sized_for"):
        Workload(w.model, w.batch, sized_for="tpu")


def test_the_explorer_title_names_the_step_it_sized():
    """One answer for one question, named on screen: the explorer on a model by name says the step
    is sized as CUDA runs it, and its peak is the CLI's and the notebook's number."""
    from memsave_nb.ui.explorer import explore

    ex = explore("qwen2.5-0.5b", mode="fake", live=False, **SMALL)
    assert "sized as CUDA runs it" in ex.title.value
    cpu_wl = from_pretrained("qwen2.5-0.5b", sized_for=None, **SMALL)
    with Plan(optimizer="adamw_foreach").apply(cpu_wl) as applied:
        assert ex.session.baseline.peak_bytes == measure(applied, mode="fake").peak_bytes
