"""Fixtures for the plan tests (the cases live in plan_cases.py)."""

import pytest
from plan_cases import CASES, Case


@pytest.fixture(params=CASES, ids=lambda c: c.name)
def case(request) -> Case:
    return request.param
