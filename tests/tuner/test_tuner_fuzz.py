"""Issue 25, section 4: the hypothesis fuzz over the tuner's surface (knobs, the parallel spec,
the target, the searches' and the planner's arguments), with hostile numbers (0, negative, NaN,
inf, 1e300, 2**40, 10**30) and wrong types.

Every call returns a result or raises one ``MemsaveError`` line under 300 characters; the model
comes back bit for bit (values, dtypes, ``.grad`` objects, flags); fake mode keeps the process's
RSS bounded whatever batch size it is asked for. Small models and fake mode keep it fast: about
2,000 examples in all.
"""

from __future__ import annotations

import math
import resource

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from memsave_nb.errors import MemsaveError
from memsave_nb.knobs import OPTIMIZERS, PRECISIONS
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.plan import Plan
from memsave_nb.target import Target, max_batch, max_seq_len, measure_peak
from memsave_nb.workload import Workload


def fuzz(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


HOSTILE_NUMBERS = [
    0,
    -1,
    -2,
    1,
    2,
    3,
    4,
    8,
    0.5,
    1.5,
    -0.0,
    math.nan,
    math.inf,
    -math.inf,
    1e300,
    1e308,
    2**40,
    2**31,
    2**31 - 1,
    10**30,
    -(10**30),
    True,
    False,
]
WRONG_TYPES = [None, "2", "", "x" * 5000, b"1", [], [1], (2,), {}, {"a": 1}, object(), torch.tensor(2), 2j]
hostile = st.one_of(st.sampled_from(HOSTILE_NUMBERS + WRONG_TYPES), st.integers(), st.floats(), st.text(max_size=8))


def small(values: list) -> st.SearchStrategy:
    """Mostly valid choices, sometimes hostile ones."""
    return st.one_of(st.sampled_from(values), hostile)


def _one_line(exc: BaseException) -> None:
    text = str(exc)
    assert isinstance(exc, MemsaveError), f"{type(exc).__name__}: {text[:300]}"
    assert "\n" not in text and 0 < len(text) < 300, text[:400]


def _call(fn, *args, **kwargs):
    """``fn(...)``'s result, or None after checking the error is one MemsaveError line."""
    try:
        return fn(*args, **kwargs)
    except MemsaveError as exc:
        _one_line(exc)
        return None


# -- plain data: no model involved ------------------------------------------------------------

knob_fields = st.fixed_dictionaries(
    {},
    optional={
        "batch_size": small([None, 1, 2, 7]),
        "seq_len": small([None, 1, 16]),
        "accumulation_steps": small([None, 1, 2]),
        "precision": small([None, *PRECISIONS, "BF16", "auto-cast_bf16", "fp64"]),
        "optimizer": small([None, *OPTIMIZERS, "ADAMW", "sophia"]),
        "set_to_none": small([None, True, False]),
        "loss": small([None, "full", "chunked", "CHUNKED", "fused", 1]),
        "loss_chunk": small([None, 1, 1024, 0, -1, 2**31, True, 2.0]),
    },
)

parallel_fields = st.fixed_dictionaries(
    {},
    optional={
        "world_size": small([1, 2, 3, 8, 1 << 16, (1 << 16) + 1]),
        "strategy": small(["fsdp", "ddp", "tp"]),
        "shard_modules": small([(), ("0",), ["0", "2"], "0", ("nope",), {"a": 1}, (1,)]),
        "replicate": small([1, 2, 3]),
        "reshard_after_forward": small([True, False]),
        "param_dtype": small([None, "bfloat16", "float16", "int8"]),
        "reduce_dtype": small([None, "float32"]),
        "cpu_offload": small([True, False]),
        "bucket_cap_mb": small([1, 25.0, 0.001]),
        "gradient_as_bucket_view": small([True, False]),
        "bogus_field": st.just(1),
    },
)


@fuzz(700)
@given(knobs=knob_fields)
def test_fuzz_knob_fields(knobs):
    plan = _call(Plan, **knobs)
    if plan is not None:  # what was accepted survives a JSON round trip
        assert Plan.from_json(plan.to_json()) == plan


@fuzz(500)
@given(fields=parallel_fields, as_object=st.booleans())
def test_fuzz_parallel_fields(fields, as_object):
    from memsave_nb.parallel import ParallelSpec

    if as_object and "bogus_field" not in fields:
        spec = _call(ParallelSpec, **fields)
        if spec is not None:
            assert ParallelSpec.from_dict(spec.to_dict()) == spec
    else:
        _call(Plan, parallel=fields)


@fuzz(300)
@given(gb=small([0.01, 24, 80, 141]), headroom=small([0.8, 1, 0.01]))
def test_fuzz_target(gb, headroom):
    target = _call(Target, gb, headroom)
    if target is not None:
        assert 0 < target.usable_bytes <= target.total_bytes < 2**63
        assert target.verdict(target.usable_bytes).startswith("fits")


# -- searches and the planner on a small model, fake mode -------------------------------------


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model(torch.randn(2, 8)).sum().backward()  # a model after a training cell: it holds grads
    return Workload(model, torch.randn(4, 8), name="tiny")


@pytest.fixture(scope="module")
def tiny_lm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32))
    return Workload(model, torch.randint(0, 32, (2, 6)), name="tiny_lm")


