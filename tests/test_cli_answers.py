"""``memsave-nb report`` / ``plan`` answer first, on every kind of model, with every knob flag:
the figures printed are the engine's for the same Plan (measure, measure_parallel, max_batch),
checked here by calling the engine directly."""

from __future__ import annotations

import json

import pytest

from memsave_nb import cli
from memsave_nb.units import format_bytes


def _run(capsys, argv):
    assert cli.main(argv) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert err == ""
    return out


def _cli(capsys, command: str, model: str, flags: str) -> str:
    """stdout of ``memsave-nb <command> --model <model> <flags>`` (flags as typed, split on spaces;
    the model apart: a temporary folder's path)."""
    return _run(capsys, [command, "--model", model, *flags.split()])


def test_per_rank_report_honours_every_knob_flag(capsys):
    from memsave_nb import Plan, zoo
    from memsave_nb.parallel import ParallelSpec, measure_parallel
    from memsave_nb.parallel.verdict import worst_fit
    from memsave_nb.target import Target

    out = _cli(
        capsys,
        "report",
        "mlp",
        "--batch 16 --world-size 3 --fsdp --optimizer sgd --precision bf16 --accumulate 2 --keep-grads "
        "--target-gb 0.02",
    )
    plan = Plan(optimizer="sgd", precision="bf16", accumulation_steps=2, set_to_none=False)
    m = measure_parallel(zoo.make("mlp", 16), ParallelSpec(world_size=3), plan)
    lines = out.splitlines()
    assert lines[2].startswith(f"Peak per rank: {format_bytes(m.device_peak_bytes)} (worst rank {m.worst.rank}")
    # every rank was replayed through the allocator model: the replay's verdict (no 80% rule), its parts under it
    rank, fit = worst_fit(Target(0.02), m)
    assert fit.replay is not None and not fit.fits  # 20 MiB: under the CUDA context alone
    assert lines[3] == f"Target 0.02 GB per rank: {fit.verdict(Target(0.02))}; deciding rank {rank.rank}"
    assert lines[4].startswith(f"  predicted reserved memory: {format_bytes(rank.reserved.max_reserved_bytes)}")
    assert m.table() in out
    split = next(line for line in lines if line.startswith("Split: "))
    assert "optimizer state" not in split  # SGD without momentum keeps no state (AdamW's would show here)
    assert "sgd" in lines[0] and "bf16" in lines[0]


def test_a_hub_model_by_local_config_leads_with_the_answer(capsys, tiny):
    import memsave_nb
    from memsave_nb import Plan, measure
    from memsave_nb.target import Target, fit_of, max_batch, reserved_verdict

    # 0.532 GB: about 12 MiB past the 500 MiB CUDA context and the 32 MiB cuBLAS workspace (H100) the verdict adds
    out = _cli(
        capsys, "report", tiny, "--lora r=4 --seq-len 32 --batch 2 --optimizer sgd --target-gb 0.532 --max-batch"
    )
    wl = memsave_nb.from_pretrained(tiny, lora="r=4", seq_len=32, batch_size=2)
    plan = Plan(optimizer="sgd")
    with plan.apply(wl) as w:
        m = measure(w, mode="fake")
    target = Target(0.532)
    r = max_batch(wl, plan, target)
    lines = out.splitlines()
    assert lines[0].startswith(f"memsave_nb report: {tiny}, LoRA r=4, seq 32, batch 2, sgd, fake mode")
    assert lines[2].startswith(f"Peak memory: {format_bytes(m.peak_bytes)} during {m.peak_phase}")
    # the verdict replays the step through the allocator model (issue 40), and so does the search
    assert lines[3] == reserved_verdict(target, m).lines()[0] and lines[3].startswith("Target 0.532 GB: fits")
    assert lines[4].startswith(f"Max batch that fits: {r.value} (peak {format_bytes(r.peak_bytes)}")
    assert "allocator replay)" in lines[4] and "80% headroom line" not in out
    assert r.value > 2
    # independent of the search's resizing: the model built at that batch, and one more, judged by the verdict
    for b, fits in ((r.value, True), (r.value + 1, False)):
        with plan.apply(memsave_nb.from_pretrained(tiny, lora="r=4", seq_len=32, batch_size=b)) as w:
            assert fit_of(target, measure(w, mode="fake")).fits is fits
    assert "(the 20 modules whose own ops save the most)" in out


