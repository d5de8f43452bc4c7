"""``memsave-nb plan --gpus N`` takes the single-device plan flags (freezing, precision, optimizer,
loss, accumulation) and starts the layout search from the Plan they make (planner/start_plan.py)."""

from __future__ import annotations

import warnings

from memsave_nb import Plan, cli

GPUS = ["plan", "--gpus", "4", "--gpu", "H100", "--model", "gpt", "--batch", "2", "--tp", "1", "--target-gb", "80"]


def _front_peaks(out: str) -> list[str]:
    lines = out.split("Pareto front of the layouts that fit (lowest peak first):\n", 1)[1].split("\n\n", 1)[0]
    return [line.split()[:2] for line in lines.splitlines()[1:]]


def _bytes(peak: list[str]) -> float:
    value, unit = peak
    return float(value) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def test_plan_gpus_starts_from_the_freezing_and_knob_flags(capsys, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP2's view-output warning
        assert cli.main(GPUS) == 0
        full, _ = capsys.readouterr()
        saved = tmp_path / "plan.json"
        assert cli.main([*GPUS, "--last-blocks", "1", "--optimizer", "sgd", "--save", str(saved)]) == 0
    frozen, err = capsys.readouterr()
    assert "note: starts from the plan: freeze *; train blocks.3; sgd" in frozen, frozen
    assert "starts from the plan" not in full
    chosen = Plan.from_json(saved.read_text())
    assert chosen.frozen == ("*",) and chosen.trainable == ("blocks.3",) and chosen.optimizer == "sgd"
    assert chosen.parallel is not None and chosen.parallel.world_size == 4
    assert "requires_grad_(False)" in frozen  # the code printed keeps the freezing too
    # fewer gradients and no Adam state: the lowest estimated peak of the front drops
    assert _bytes(_front_peaks(frozen)[0]) < _bytes(_front_peaks(full)[0])


def test_plan_gpus_a_flag_the_search_cannot_start_from_is_one_line(capsys):
    argv = ["plan", "--gpus", "4", "--model", "mlp", "--target-gb", "80", "--loss", "chunked"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("memsave-nb: error: ") and "loss='chunked'" in err


def test_plan_gpus_keeps_the_checkpointing_and_the_batch_per_gpu(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main([*GPUS, "--accumulate", "2", "--checkpoint", "full"]) == 0
    out, _ = capsys.readouterr()
    assert "global batch 16;" in out and "note: starts from the plan: checkpoint full blocks, batch 4 per GPU" in out
    front = out.split("lowest peak first):\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert front and all("checkpoint full blocks" in line for line in front)


def test_plan_gpus_checkpoint_on_a_model_without_blocks_is_one_line(capsys):
    assert cli.main(["plan", "--gpus", "4", "--model", "mlp", "--target-gb", "80", "--checkpoint", "full"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "no repeated blocks to checkpoint" in err


def test_plan_without_gpus_takes_the_same_knob_flags(capsys):
    """The single-device search keeps the knobs on every plan and searches only the kind asked for."""
    argv = [
        "plan",
        "--model",
        "gpt",
        "--batch",
        "2",
        "--target-gb",
        "1",
        "--checkpoint",
        "save_matmuls",
        "--optimizer",
        "sgd",
    ]
    assert cli.main(argv) == 0
    out, _ = capsys.readouterr()
    front = out.split("Pareto front (lowest peak first):\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert len(front) > 1 and all(line.endswith("sgd") for line in front)
    assert any("save_matmuls blocks" in line for line in front) and not any(" full " in line for line in front)
