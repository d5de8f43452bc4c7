"""``report --offload`` (the host memory line, ``host`` in --json, the HTML summary) and ``report
--teach`` (the bytes-per-parameter rule beside the measured bytes), run as a user runs them."""

from __future__ import annotations

import json

import pytest

import memsave_nb
from memsave_nb import Plan, cli, measure
from memsave_nb.planner.depth import blocks_of

ARGS = ["report", "--seq-len", "64", "--json"]


def test_offload_json_host_is_measure_for_every_block_offloaded(capsys, tiny):
    assert cli.main([*ARGS, "--model", tiny, "--offload"]) == 0
    obj = json.loads(capsys.readouterr().out)
    wl = memsave_nb.from_pretrained(tiny, seq_len=64)
    blocks = blocks_of(wl.model).names
    with Plan(regions={b: "offload" for b in blocks}).apply(wl) as w:
        m = measure(w, mode="fake")
    host = m.host
    assert host.peak_bytes > 0 and host.to_host_bytes == host.to_device_bytes == host.peak_bytes
    assert obj["host"] == {
        "peak_bytes": host.peak_bytes,
        "to_host_bytes": host.to_host_bytes,
        "to_device_bytes": host.to_device_bytes,
        "tensors": host.tensors,
    }
    assert obj["peak_bytes"] == m.peak_bytes and obj["setup"]["plan"] == f"offload {len(blocks)} regions (offload)"
    assert cli.main([*ARGS, "--model", tiny]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["host"] == {"peak_bytes": 0, "to_host_bytes": 0, "to_device_bytes": 0, "tensors": 0}
    assert plain["peak_bytes"] > obj["peak_bytes"]


def test_offload_text_has_the_host_line_and_the_html_too(capsys, tiny, tmp_path):
    out = tmp_path / "r.html"
    assert cli.main(["report", "--model", tiny, "--seq-len", "64", "--offload", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    host = [line for line in lines if line.startswith("Host memory: ")]
    assert len(host) == 1 and lines.index(host[0]) == 3  # in the answer, under the peak
    assert "to the host in forward" in host[0] and "over PCIe 5.0 x16" in host[0]
    page = out.read_text()
    assert "host memory (offloaded)" in page and "Rule of thumb vs measured" in page
    assert cli.main(["report", "--model", tiny, "--seq-len", "64"]) == 0
    assert "Host memory" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--checkpoint", "full"], "--offload and --checkpoint"),
        (["--world-size", "2"], "--offload: the single-device report"),
    ],
)
def test_offload_refusals_are_one_line(capsys, tiny, extra, words):
    assert cli.main(["report", "--model", tiny, "--offload", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and len(err) <= 200


def test_offload_refused_on_a_model_without_blocks(capsys):
    assert cli.main(["report", "--model", "mlp", "--mode", "fake", "--offload"]) == 2
    assert "--offload: " in capsys.readouterr().err


@pytest.mark.parametrize(
    "precision, per_param, weight_bytes, state_extra",
    [
        (None, 8, 2, 4),  # the hub model's bf16: torch's AdamW keeps bf16 moments (2 + 2 + 4)
        ("fp32", 16, 4, 4),  # 4 + 4 + 8
        ("bf16_master", 16, 2, 4),  # the familiar mixed-precision figure: 2 + 2 + 4 masters + 8
    ],
)
def test_teach_json_bytes_per_parameter(capsys, tiny, precision, per_param, weight_bytes, state_extra):
    assert cli.main([*ARGS, "--model", tiny, *(["--precision", precision] if precision else [])]) == 0
    t = json.loads(capsys.readouterr().out)["teach"]
    wl = memsave_nb.from_pretrained(tiny, seq_len=64)
    n = sum(p.numel() for p in wl.model.parameters())
    tensors = sum(1 for _ in wl.model.parameters())
    assert t["optimizer"] == "adamw" and t["total_params"] == t["trainable_params"] == n
    assert t["rule_bytes_per_param"] == per_param and t["rule_bytes"] == per_param * n
    parts = {p["part"]: p for p in t["parts"]}
    assert parts["gradients"]["measured_bytes"] == parts["gradients"]["rule_bytes"] == weight_bytes * n
    assert parts["weights"]["rule_bytes"] == weight_bytes * n
    assert parts["optimizer state"]["difference_bytes"] == state_extra * tensors  # AdamW's float32 step counters
    assert [p["phase"] for p in t["phases"]] == ["forward", "backward", "optimizer"]


def test_teach_text_and_lora_counts_the_adapters(capsys, tiny):
    assert cli.main(["report", "--model", tiny, "--seq-len", "64", "--teach", "--lora", "r=4"]) == 0
    text = capsys.readouterr().out
    assert "Rule of thumb vs measured" in text and "Phase peak" in text
    assert "The rule leaves out" in text and "per trainable parameter" in text
    assert cli.main([*ARGS, "--model", tiny, "--lora", "r=4"]) == 0
    t = json.loads(capsys.readouterr().out)["teach"]
    assert 0 < t["trainable_params"] < t["total_params"] and t["rule_bytes_per_param"] is None
    assert t["bytes_per_trainable_param"] == 12  # peft keeps the adapters in fp32 on a bf16 base: 4 + 8
    parts = {p["part"]: p for p in t["parts"]}
    assert parts["gradients"]["params"] == t["trainable_params"]
    assert parts["gradients"]["measured_bytes"] == 4 * t["trainable_params"]
    assert parts["weights"]["params"] == t["total_params"]  # the frozen base is held, not trained


def test_trl_activation_offloading_reports_host_memory(capsys, tiny, tmp_path):
    """TRL's ``activation_offloading`` without checkpointing is offload regions on every layer: the
    host line follows. (With SFTConfig's default checkpointing it is sized as the checkpointing
    alone, trainers/trl.py: no host bytes counted for the checkpointed inputs TRL offloads.)"""
    cfg = tmp_path / "sft.json"
    fields = {"per_device_train_batch_size": 1, "max_length": 32, "activation_offloading": True}
    cfg.write_text(json.dumps({**fields, "gradient_checkpointing": False}))
    assert cli.main(["report", "--model", tiny, "--from-config", str(cfg), "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["host"]["tensors"] > 0 and obj["host"]["peak_bytes"] == obj["host"]["to_host_bytes"] > 0
    assert cli.main(["report", "--model", tiny, "--from-config", str(cfg)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].startswith("Host memory: ") and f"{obj['host']['tensors']} copies" in lines[3]
