"""A model by name answers quietly and without repeating work: no FutureWarning from peft's use of
transformers' deprecated ``is_gradient_checkpointing``, bitsandbytes kept out of the command line's
process, and the max-batch search taking the report's own measurement as its first probe."""

from __future__ import annotations

import sys
import warnings

import pytest

import memsave_nb
from memsave_nb import Plan, measure
from memsave_nb.hub.lora import without_bitsandbytes
from memsave_nb.target import Target, max_batch

from .conftest import SMALL


def _tiny(**kwargs):
    return memsave_nb.from_pretrained("llama-3.2-1b", overrides=SMALL["llama-3.2-1b"], seq_len=32, **kwargs)


def test_lora_wrapping_warns_nothing():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _tiny(lora="r=4")
    assert [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)] == []


def test_without_bitsandbytes_blocks_the_import_and_puts_it_back():
    had = "bitsandbytes" in sys.modules
    with without_bitsandbytes():
        if not had:
            with pytest.raises(ImportError):
                import bitsandbytes  # noqa: F401
    assert ("bitsandbytes" in sys.modules) is had  # no None entry left behind
    assert sys.modules.get("bitsandbytes", 0) is not None


def test_max_batch_takes_a_given_measurement_as_that_probe_and_answers_the_same():
    wl = _tiny(lora="r=4", batch_size=2)
    plan, target = Plan(optimizer="sgd"), Target(0.55)  # 31 MiB past the CUDA context and the 32 MiB cuBLAS workspace
    with plan.apply(wl) as applied:
        m = measure(applied, mode="fake", repeats=0)  # the report's measurement (FLOPs counted)
    searched = max_batch(wl, plan, target)
    seeded = max_batch(wl, plan, target, measured={2: m})
    assert searched.value > 2
    assert seeded.probes == searched.probes and seeded.value == searched.value
    assert seeded.peak_bytes == searched.peak_bytes and seeded.notes == searched.notes
    # the given measurement is used as is: a different peak there would change the answer
    import dataclasses

    # (without its allocator replay, so the 80% rule judges it, and the answer says both rules were used)
    huge = dataclasses.replace(m, peak_bytes=10 * target.usable_bytes, reserved=None)
    mixed = max_batch(wl, plan, target, measured={2: huge})
    assert mixed.value == 1 and mixed.rule == "allocator replay and 80% rule"