@pytest.mark.parametrize("gb", [0.05, 0.527, 0.542])  # under, near and past the context + cuBLAS workspace
def test_one_screen_one_answer_verdict_and_max_batch_agree(capsys, tiny, gb):
    """Issue 40: the report's verdict on batch b and its "Max batch that fits" never disagree:
    the verdict says fits exactly when b <= max batch, at targets below, near and past the context."""
    import re

    out = _cli(capsys, "report", tiny, f"--seq-len 32 --batch 4 --optimizer sgd --target-gb {gb} --max-batch")
    lines = out.splitlines()
    found = re.match(r"Max batch that fits: (\d+) ", lines[4])
    assert found, lines[4]
    assert lines[3].startswith(f"Target {gb:g} GB: fits") is (int(found.group(1)) >= 4)
    value = int(found.group(1))
    assert value == 0 if gb == 0.05 else value >= 4  # under the context nothing fits; past it batch 4 does


def test_a_hub_id_offline_falls_back_to_the_catalogue(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = _cli(
        capsys, "report", "HuggingFaceTB/SmolLM2-135M", "--lora r=8 --seq-len 16 --world-size 2 --ddp --target-gb 24"
    )
    assert out.startswith(
        "memsave_nb per-rank report: HuggingFaceTB/SmolLM2-135M, DDP x2 (buckets 25 MB), batch 1 per rank"
    )
    assert "Target 24 GB per rank: fits" in out.splitlines()[3]


def test_report_sizes_a_trainer_config(capsys, tmp_path, tiny):
    import memsave_nb
    from memsave_nb import measure
    from memsave_nb.trainers import from_trainer

    args = tmp_path / "args.json"
    args.write_text(
        json.dumps(
            {
                "per_device_train_batch_size": 3,
                "gradient_accumulation_steps": 2,
                "optim": "sgd",
                "gradient_checkpointing": True,
            }
        )
    )
    out = _cli(capsys, "report", tiny, f"--seq-len 32 --from-config {args}")
    wl = memsave_nb.from_pretrained(tiny, seq_len=32, dtype="fp32")  # config.json has no dtype: the trainer loads fp32
    imported = from_trainer(str(args), wl.model)
    assert imported.plan.batch_size == 3
    with imported.plan.apply(wl) as w:
        m = measure(w, mode="fake")
    lines = out.splitlines()
    assert ", batch 3, " in lines[0]
    assert lines[2].startswith(f"Peak memory: {format_bytes(m.peak_bytes)} during {m.peak_phase}")


def test_plan_exports_the_chosen_plan_as_a_trainer_config(capsys, tmp_path, tiny):
    from memsave_nb import Plan
    from memsave_nb.trainers import to_trainer

    saved, exported = tmp_path / "plan.json", tmp_path / "sft.json"
    out = _cli(
        capsys,
        "plan",
        tiny,
        f"--lora r=4 --seq-len 32 --target-gb 24 --save {saved} --export trl --export-to {exported}",
    )
    plan = Plan.from_json(saved.read_text())
    assert exported.read_text() == to_trainer(plan, "trl").text
    assert "The chosen plan as a trl config:" in out and f"Wrote {exported}" in out


@pytest.mark.slow
def test_report_llama_8b_lora_max_batch_answers_first_in_a_fresh_process():
    """Issue 26's command as a user runs it: a fresh process, whose imports (peft, bitsandbytes,
    transformers) print what they print. The answer leads stdout and nothing else is printed: no
    bitsandbytes kernel warning, no transformers FutureWarning. Its time is a bench row
    (``bench/bench_engine.py``, its third table), not asserted here."""
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "memsave_nb.cli",
        "report",
        "--model",
        "llama-3.1-8b",
        "--lora",
        "r=16",
        "--target-gb",
        "24",
        "--max-batch",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert lines[0] == (
        "memsave_nb report: llama-3.1-8b, LoRA r=16, seq 2048, batch 1, fake mode on cpu, "
        "sized as CUDA runs it (foreach optimizer step, cuDNN attention), loop loss_only"
    )
    assert lines[1] == ""
    assert lines[2].startswith("Peak memory: ") and "during backward" in lines[2]
    assert lines[3].startswith("Target 24 GB: does not fit")
    assert lines[4].startswith("Max batch that fits: 0 (peak ")


def test_step_times_show_median_and_spread_and_say_noisy(capsys):
    import dataclasses

    from memsave_nb import measure, zoo
    from memsave_nb.cli.report import format_report

    out = _cli(capsys, "report", "mlp", "--batch 8 --repeats 3")
    line = next(x for x in out.splitlines() if x.startswith("Saved activations:"))
    assert ", 3 runs)" in line.split("Step time: ", 1)[1]
    m = measure(zoo.make("mlp", 8), mode="real", repeats=3)
    steady = dataclasses.replace(m, step_seconds=0.010, step_seconds_all=(0.010, 0.011, 0.0105))
    noisy = dataclasses.replace(m, step_seconds=0.054, step_seconds_all=(1.85, 1.35, 0.054))
    assert "noisy" not in format_report(steady, title="t")
    assert "Step time: 54.0 ms (54.0 ms–1.85 s, 3 runs) - noisy" in format_report(noisy, title="t")


def test_report_sizes_an_accelerate_fsdp_config_per_rank(capsys, tmp_path, tiny):
    import memsave_nb
    from memsave_nb.parallel import measure_parallel
    from memsave_nb.trainers import from_trainer

    cfg = tmp_path / "accelerate.yaml"
    cfg.write_text("distributed_type: FSDP\nnum_processes: 2\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 2\n")
    out = _cli(capsys, "report", tiny, f"--seq-len 32 --from-config {cfg}")
    wl = memsave_nb.from_pretrained(tiny, seq_len=32, dtype="fp32")  # config.json has no dtype: the trainer loads fp32
    imported = from_trainer(str(cfg), wl.model)
    m = measure_parallel(wl, imported.parallel, imported.plan)
    assert out.splitlines()[2].startswith(f"Peak per rank: {format_bytes(m.device_peak_bytes)}")
    assert m.table() in out and "FSDP2 x2" in out
    assert "Note: batch size, optimizer and accumulation: in your script" in out


def test_qlora_from_the_command_line(capsys, tiny):
    import memsave_nb
    from memsave_nb import measure

    out = _cli(capsys, "report", tiny, "--lora r=4 --quantize nf4 --seq-len 32")
    m = measure(memsave_nb.from_pretrained(tiny, lora="r=4", quantize="nf4", seq_len=32), mode="fake")
    assert out.splitlines()[2].startswith(f"Peak memory: {format_bytes(m.peak_bytes)} during {m.peak_phase}")


def test_a_hub_model_per_rank_with_knobs_equals_measure_parallel(capsys, tiny):
    import memsave_nb
    from memsave_nb import Plan
    from memsave_nb.parallel import ParallelSpec, measure_parallel

    out = _cli(
        capsys,
        "report",
        tiny,
        "--lora r=4 --seq-len 32 --batch 2 --world-size 4 --fsdp --precision fp32 --accumulate 2 "
        "--optimizer adamw_foreach",
    )
    wl = memsave_nb.from_pretrained(tiny, lora="r=4", seq_len=32, batch_size=2)
    m = measure_parallel(
        wl, ParallelSpec(world_size=4), Plan(precision="fp32", accumulation_steps=2, optimizer="adamw_foreach")
    )
    assert out.splitlines()[2].startswith(f"Peak per rank: {format_bytes(m.device_peak_bytes)}")
    assert m.table() in out


def test_max_seq_of_a_hub_model(capsys, tiny):
    import memsave_nb
    from memsave_nb import Plan
    from memsave_nb.target import Target, fit_of, measure_peak

    out = _cli(capsys, "report", tiny, "--seq-len 32 --target-gb 0.524 --max-seq")
    line = out.splitlines()[4]
    assert line.startswith("Max sequence length that fits: ") and "allocator replay" in line
    value = int(line.split(": ")[1].split()[0])
    assert 32 < value < 256  # under the model's 256 positions: memory stopped it
    # the oracle: the verdict on the step measured at that length and one token more
    for t, fits in ((value, True), (value + 1, False)):
        m = measure_peak(memsave_nb.from_pretrained(tiny, seq_len=t), Plan())
        assert fit_of(Target(0.524), m).fits is fits


def test_report_loss_chunked_is_the_chunked_loss_knob(capsys, tiny):
    """``--loss chunked --loss-chunk 8``: the peak printed is measure() under Plan(loss='chunked', loss_chunk=8),
    lower than the full loss's on the same model (its logits are never built whole)."""
    import memsave_nb
    from memsave_nb import Plan
    from memsave_nb.target import measure_peak
    from memsave_nb.units import format_bytes

    chunked_out = _cli(capsys, "report", tiny, "--seq-len 64 --batch 4 --loss chunked --loss-chunk 8")
    full_out = _cli(capsys, "report", tiny, "--seq-len 64 --batch 4")
    wl = memsave_nb.from_pretrained(tiny, seq_len=64, batch_size=4)
    chunked = measure_peak(wl, Plan(loss="chunked", loss_chunk=8), mode="fake").peak_bytes
    full = measure_peak(wl, Plan(), mode="fake").peak_bytes
    assert chunked < full
    assert "chunked loss (8 tokens)" in chunked_out.splitlines()[0]
    assert f"Peak memory: {format_bytes(chunked)}" in chunked_out and f"Peak memory: {format_bytes(full)}" in full_out


def test_report_loss_chunk_without_chunked_is_one_line(capsys):
    assert cli.main(["report", "--model", "gpt", "--loss-chunk", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--loss-chunk needs --loss chunked" in err
