"""Workload knobs, each measured for real and checked against an independent count."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from memsave_nb import zoo
from memsave_nb.checkpointing import PlanError
from memsave_nb.measure import measure
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.plan import Plan
from memsave_nb.workload import Workload


def _has(field: str) -> bool:
    return any(f.name == field for f in dataclasses.fields(Workload))


needs_engine = pytest.mark.skipif(
    not (_has("accumulation_steps") and _has("autocast_dtype") and _has("set_to_none")),
    reason="needs the engine's Workload.accumulation_steps / autocast_dtype / set_to_none",
)


def _run(workload: Workload, plan: Plan, mode: str = "real"):
    before = ModelSnapshot.capture(workload.model)
    with plan.apply(workload) as wl:
        m = measure(wl, mode=mode, repeats=0)
    assert before.differences(workload.model) == []  # restored exactly
    return m


def _final(m, category: str) -> int:  # the most held at once (the step frees all at its end)
    return max(m.timeline.by_category[category])


def _mlp(batch: int = 16) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16), nn.Linear(16, 4))
    return Workload(model, torch.randn(batch, 32), loss=lambda out: out.square().mean())


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- data --------------------------------------------------------------------------------------


def test_knobs_round_trip_json_and_describe():
    plan = Plan(
        batch_size=4,
        seq_len=64,
        precision="autocast-bf16",
        optimizer="sgd_momentum",
        accumulation_steps=2,
        set_to_none=False,
    )
    assert plan.precision == "autocast_bf16"
    again = Plan.from_json(plan.to_json())
    assert again == plan
    text = plan.describe()
    for piece in ("batch 4", "seq 64", "autocast_bf16", "sgd_momentum", "accumulate 2", "set_to_none=False"):
        assert piece in text
    assert not plan.is_empty and Plan().is_empty


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 0},
        {"seq_len": -1},
        {"precision": "fp8"},
        {"optimizer": "sophia"},
        {"accumulation_steps": 1.5},
        {"set_to_none": "yes"},
        {"batch_size": True},
    ],
)
def test_bad_knobs_are_one_line_plan_errors(kwargs):
    with pytest.raises(PlanError) as info:
        Plan(**kwargs)
    assert "\n" not in str(info.value)


# -- batch and sequence --------------------------------------------------------------------------


def test_batch_x2_doubles_activations_of_a_batch_independent_model():
    wl = _mlp(16)  # linear, relu, linear, linear, square().mean(): nothing batch-independent saved
    s4, s8, s16, s32 = (_run(wl, Plan(batch_size=b)).saved_bytes for b in (4, 8, 16, 32))
    per_row = (s16 - s8) // 8
    intercept = s16 - 16 * per_row
    assert intercept in (0, 4)  # nothing, or the 4-byte loss where the engine counts it as kept
    assert (s32 - intercept, s4 - intercept) == (2 * (s16 - intercept), (s16 - intercept) // 4)
    # per row, float32: the relu output (64, also the next linear's input), the third linear's
    # input (16) and square's input (4); the batch itself is an input, not an activation
    assert per_row == 4 * (64 + 16 + 4)
    # the zoo MLP's cross-entropy keeps a few batch-independent bytes: linear with an intercept
    wl = zoo.make("mlp", 32)
    base = _run(wl, Plan())
    double = _run(wl, Plan(batch_size=64))
    quarter = _run(wl, Plan(batch_size=8))
    assert double.saved_bytes - base.saved_bytes == 4 * (base.saved_bytes - quarter.saved_bytes) // 3
    # the batch (784 floats) and the closed-over targets (int64) follow: inputs counted exactly
    assert double.peak_split.inputs == 64 * 784 * 4 + 64 * 8


def test_batch_resizes_targets_a_loss_closes_over_cnn():
    wl = zoo.make("cnn", 8)
    m = _run(wl, Plan(batch_size=3))
    assert m.peak_split.inputs == 3 * 3 * 32 * 32 * 4 + 3 * 8
    assert wl.batch.shape[0] == 8  # the user's batch untouched


def test_batch_factory_with_batch_size_is_called_with_it():
    calls = []

    def batch(batch_size: int = 4):
        calls.append(batch_size)
        return torch.randn(batch_size, 32)

    torch.manual_seed(0)
    wl = Workload(nn.Linear(32, 8), batch)
    m = _run(wl, Plan(batch_size=10))
    assert 10 in calls and m.peak_split.inputs == 10 * 32 * 4


def test_seq_len_cuts_and_extends_token_tensors_gpt():
    wl = zoo.make("gpt", 2)  # block 128
    half = _run(wl, Plan(seq_len=64))
    full = _run(wl, Plan())
    assert half.peak_split.inputs == 2 * 2 * 64 * 8  # idx + targets, int64
    # the MLP is position-wise: its saved bytes are linear in the sequence length
    assert 2 * half.module("blocks.0.mlp").saved_bytes == full.module("blocks.0.mlp").saved_bytes
    with pytest.raises(PlanError, match="exceeds the model's 128 positions"):
        with Plan(seq_len=256).apply(wl):
            pass


def test_seq_len_extends_by_tiling_in_fake_mode():
    cfg = zoo.GPTConfig(block_size=256, n_layer=1, dropout=0.0)
    wl = zoo.gpt(cfg, batch_size=1)
    wl = wl.replace(batch={k: v[:, :100] for k, v in wl.batch.items()})
    m = _run(wl, Plan(seq_len=250), mode="fake")
    assert m.peak_split.inputs == 2 * 250 * 8


def test_seq_len_without_tokens_is_a_plan_error():
    with pytest.raises(PlanError, match="no token tensor"):
        with Plan(seq_len=4).apply(_mlp()):
            pass


# -- optimizers: state against the count each algorithm keeps -------------------------------------


def test_optimizer_state_counts():
    wl = _mlp()
    n = _numel(wl.model)
    k = len(list(wl.model.parameters()))
    adamw = _final(_run(wl, Plan(optimizer="adamw")), "optimizer_state")
    assert adamw == 2 * 4 * n + 4 * k  # exp_avg, exp_avg_sq + one float32 step per parameter
    for name in ("adamw_foreach", "adamw_fused"):
        assert _final(_run(wl, Plan(optimizer=name)), "optimizer_state") == adamw
    assert _final(_run(wl, Plan(optimizer="sgd_momentum")), "optimizer_state") == 4 * n
    assert _final(_run(wl, Plan(optimizer="sgd")), "optimizer_state") == 0
    factored = 0
    for p in wl.model.parameters():
        factored += 4 + 4 * ((p.shape[0] + p.shape[1]) if p.dim() == 2 else p.numel())
    assert _final(_run(wl, Plan(optimizer="adafactor")), "optimizer_state") == factored


def test_bitsandbytes_absent_is_one_clear_line():
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # noqa: BLE001
        with pytest.raises(PlanError, match="needs bitsandbytes"):
            with Plan(optimizer="adamw_8bit").apply(_mlp()):
                pass
    else:  # pragma: no cover - only where bitsandbytes runs
        pytest.skip("bitsandbytes imports here")


# -- precision --------------------------------------------------------------------------------------


def test_bf16_parameters_halve_parameters_and_state():
    wl = _mlp()
    n = _numel(wl.model)
    k = len(list(wl.model.parameters()))
    fp32 = _run(wl, Plan())
    bf16 = _run(wl, Plan(precision="bf16"))
    assert bf16.peak_split.parameters == 2 * n == fp32.peak_split.parameters // 2
    assert _final(bf16, "gradients") == 2 * n
    assert _final(bf16, "optimizer_state") == 2 * 2 * n + 4 * k
    assert bf16.saved_bytes * 2 == fp32.saved_bytes  # every saved activation of this MLP is floating
    assert wl.model[0].weight.dtype == torch.float32


def test_bf16_master_weights_keep_fp32_copies():
    wl = _mlp()
    n = _numel(wl.model)
    k = len(list(wl.model.parameters()))
    m = _run(wl, Plan(precision="bf16_master"))
    assert m.peak_split.parameters == 2 * n
    assert _final(m, "gradients") == 2 * n
    # 4 bytes master + AdamW's 8 bytes in fp32 + its step scalars: 2 + 2 + 4 + 8 = 16 bytes/param
    assert _final(m, "optimizer_state") == 4 * n + 8 * n + 4 * k
    assert m.peak_split.parameters + _final(m, "gradients") + _final(m, "optimizer_state") == 16 * n + 4 * k


def test_bf16_master_step_updates_the_bf16_weights():
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(torch.bfloat16)
    from memsave_nb.knobs import MasterWeightsOptimizer

    opt = MasterWeightsOptimizer(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.5))
    before = model.weight.detach().clone()
    model(torch.ones(3, 4, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    expected = (before.float() - 0.5 * 3.0).to(torch.bfloat16)
    assert torch.equal(model.weight, expected)


@needs_engine
def test_autocast_bf16_halves_saved_matmul_outputs():
    wl = _mlp()
    fp32 = _run(wl, Plan())
    bf16 = _run(wl, Plan(precision="autocast_bf16"))
    mm = ("aten.addmm", "aten.mm")
    saved32 = sum(o.saved_bytes for o in fp32.ops if o.op in mm)
    saved16 = sum(o.saved_bytes for o in bf16.ops if o.op in mm)
    assert saved32 > 0 and 2 * saved16 == saved32


@needs_engine
def test_accumulation_keeps_one_micro_batch_of_activations():
    wl = zoo.make("mlp", 16)
    one = _run(wl, Plan())
    four = _run(wl, Plan(accumulation_steps=4))
    assert four.saved_bytes == one.saved_bytes
    assert _final(four, "gradients") == _final(one, "gradients")


@needs_engine
def test_set_to_none_false_keeps_gradients_through_the_step():
    wl = _mlp()
    n = _numel(wl.model)
    kept = _run(wl, Plan(set_to_none=False))
    assert _final(kept, "gradients") == 4 * n


def test_knobs_export_code():
    code = Plan(batch_size=4, precision="bf16_master", optimizer="adafactor", accumulation_steps=2).to_code()
    assert "batch_size = 4" in code and "accumulation_steps = 2" in code
    assert "torch.optim.Adafactor(masters" in code and "model.to(torch.bfloat16)" in code
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    namespace = {"model": model}
    exec(compile(code, "<plan>", "exec", dont_inherit=True), namespace)
    assert model.weight.dtype == torch.bfloat16
    assert isinstance(namespace["optimizer"], torch.optim.Adafactor)


def test_fake_mode_says_when_the_gpu_would_run_the_foreach_step():
    """On CPU parameters torch's default AdamW runs its single-tensor loop; on a CUDA GPU the same
    constructor picks foreach, whose step keeps more temporaries. Fake mode says so, and the knob
    'adamw_foreach' measures that step: its optimizer-phase peak is higher by at most the size of
    the trainable parameters."""
    from memsave_nb import zoo

    w = zoo.make("gpt", 1)
    params = sum(p.numel() * p.element_size() for p in w.model.parameters())

    def optimizer_phase_peak(m):
        t = m.timeline
        totals = [sum(v[i] for v in t.by_category.values()) for i in range(len(t.phase))]
        return max(x for x, ph in zip(totals, t.phase) if ph == "optimizer")

    with Plan(optimizer="adamw").apply(w) as a:
        default = measure(a, mode="fake")
    with Plan(optimizer="adamw_foreach").apply(w) as a:
        foreach = measure(a, mode="fake")
    assert any("single-tensor step" in n and "adamw_foreach" in n for n in default.notes)
    assert not any("single-tensor step" in n for n in foreach.notes)
    extra = optimizer_phase_peak(foreach) - optimizer_phase_peak(default)
    assert 0 < extra <= params
    with Plan(optimizer="adamw").apply(w) as a:
        real = measure(a, mode="real", repeats=0)
    assert not any("single-tensor step" in n for n in real.notes)  # real mode measures what runs


@pytest.mark.parametrize("name", ["sgd", "sgd_momentum"])
def test_an_optimizer_name_means_one_thing_in_workload_and_plan(name):
    """``Workload(optimizer="sgd")`` once meant SGD with momentum where ``Plan(optimizer="sgd")``
    meant plain SGD: the same name, the same optimizer and the same state bytes."""
    wl = zoo.make("mlp", 8)
    by_workload = measure(wl.replace(optimizer=name), "fake", repeats=0)
    with Plan(optimizer=name).apply(wl) as applied:
        by_plan = measure(applied, "fake", repeats=0)
    assert by_workload.peak_split.optimizer_state == by_plan.peak_split.optimizer_state
    assert (by_workload.peak_split.optimizer_state == 0) == (name == "sgd")
