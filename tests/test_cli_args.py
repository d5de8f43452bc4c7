"""Every subcommand x every flag with a bad or hostile value: exit 2, one line on stderr, no
traceback, nothing on stdout, and nothing measured (each case is refused before a build)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from memsave_nb import cli

HOSTILE_GB = ["inf", "nan", "-inf", "1e308", "-1", "0", "many"]

REPORT = [
    (["--model", "resnet9000"], "unknown model 'resnet9000'"),
    *[(["--batch", v], "--batch") for v in ["0", "-1", "x", "99999999999999999999", "1e3"]],
    (["--mode", "bogus"], "--mode"),
    (["--device", "tpu"], "device 'tpu'"),
    (["--top", "0"], "--top"),
    (["--seq-len", "0"], "--seq-len"),
    (["--precision", "p" * 500], "--precision"),
    (["--optimizer", "bogus"], "--optimizer"),
    (["--accumulate", "0"], "--accumulate"),
    (["--accumulate", "2147483647"], "at most 64 micro-batches"),
    *[(["--target-gb", v], "--target-gb") for v in HOSTILE_GB],
    *[(["--target-gb", "24", "--headroom", v], "--headroom") for v in ["0", "1.5", "-0.2", "nan", "inf"]],
    (["--headroom", "0.5"], "--headroom needs --target-gb"),
    (["--max-batch"], "need --target-gb"),
    (["--max-seq"], "need --target-gb"),
    (["--world-size", "0"], "--world-size"),
    (["--world-size", "99999999999999999999"], "--world-size"),
    (["--fsdp"], "need --world-size"),
    (["--ddp"], "need --world-size"),
    (["--world-size", "2", "--gradient-as-bucket-view"], "needs --ddp"),
    (["--world-size", "2", "--ddp", "--cpu-offload"], "drop --ddp"),
    (["--world-size", "2", "--top", "3"], "--top applies to single-device"),
    (["--world-size", "2", "--target-gb", "24", "--max-batch"], "--max-batch applies to single-device"),
    (["--world-size", "2", "--target-gb", "24", "--max-seq"], "--max-seq applies to single-device"),
    (["--world-size", "2", "--out", "r.html"], "--out applies to single-device"),
    (["--world-size", "2", "--mode", "real"], "fake mode only"),
    (["--lora", "r=16"], "--lora is for Hugging Face models"),
    (["--quantize", "nf4"], "--quantize"),
    (["--quantize", "int3"], "--quantize"),
    (["--task", "bogus"], "--task"),
    (["--model", "gpt-7b", "--mode", "real"], "only runs with --mode fake"),
    (["--model", "qwen2.5-0.5b", "--mode", "real"], "--mode fake only"),
    (["--model", "qwen2.5-0.5b", "--lora", "r="], "cannot read LoRA setting"),
    (["--model", "qwen2.5-0.5b", "--quantize", "nf4"], "give lora= too"),
    (["--model", "qwen2.5-0.5b", "--task", "image-classification"], "no head"),
    (["--from-config", "/nonexistent/args.json"], "cannot read trainer config"),
    (["--from-config", "/nonexistent/args.json", "--optimizer", "sgd"], "--from-config sets the knobs"),
    (
        ["--from-config", "/nonexistent/args.json", "--ddp", "--world-size", "2"],
        "--from-config sets the parallel strategy",
    ),
    (["--out", "."], "is a folder"),
    (["--repeats", "0"], "--repeats"),
    (["--nonsense"], "unrecognized arguments"),
]

PLAN = [
    ([], "--target-gb"),
    *[(["--target-gb", v], "--target-gb") for v in HOSTILE_GB],
    (["--target-gb", "24", "--model", "resnet9000"], "unknown model 'resnet9000'"),
    (["--target-gb", "24", "--batch", "0"], "--batch"),
    (["--target-gb", "24", "--batch", "99999999999999999999"], "--batch"),
    (["--target-gb", "24", "--seq-len", "-3"], "--seq-len"),
    (["--target-gb", "24", "--seq-len", "64"], "is a demo model"),
    (["--target-gb", "24", "--headroom", "2"], "--headroom"),
    (["--target-gb", "24", "--headroom", "nan"], "--headroom"),
    (["--target-gb", "24", "--gpu", "Z80"], "--gpu"),
    (["--target-gb", "24", "--mode", "bogus"], "--mode"),
    (["--target-gb", "24", "--precisions", "fp7"], "--precisions"),
    (["--target-gb", "24", "--micro-batches", "0"], "--micro-batches"),
    (["--target-gb", "24", "--last-blocks", "x"], "--last-blocks"),
    (["--target-gb", "24", "--save", "/nonexistent/folder/plan.json"], "no folder"),
    (["--target-gb", "24", "--export", "deepspeed"], "--export"),
    (["--target-gb", "24", "--export-to", "out.json"], "--export-to needs --export"),
    (["--target-gb", "24", "--export", "hf", "--export-to", "/nonexistent/a.json"], "no folder"),
    (["--target-gb", "24", "--lora", "r=16"], "--lora is for Hugging Face models"),
    (["--target-gb", "24", "--model", "gpt-7b", "--mode", "real"], "only runs with --mode fake"),
    (["--target-gb", "24", "--model", "qwen2.5-0.5b", "--mode", "real"], "--mode fake only"),
    (["--target-gb", "24", "--nonsense"], "unrecognized arguments"),
    (["--target-gb", "80", "--gpus", "0"], "--gpus"),
    (["--target-gb", "80", "--gpus", "99999999999999999999"], "--gpus"),
    (["--target-gb", "80", "--gpus", "6", "--tp", "4"], "tensor_parallel 4: 6 GPUs are not divisible by it"),
    (["--target-gb", "80", "--gpus", "16", "--tp", "16"], "spans more than a node of 8"),
    (["--target-gb", "80", "--gpus", "8", "--tp", "x"], "--tp"),
    (["--target-gb", "80", "--gpus", "8", "--global-batch", "0"], "--global-batch"),
    (["--target-gb", "80", "--tp", "2"], "--tp needs --gpus N"),
    (["--target-gb", "80", "--global-batch", "8"], "--global-batch needs --gpus N"),
    (["--target-gb", "80", "--gpus", "8", "--mode", "real"], "fake mode only"),
    (["--target-gb", "80", "--gpus", "8", "--micro-batches", "1,2"], "drop --micro-batches"),
    (["--target-gb", "80", "--gpus", "8", "--last-blocks", "1,2"], "give one --last-blocks N"),
    (["--target-gb", "80", "--gpus", "8", "--precision", "bf16", "--precisions", "fp32"], "not both"),
    (["--target-gb", "80", "--gpus", "8", "--loss-chunk", "8"], "--loss-chunk needs --loss chunked"),
    (["--target-gb", "80", "--gpus", "8", "--accumulate", "2", "--global-batch", "8"], "drop --accumulate"),
    (["--target-gb", "80", "--gpus", "8", "--optimizer", "sophia"], "--optimizer"),
    (["--target-gb", "24", "--accumulate", "2"], "give --micro-batches K,K instead"),
]

CASES = [(["report", "--model", "mlp", *a], m) if "--model" not in a else (["report", *a], m) for a, m in REPORT]
CASES += [(["plan", *a], m) for a, m in PLAN]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a)[:80] for a, _ in CASES])
def test_every_flag_with_a_bad_value_is_one_line(capsys, argv, message):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("memsave-nb: error: "), err
    assert "Traceback" not in err and len(err) < 400
    assert message in err


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "--model", "mlp", "--target-gb", "1e308"],
        ["report", "--model", "mlp", "--batch", "100000000", "--mode", "real"],
        ["plan", "--model", "gpt", "--target-gb", "24", "--save", "/nonexistent/plan.json"],
    ],
)
def test_no_traceback_from_a_real_process(argv):
    proc = subprocess.run([sys.executable, "-m", "memsave_nb.cli", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_a_real_batch_this_machine_cannot_hold_is_refused_before_allocating():
    from memsave_nb.cli.workload import batch_bytes_per_sample, check_fits_this_machine
    from memsave_nb.errors import MemsaveError

    per_sample = batch_bytes_per_sample("mlp")
    assert per_sample == 784 * 4 + 8  # the inputs and the int64 target the loss holds
    with pytest.raises(MemsaveError, match="of inputs alone"):
        check_fits_this_machine("mlp", 1000, "fake", available=per_sample * 1999)
    # the inputs fit, the real step does not: the fake-mode estimate says so, in real mode only
    check_fits_this_machine("mlp", 1000, "fake", available=per_sample * 2000)
    with pytest.raises(MemsaveError, match="in real mode"):
        check_fits_this_machine("mlp", 1000, "real", available=per_sample * 2000)


def test_the_real_mode_estimate_is_the_engine_s_figure():
    from memsave_nb import measure, zoo
    from memsave_nb.cli.workload import estimated_real_peak

    real = measure(zoo.make("mlp", 300), mode="fake", repeats=1).peak_bytes
    assert abs(estimated_real_peak("mlp", 300) - real) <= 0.01 * real
