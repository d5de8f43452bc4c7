"""The two shortcuts that make large models fast to size, each against what it replaces."""

from __future__ import annotations

import pytest
import torch

from memsave_nb.parallel.apply import _LazyChunks
from memsave_nb.parallel.step import init_optimizer_state


@pytest.mark.parametrize("rows, n", [(10, 4), (10, 8), (1, 4), (0, 3), (8192, 64), (32000, 64), (7, 7), (5, 1), (3, 8)])
def test_lazy_chunks_are_torch_chunk_views(rows, n):
    """FSDP2's ``_chunk_with_empty``: ``torch.chunk`` padded with empty tensors to n pieces."""
    t = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    want = list(torch.chunk(t, n, dim=0))
    while len(want) < n:
        want.append(want[0].new_empty(0))
    got = _LazyChunks(t, n, 0)
    assert len(got) == n
    for i in range(n):
        a, b = want[i], got[i]
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
        if a.numel():
            assert b.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            assert a.storage_offset() == b.storage_offset()
        assert torch.equal(a, b)
    assert [x.shape for x in got[-2:]] == [x.shape for x in want[-2:]]


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps),
        lambda ps: torch.optim.Adam(ps, amsgrad=True),
        lambda ps: torch.optim.AdamW([{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.0}]),
    ],
    ids=["adamw", "adam-amsgrad", "two-groups"],
)
def test_init_optimizer_state_is_a_first_steps_state(make):
    def params():
        torch.manual_seed(0)
        ps = [
            torch.nn.Parameter(torch.randn(4, 3)),
            torch.nn.Parameter(torch.randn(5)),
            torch.nn.Parameter(torch.randn(2, 2)),
        ]
        for p in ps[:2]:
            p.grad = torch.zeros_like(p)  # the third has no gradient: no state, as in step()
        return ps

    a, b = params(), params()
    opt_a, opt_b = make(a), make(b)
    opt_a.step()
    assert init_optimizer_state(opt_b)
    for pa, pb in zip(a, b):
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert sorted(sa) == sorted(sb)
        for k in sa:
            assert (sa[k].shape, sa[k].dtype, sa[k].device, sa[k].stride()) == (
                sb[k].shape,
                sb[k].dtype,
                sb[k].device,
                sb[k].stride(),
            )
            assert sa[k].untyped_storage().nbytes() == sb[k].untyped_storage().nbytes()


def test_other_optimizers_take_the_step():
    p = torch.nn.Parameter(torch.ones(3))
    assert not init_optimizer_state(torch.optim.SGD([p], lr=0.1, momentum=0.9))
