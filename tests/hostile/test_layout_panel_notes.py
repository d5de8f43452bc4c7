"""The GPUs tab's layout search on a LoRA model says on screen why layouts were left out (issue 38:
"the layout search then drops TP and pipeline stages for LoRA models and the panel shows only three
summary lines, not why"). TP on LoRA is sized now (``tests/parallel/test_tp_lora.py``); what is
still dropped (a stage count the blocks cannot split into, a TP degree that does not divide the KV
heads) is said in the status line, each reason the planner gave."""

from __future__ import annotations

import pytest

from memsave_nb.model_state import ModelSnapshot
from memsave_nb.ui.layout_panel import LayoutFinder

from parallel.test_tp_lora import lora_llama  # tests/ is on sys.path (rootdir-relative packages)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stage_counts_and_layouts_left_out_of_a_lora_search_are_said_in_the_panel():
    wl = lora_llama()  # 2 blocks, 2 KV heads
    before = ModelSnapshot.capture(wl.model)
    finder = LayoutFinder(wl, lambda: 4)
    finder.stages.value = "also try 2, 4, 8"
    finder.find()
    assert finder.result is not None and finder.result.chosen is not None
    status = finder.status.value
    # every planner note that says why something was left out is on screen, word for word
    left_out = [n for n in finder.result.notes if "do not both split" in n or "skipped (" in n]
    assert "PP 4: 4 GPUs and 2 blocks do not both split 4 ways" in left_out
    assert "PP 8: 4 GPUs and 2 blocks do not both split 8 ways" in left_out
    assert any(n.startswith("TP 4 ") and "does not divide num_key_value_heads (2)" in n for n in left_out)
    for n in left_out:
        assert f"note: {n}" in status.replace("&#x27;", "'"), n
    assert "communication: the payloads" not in status  # the search's own description stays in the notes
    assert before.differences(wl.model) == []
