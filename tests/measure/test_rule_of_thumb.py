"""The teacher's view: the bytes-per-parameter rule against bytes counted by hand from the shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_nb.measure import measure
from memsave_nb.measure.rule_of_thumb import state_bytes_per_param, teacher_view
from memsave_nb.plan import Plan
from memsave_nb.workload import Workload

B, D, H = 8, 16, 64
N = D * H + H + H * D + D  # 2,128 parameters in 4 tensors


def _mlp(optimizer: str) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
    return Workload(model=model, batch=torch.randn(B, D), loss=lambda out: out.pow(2).mean(), optimizer=optimizer)


def _bytes(view) -> dict[str, tuple[int | None, int]]:
    return {p.part: (p.rule_bytes, p.measured_bytes) for p in view.parts}


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_full_fine_tune_rule_equals_measured_by_hand(mode):
    wl = _mlp("sgd_momentum")
    v = teacher_view(measure(wl, mode=mode, repeats=0), wl.model, "sgd_momentum")
    assert _bytes(v) == {"weights": (4 * N, 4 * N), "gradients": (4 * N, 4 * N), "optimizer state": (4 * N, 4 * N)}
    assert v.rule_per_param == 12 and v.total_params == v.trainable_params == N
    # SGD's step is in place: no allocation in the optimizer phase, no row for it
    assert [p for p, _ in v.phases] == ["forward", "backward"]
    assert v.phases[0][1].gradients == 0 and v.phases[1][1].gradients == 4 * N  # set_to_none: born in backward
    assert 0 < v.left_out_bytes and v.peak_bytes - v.left_out_bytes <= 12 * N


def test_adamw_is_16_bytes_per_parameter_and_its_step_counters_are_named():
    wl = _mlp("adamw")
    v = teacher_view(measure(wl, mode="fake", repeats=0), wl.model, "adamw")
    assert v.rule_per_param == 16
    assert _bytes(v)["optimizer state"] == (8 * N, 8 * N + 4 * 4)  # + a float32 step per tensor
    assert v.parts[2].difference_bytes == 16 and "step counter" in v.parts[2].beyond_words
    assert [p for p, _ in v.phases] == ["forward", "backward", "optimizer"]
    assert dict(v.phases)["optimizer"].optimizer_state == 8 * N + 16


def test_mixed_precision_adamw_with_master_weights_is_16_bytes_per_parameter():
    wl = _mlp("adamw")
    with Plan(precision="bf16_master").apply(wl) as applied:
        m = measure(applied, mode="fake", repeats=0)
        v = teacher_view(m, applied.model, "adamw", master=True)
    # bf16 weights 2 + bf16 grads 2 + fp32 masters 4 + two fp32 moments 8
    assert v.rule_per_param == 16
    assert _bytes(v) == {
        "weights": (2 * N, 2 * N),
        "gradients": (2 * N, 2 * N),
        "optimizer state": (12 * N, 12 * N + 4 * 4),
    }
    assert state_bytes_per_param("adamw_8bit", 2) == 2 and state_bytes_per_param("sgd_momentum", 4, True) == 8
    assert state_bytes_per_param("my_own", 4) is None


def test_lora_rule_counts_trainable_parameters_only():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from .hf_models import llama

    wl = llama(batch=2, seq=16)
    total = sum(p.numel() for p in wl.model.parameters())
    model = get_peft_model(wl.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    wl = wl.replace(model=model)
    m = measure(wl, mode="fake", repeats=0)
    v = teacher_view(m, model, "adamw")
    # per layer: q_proj 64 -> 64 and v_proj 64 -> 32 (2 kv heads of 16), A (r x in) and B (out x r)
    trainable = 2 * (4 * (64 + 64) + 4 * (64 + 32))  # 1,792
    assert v.trainable_params == trainable and v.total_params == total + trainable
    assert _bytes(v)["gradients"] == (4 * trainable, 4 * trainable)
    assert _bytes(v)["optimizer state"] == (8 * trainable, 8 * trainable + 4 * 8)  # 8 adapter tensors
    assert v.parts[0].rule_bytes == 4 * (total + trainable)
    assert v.parts[0].difference_bytes == 2 * 8 * 4  # rotary inv_freq and its original: head_dim / 2 floats
    assert "buffers" in v.parts[0].beyond_words
    assert v.rule_per_param is None and v.per_trainable_param == 12  # frozen base: weights only


def test_an_optimizer_without_a_rule_is_said_so_not_guessed():
    from memsave_nb.ui.teach_table import phase_table, rule_table, teach_lines

    wl = _mlp("adamw")
    v = teacher_view(measure(wl, mode="fake", repeats=0), wl.model, None)
    assert v.parts[2].rule_bytes is None and v.rule_bytes is None and v.rule_per_param is None
    assert v.parts[2].measured_bytes == 8 * N + 16  # measured all the same
    _, rows = rule_table(v)
    assert rows[2][3] == "-" and rows[3][3] == "-"
    assert len(phase_table(v)[1]) == 3
    assert teach_lines(v)[0].startswith("Rule of thumb: no rule for optimizer of this workload; measured peak")
