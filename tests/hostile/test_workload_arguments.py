"""The Python doors below the hub and the trainers under hypothesis (issue 38: "Nine places quote a
hostile value whole"): ``Workload``'s fields, ``measure``'s mode, ``zoo.make``, ``Session``'s mode.
Every value is measured or refused in one line of at most 200 characters that holds no run of 100 of
the hostile value's 120 ``Z``s, and the model is left as it was."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from memsave_nb import Workload, measure, zoo
from memsave_nb.errors import MemsaveError, quoted
from memsave_nb.model_state import ModelSnapshot

LONG = "Z" * 120
JUNK = st.sampled_from(
    [
        LONG,
        LONG * 1000,
        f"cuda:{LONG}",
        "",
        None,
        True,
        2.5,
        float("nan"),
        -1,
        0,
        2**63,
        [LONG],
        {LONG: 1},
        b"x",
        "\u2028\n",
        "cpu",
        "meta",
    ]
)


def _check(exc: BaseException) -> None:
    msg = str(exc)
    assert "\n" not in msg and 0 < len(msg) <= 200, msg
    assert "Z" * 100 not in msg, msg


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    field=st.sampled_from(
        [
            "loop",
            "device",
            "accumulation_steps",
            "optimizer",
            "set_to_none",
            "dtype",
            "autocast_dtype",
            "sized_for",
            "mode",
        ]
    ),
    value=JUNK,
)
def test_every_workload_field_and_mode_is_measured_or_refused_in_one_line(model, field, value):
    before = ModelSnapshot.capture(model)
    kwargs = {} if field == "mode" else {field: value}
    try:
        wl = Workload(model, torch.randn(2, 4), **kwargs)
        measure(wl, mode=value if field == "mode" else "fake")
    except (MemsaveError, TypeError) as exc:  # TypeError: Workload's own signature, never ours
        if isinstance(exc, MemsaveError):
            _check(exc)
    assert before.differences(model) == []


@pytest.mark.parametrize(
    "call", [lambda: zoo.make(LONG * 1000), lambda: zoo.make(f"gpt\n{LONG}")], ids=["long", "newline"]
)
def test_an_unknown_demo_model_is_one_short_line(call):
    with pytest.raises(MemsaveError) as err:
        call()
    _check(err.value)


def test_a_session_mode_is_one_short_line(model):
    from memsave_nb.session import Session

    with pytest.raises(MemsaveError) as err:
        Session(Workload(model, torch.randn(2, 4)), mode=LONG * 100)
    _check(err.value)


def test_quoted_cuts_any_value_to_one_short_line():
    assert quoted("adamw") == "'adamw'"
    assert quoted(LONG * 10) == "'" + "Z" * 36 + "..." and len(quoted(LONG * 10)) == 40
    assert quoted("a\nb\tc") == "'a\\nb\\tc'"

    class BadRepr:
        def __repr__(self):
            raise RuntimeError("no")

    assert quoted(BadRepr()) == "<BadRepr>"
