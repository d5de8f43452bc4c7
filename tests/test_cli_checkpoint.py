"""``report --checkpoint full|save_matmuls`` (issue 42; before, only --from-config could ask for it
at ``report``): every repeated block checkpointed; the peak is measure()'s for that Plan."""

from __future__ import annotations

import json


import memsave_nb
from memsave_nb import Plan, cli, measure
from memsave_nb.planner.depth import blocks_of


def test_report_checkpoint_is_every_block_checkpointed(capsys, tiny):
    peaks = {}
    for kind in (None, "full", "save_matmuls"):
        argv = ["report", "--model", tiny, "--seq-len", "128", "--json"] + (["--checkpoint", kind] if kind else [])
        assert cli.main(argv) == 0
        obj = json.loads(capsys.readouterr().out)
        wl = memsave_nb.from_pretrained(tiny, seq_len=128)
        plan = Plan(regions={b: kind for b in blocks_of(wl.model).names}) if kind else Plan()
        with plan.apply(wl) as w:
            peaks[kind] = measure(w, mode="fake").peak_bytes
        assert obj["peak_bytes"] == peaks[kind]
        if kind:
            assert obj["setup"]["plan"] == f"checkpoint 2 regions ({kind})"
    assert peaks["full"] < peaks["save_matmuls"] < peaks[None]


def test_report_checkpoint_refusals_are_one_line(capsys, tmp_path):
    assert cli.main(["report", "--model", "mlp", "--mode", "fake", "--checkpoint", "full"]) == 2
    assert "has no repeated blocks" in capsys.readouterr().err
    cfg = tmp_path / "args.json"
    cfg.write_text(json.dumps({"per_device_train_batch_size": 2}))
    assert cli.main(["report", "--model", "gpt", "--from-config", str(cfg), "--checkpoint", "full"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "drop --checkpoint" in err


def test_fit_gpus_names_the_gpus_it_fits_and_the_max_batch_on_each(capsys, tiny):
    from memsave_nb.planner.roofline import GPUS
    from memsave_nb.target import Target, max_batch

    argv = ["report", "--model", tiny, "--seq-len", "128", "--fit-gpus", "--headroom", "0.0002"]
    assert cli.main(argv + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["gpus"]
    wl = memsave_nb.from_pretrained(tiny, seq_len=128)
    m = measure(wl, mode="fake")
    assert [r["gpu"] for r in rows] == sorted(GPUS, key=lambda k: (GPUS[k].memory_gb, k))
    for r in rows:
        target = Target(GPUS[r["gpu"]].memory_gb, 0.0002)
        line = _verdict_line(
            Target(GPUS[r["gpu"]].memory_gb, 0.0002, name=f"{r['gpu']} {GPUS[r['gpu']].memory_gb:g} GB"), m
        )
        assert r["verdict"] == line.split(": ", 1)[1] and r["fits"] == (": fits" in line)
        assert r["usable_bytes"] == target.usable_bytes
    l4 = next(r for r in rows if r["gpu"] == "L4")
    assert l4["max_batch"] == max_batch(wl, Plan(), Target(24, 0.0002)).value >= 1
    assert rows[-1]["max_batch"] > l4["max_batch"]  # 141 GB holds more than 24 GB
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[3].startswith("Fits on: ") and "  L4: " in lines[4] and lines[4].endswith(f"max batch {l4['max_batch']}")
    )


def _verdict_line(target, m):
    """stdout's verdict: the allocator replay's where the step has one, else the 80% rule's."""
    from memsave_nb.target import reserved_verdict

    r = reserved_verdict(target, m)
    return r.lines()[0] if r else f"Target {target.label}: {target.verdict(m.peak_bytes)}"
