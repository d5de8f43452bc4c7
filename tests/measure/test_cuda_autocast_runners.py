"""CUDA's autocast lists beyond the fake engine (issue 40 part 2): a real CPU step sized for CUDA
follows them, a compiled step says it did not, and the title's words name them when followed.
Oracle: the same block with CUDA's casts written out by hand (``test_cuda_autocast.Block``)."""

from __future__ import annotations

import torch

from memsave_nb import measure
from memsave_nb.measure import cuda_autocast as ca
from memsave_nb.measure.common import sized_words
from tests.measure.test_cuda_autocast import B, D, O, T, _block


def test_a_real_cpu_step_sized_for_cuda_follows_the_lists():
    plain = measure(_block(), "real", repeats=0)
    sized = measure(_block(sized_for="cuda"), "real", repeats=0)
    by_hand = measure(_block(by_hand=True), "real", repeats=0)
    # fp32 layer_norm input and softmax output: 2 B more per element, as the real step with CUDA's casts
    assert sized.saved_bytes - plain.saved_bytes == 2 * B * T * D + 2 * B * T * O == 3_584
    assert sized.saved_bytes == by_hand.saved_bytes == 13_056
    assert any(n.startswith("autocast as CUDA runs it: layer_norm, softmax.int") for n in sized.notes)
    assert ca._USERS == [0] and not ca._LIBRARY
    # timed steps run under the lists too, and the model is left as it was
    timed = measure(_block(sized_for="cuda"), "real", repeats=1)
    assert timed.saved_bytes == 13_056 and timed.step_seconds is not None


def test_the_title_names_cuda_autocast_lists_when_followed():
    real = measure(_block(sized_for="cuda"), "real", repeats=0)
    fake = measure(_block(sized_for="cuda"), "fake", repeats=0)
    no_autocast = measure(_block(sized_for="cuda").replace(autocast_dtype=None), "fake", repeats=0)
    assert sized_words(fake.notes) == ", sized as CUDA runs it (CUDA's autocast lists)"
    assert (
        sized_words(real.notes) == ", sized as CUDA runs it (the CPU's attention (a real step), CUDA's autocast lists)"
    )
    assert sized_words(no_autocast.notes) == ", sized as CUDA runs it (no optimizer step)"
    assert sized_words(measure(_block(), "fake", repeats=0).notes) == ""


def test_a_compiled_step_says_it_ran_the_cpu_lists():
    """The compiled route does not answer autocast's kernels (a graph compiled before would be reused
    as traced): a step sized for CUDA under autocast says so; without autocast, or not sized, nothing."""
    torch._dynamo.reset()
    try:
        w = _block(sized_for="cuda")
        compiled = measure(w.replace(model=torch.compile(w.model, backend="eager")), "real", repeats=0)
        note = "sized for CUDA, but this compiled step ran autocast's cpu op lists, not CUDA's"
        assert any(n.startswith(note) for n in compiled.notes)
        assert all(len(n) <= 300 for n in compiled.notes)
        for other in (w.replace(autocast_dtype=None), w.replace(sized_for=None)):
            m = measure(other.replace(model=torch.compile(other.model, backend="eager")), "real", repeats=0)
            assert not any("op lists" in n for n in m.notes)
    finally:
        torch._dynamo.reset()
