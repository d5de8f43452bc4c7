"""Property tests over the layout search's arguments (issue 38): every input is sized or refused
in one line of at most 200 characters, within a time bound, and the model is left as it was.

The model is the parallel tests' two-block MLP (measured in a fraction of a second per layout), so
the bound is on the search's bookkeeping: no loop over every sample of a huge batch, no loop over
every stage count of a huge GPU count."""

from __future__ import annotations

import html
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memsave_nb.errors import MemsaveError
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.planner.layout import plan_layout
from memsave_nb.planner.layout_args import MAX_GLOBAL_BATCH, micro_batches
from memsave_nb.target import Target

from .conftest import blocks_workload

HUGE = st.sampled_from([2**31 - 1, 2**63, 10**100, -(2**31)])
JUNK = st.sampled_from([None, True, 2.5, float("nan"), "8", b"8", [], [[2]], {"a": 1}, "x" * 10_000])
COUNT = st.one_of(st.integers(-2, 16), HUGE, JUNK)
DEGREES = st.one_of(
    st.none(), JUNK, st.lists(st.one_of(st.integers(-1, 16), HUGE, JUNK), max_size=5), st.tuples(st.integers(1, 8))
)


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg and 0 < len(msg) <= 200, msg
    return msg


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gpus=COUNT,
    gpu=st.one_of(st.sampled_from(["H100", "A100"]), JUNK),
    global_batch=st.one_of(st.none(), COUNT),
    tensor_parallel=DEGREES,
    pipeline_parallel=DEGREES,
    max_micro_batches=COUNT,
    region_kinds=st.one_of(st.just((None,)), st.just((None, "full")), st.lists(JUNK, min_size=1, max_size=2)),
)
def test_every_layout_argument_is_sized_or_refused_in_one_line(
    gpus, gpu, global_batch, tensor_parallel, pipeline_parallel, max_micro_batches, region_kinds
):
    wl = blocks_workload(batch=4)
    before = ModelSnapshot.capture(wl.model)
    start = time.process_time()
    try:
        result = plan_layout(
            wl,
            gpus,
            gpu,
            Target(1),
            global_batch=global_batch,
            tensor_parallel=tensor_parallel,
            pipeline_parallel=pipeline_parallel,
            max_micro_batches=max_micro_batches,
            region_kinds=region_kinds,
            remeasure=False,
        )
    except MemsaveError as exc:
        _one_line(exc)
        assert time.process_time() - start < 2  # refused before anything is measured
    else:
        assert result.summary().splitlines()[0].startswith("layout planner:")
        assert time.process_time() - start < 30
    assert before.differences(wl.model) == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gpus=st.integers(1, 64),
    global_batch=st.one_of(st.none(), st.integers(1, 64), st.just(MAX_GLOBAL_BATCH)),
    tensor_parallel=st.one_of(st.none(), st.lists(st.sampled_from([1, 2, 4]), min_size=1, max_size=4)),
    pipeline_parallel=st.one_of(st.none(), st.lists(st.integers(1, 2**20), min_size=1, max_size=4)),
    max_micro_batches=st.integers(1, 1024),
)
def test_plausible_layout_arguments_are_searched_or_refused_quickly(
    gpus, global_batch, tensor_parallel, pipeline_parallel, max_micro_batches
):
    """Near the valid region (the blocks model has no attention heads, so TP is sized or skipped with a note)."""
    test_every_layout_argument_is_sized_or_refused_in_one_line.hypothesis.inner_test(
        gpus, "H100", global_batch, tensor_parallel, pipeline_parallel, max_micro_batches, (None,)
    )


def test_the_issues_global_batch_is_refused_at_once():
    """``plan --gpus 2 --global-batch 2147483647`` looped over every batch size."""
    wl = blocks_workload(batch=4)
    start = time.process_time()
    with pytest.raises(MemsaveError) as err:
        plan_layout(wl, 2, "H100", global_batch=2**31 - 1)
    assert f"global_batch must be a whole number in [1, {MAX_GLOBAL_BATCH}]" in _one_line(err.value)
    assert time.process_time() - start < 1


def test_the_cli_refuses_it_in_one_line(capsys):
    from memsave_nb.cli import main

    assert main(["plan", "--model", "mlp", "--gpus", "2", "--global-batch", "2147483647", "--target-gb", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "global_batch must be a whole number" in err, err


@settings(max_examples=200, deadline=None)
@given(per_rank=st.integers(1, MAX_GLOBAL_BATCH), most=st.integers(1, 1024))
def test_micro_batches_are_the_even_splits_into_at_most_most(per_rank, most):
    mbs = micro_batches(per_rank, most)
    assert mbs == sorted(set(mbs)) and all(per_rank % mb == 0 and per_rank // mb <= most for mb in mbs)
    assert per_rank in mbs or most < 1  # one micro-batch is always a split
    # none missing: every count k <= most that divides per_rank gives one
    assert len(mbs) == sum(1 for k in range(1, min(most, per_rank) + 1) if per_rank % k == 0)


def test_the_gpus_tab_says_why_layouts_were_left_out():
    """Issue 38: the panel showed three summary lines; the notes saying which layouts were skipped
    and why (here: TP 2 on a model without attention projections) are shown beside them."""
    from memsave_nb.ui.layout_panel import LayoutFinder

    finder = LayoutFinder(blocks_workload(batch=4), lambda: 2, lambda: Target(1))
    finder._job(finder._generation, 2, "H100")
    assert finder.result is not None
    skipped = [n for n in finder.result.notes if "skipped (" in n]
    assert skipped and all(html.escape(n) in finder.status.value for n in skipped)
