"""``measure_parallel``'s layout arguments under hypothesis (issue 38): every ``ParallelSpec`` is
sized or refused in one line of at most 200 characters that quotes no hostile value whole, within a
time bound, and the user's model is left as it was.

The model is the parallel tests' tiny GPT (2 heads, 2 blocks): a refusal comes before anything is
built; an answer is a fake-mode sizing of a few ranks. Oracle for "quoted whole": hostile values
carry a run of 120 ``Z``s and no message may hold 100."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from memsave_nb.errors import MemsaveError
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.parallel import ParallelSpec, measure_parallel

from parallel.conftest import tiny_gpt  # tests/ is on sys.path (rootdir-relative packages)

LONG = "Z" * 120
JUNK = st.sampled_from(
    [None, True, 2.5, float("nan"), float("inf"), "2", b"2", [], [2], {"a": 1}, LONG, -1, 0, 2**31 - 1, 2**63, 10**100]
)
SMALL = st.one_of(st.sampled_from([1, 2, 4]), JUNK)
FLAG = st.one_of(st.booleans(), JUNK)
STRATEGY = st.one_of(st.sampled_from(["fsdp", "ddp", "FSDP", ""]), JUNK)
MODULES = st.one_of(st.just(()), st.just(("blocks.0", "blocks.1")), st.just(("nope",)), st.just((LONG,)), JUNK)
TP_PLAN = st.one_of(
    st.just(()),
    st.just((("blocks.0.mlp.c_fc", "colwise"),)),
    st.just(((LONG, "colwise"),)),
    st.just((("blocks.0.mlp.c_fc", LONG),)),
    st.just(("colwise",)),
    JUNK,
)
SCHEDULE = st.one_of(st.sampled_from(["1f1b", "gpipe", "interleaved"]), JUNK)


def _check(exc: BaseException) -> None:
    msg = str(exc)
    assert "\n" not in msg and 0 < len(msg) <= 200, msg
    assert "Z" * 100 not in msg, msg


@pytest.fixture(scope="module")
def gpt():
    return tiny_gpt()


def _sized_or_refused(gpt, fields: dict, *, seconds: float | None = None) -> None:
    """``measure_parallel(gpt, ParallelSpec(**fields))``: sized (a positive peak, within ``seconds``
    of CPU time) or refused in one short line; the model left as it was either way."""
    before = ModelSnapshot.capture(gpt.model)
    start = time.process_time()
    try:
        result = measure_parallel(gpt, ParallelSpec(**fields))
    except MemsaveError as exc:
        _check(exc)
        event(f"refused: {' '.join(str(exc).split()[:3])}")
    else:
        event("sized")
        assert result.worst.peak_bytes > 0
        assert seconds is None or time.process_time() - start < seconds
    assert before.differences(gpt.model) == []


FIXTURE_OK = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@settings(FIXTURE_OK, max_examples=80)
@given(
    st.fixed_dictionaries(
        {
            "world_size": SMALL,
            "strategy": STRATEGY,
            "shard_modules": MODULES,
            "replicate": SMALL,
            "reshard_root": FLAG,
            "param_dtype": st.one_of(st.sampled_from(["bfloat16", "float16", "int64"]), JUNK),
            "cpu_offload": FLAG,
            "bucket_cap_mb": st.one_of(st.sampled_from([1.0, 25.0]), JUNK),
            "tensor_parallel": SMALL,
            "sequence_parallel": FLAG,
            "tp_plan": TP_PLAN,
            "pipeline_parallel": SMALL,
            "schedule": SCHEDULE,
            "microbatches": SMALL,
        }
    )
)
def test_every_parallel_spec_is_sized_or_refused_in_one_line(gpt, fields):
    _sized_or_refused(gpt, fields, seconds=60)


@settings(FIXTURE_OK, max_examples=30)
@given(
    st.fixed_dictionaries(
        {
            "world_size": st.sampled_from([1, 2, 4, 8]),
            "strategy": st.sampled_from(["fsdp", "ddp"]),
            "replicate": st.sampled_from([1, 2]),
            "tensor_parallel": st.sampled_from([1, 2, 4]),
            "sequence_parallel": st.booleans(),
            "pipeline_parallel": st.sampled_from([1, 2, 4]),
            "microbatches": st.sampled_from([1, 2, 3]),
            "cpu_offload": st.booleans(),
        }
    )
)
def test_combinations_of_valid_degrees_are_sized_or_refused_in_one_line(gpt, fields):
    """Degrees each valid alone, combined (PP x TP x HSDP, SP, offload, DDP): the refusals that need
    the model (heads, blocks, stages) come through as the same one line."""
    _sized_or_refused(gpt, fields)


def test_pp_by_tp_keeps_the_head_count_message():
    """Issue 38: under PP x TP the "does not divide" message was hidden behind the pipeline's."""
    from memsave_nb import zoo
    from memsave_nb.parallel import ParallelError

    wl = zoo.gpt(zoo.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=3, n_embd=48, dropout=0.0), batch_size=2)
    for spec in (
        ParallelSpec(world_size=2, tensor_parallel=2),
        ParallelSpec(world_size=4, tensor_parallel=2, pipeline_parallel=2),
    ):
        with pytest.raises(ParallelError) as err:
            measure_parallel(wl, spec)
        _check(err.value)
        assert "does not divide" in str(err.value) and "(3)" in str(err.value), str(err.value)


def test_a_pipeline_spec_is_sent_to_measure_pipeline(gpt):
    """measure_parallel sharded a pipeline spec's pp dimension as HSDP's replicas (a wrong size), or
    raised torch's "fully_shard expects a 1D or 2D DeviceMesh" (PP 2 x replicate 2): one line now."""
    from memsave_nb.parallel import ParallelError, measure_pipeline

    for fields in (
        {"world_size": 2, "pipeline_parallel": 2},
        {"world_size": 4, "replicate": 2, "pipeline_parallel": 2},
    ):
        spec = ParallelSpec(**fields)
        with pytest.raises(ParallelError, match="measure_pipeline") as info:
            measure_parallel(gpt, spec)
        _check(info.value)
    assert measure_pipeline(gpt, ParallelSpec(world_size=2, pipeline_parallel=2, microbatches=2)).device_peak_bytes > 0