class _Untouched:
    """The model's values (bit for bit), dtypes, grads and flags, before and after."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.snapshot = ModelSnapshot.capture(model)
        self.values = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
        self.grads = {n: (p.grad, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}

    def check(self) -> None:
        assert self.snapshot.differences(self.model) == []
        now = self.model.state_dict(keep_vars=True)
        for k, v in self.values.items():
            assert now[k].dtype == v.dtype and torch.equal(now[k].detach(), v), k
        for n, p in self.model.named_parameters():
            grad, copy = self.grads[n]
            assert p.grad is grad and (copy is None or torch.equal(p.grad, copy)), n


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# the RSS a fake-mode step may add over the whole fuzz (its batches as real tensors would be TBs)
RSS_BOUND_MIB = 256


@fuzz(100)
@given(
    knobs=st.fixed_dictionaries(
        {},
        optional={
            "batch_size": st.sampled_from([1, 3, 64, 4096, 2**20, 2**31 - 1]),
            "precision": st.sampled_from([None, *PRECISIONS]),
            "optimizer": st.sampled_from([None, "adamw", "sgd", "sgd_momentum", "adafactor", "adamw_foreach"]),
            "accumulation_steps": st.sampled_from([None, 1, 2]),
            "set_to_none": st.sampled_from([None, True, False]),
        },
    )
)
def test_fuzz_measure_peak_with_knobs(tiny, knobs):
    """Accepted knob plans measure in fake mode, whatever the batch size, with the model intact."""
    before = _rss_mib()
    untouched = _Untouched(tiny.model)
    m = _call(measure_peak, tiny, Plan(**knobs))
    untouched.check()
    if m is not None:
        assert m.peak_bytes > 0
        if knobs.get("batch_size"):
            assert m.peak_bytes >= knobs["batch_size"] * 8 * 2  # the batch itself, at least bf16
    assert _rss_mib() - before < RSS_BOUND_MIB


@fuzz(150)
@given(
    plan=st.one_of(st.just(Plan()), st.just(Plan(precision="bf16")), hostile),
    target=st.one_of(st.sampled_from([Target(1e-4, 1.0), Target(80)]), hostile),
    mode=small(["fake"]),
    upper=small([None, 1, 4, 8]),
    seq=st.booleans(),
)
def test_fuzz_search_arguments(tiny, tiny_lm, plan, target, mode, upper, seq):
    wl = tiny_lm if seq else tiny
    untouched = _Untouched(wl.model)
    kwargs = {"mode": mode}
    if upper is not None:
        kwargs["upper"] = upper
    search = max_seq_len if seq else max_batch
    r = _call(search, wl, plan, target, **kwargs)
    untouched.check()
    if r is not None:
        assert 0 <= r.value and (upper is None or r.value <= upper)


@fuzz(120)
@given(
    kwargs=st.fixed_dictionaries(
        {},
        optional={
            "mode": small(["fake"]),
            "micro_batches": small([(1,), [1, 2], (0,), [-2], (3,), [2**40]]),
            "regions": small([[], ["0"], ["nope"], "0", [""], [None]]),
            "region_kinds": small([(), ("full",), ("offload", "nope")]),
            "precisions": small([(None,), ("bf16",), ("bf16_master", None), ("fp64",), "bf16"]),
            "memsave": small([(False,), (True, False), (1,)]),
            "base_plan": small([None, Plan(), Plan(batch_size=2)]),
            "freezing": small([None, {"all": Plan()}, {"a": None}, {"b": "plan"}, ["x"]]),
            "remeasure": small([0, 1, -1]),
            "link": small(["pcie5", "nvlink_c2c", "carrier pigeon"]),
            "compile_budgets": small([(), (0.5,), (2.0,), (math.nan,)]),
        },
    ),
    target=st.one_of(st.just(Target(1)), hostile),
)
def test_fuzz_planner_arguments(tiny, kwargs, target):
    from memsave_nb.planner.search import plan_for

    kwargs.setdefault("regions", [])  # keep the accepted searches small
    kwargs.setdefault("remeasure", 1)
    untouched = _Untouched(tiny.model)
    r = _call(plan_for, tiny, target, **kwargs)
    untouched.check()
    if r is not None:
        assert r.chosen is None or r.chosen.fits


@fuzz(12)
@given(
    fields=st.fixed_dictionaries(
        {"world_size": st.sampled_from([1, 2, 3, 0, -1, 2**40, math.nan])},
        optional={
            "strategy": st.sampled_from(["fsdp", "ddp"]),
            "shard_modules": st.sampled_from([(), ("0",), ("nope",)]),
            "param_dtype": st.sampled_from([None, "bfloat16"]),
        },
    ),
    optimizer=st.sampled_from([None, "sgd", "adafactor"]),
)
def test_fuzz_measure_parallel(tiny, fields, optimizer):
    """Per-rank sizing: a figure or one line (never a raw torch exception), the model intact."""
    from memsave_nb.parallel import ParallelSpec, measure_parallel

    untouched = _Untouched(tiny.model)
    spec = _call(ParallelSpec, **fields)
    if spec is not None:
        r = _call(measure_parallel, tiny, spec, Plan(optimizer=optimizer))
        assert r is None or r.peak_bytes > 0
    untouched.check()
