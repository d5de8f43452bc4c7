"""Fixtures for the real-model suite: Hugging Face models built from small configs (random weights,
nothing downloaded) and a peft LoRA model, each built once per session and shared.

Every test leaves the models as they were (plans and ``measure`` restore them; tests that step a
model themselves put ``.grad`` back), so sharing is safe; a test that changes a model works on a copy.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from .real_cases import CASES, RealCase, shared  # noqa: E402


@pytest.fixture(scope="session", params=CASES, ids=lambda c: c.name)
def case(request) -> RealCase:
    return shared(request.param)
