"""The explorer's loss note names the loss the step really uses (issue 28, item 8): a model that
returns its own ``loss`` is told so in real and fake mode, also when its forward needs autograd
(a gradient penalty) and cannot be run without gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_nb.ui.explorer import explore
from memsave_nb.ui.explorer_text import loss_note_html, output_kind
from memsave_nb.workload import Workload, default_loss

pytestmark = pytest.mark.timeout(120)


class PenaltyNet(nn.Module):
    """Returns its own loss: the fit plus a gradient penalty on the input (autograd in forward)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        x = x.detach().requires_grad_(True)
        y = self.lin(x).tanh()
        (dy,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return {"loss": y.pow(2).mean() + dy.pow(2).mean(), "y": y}


def _workload():
    torch.manual_seed(0)
    return Workload(PenaltyNet(), torch.randn(8, 4), name="penalty")


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_a_model_with_its_own_loss_is_named_so_even_when_its_forward_needs_gradients(mode):
    wl = _workload()
    out = wl.forward(wl.make_batch())
    assert default_loss(out) is out["loss"]  # what the step uses: the model's own loss
    with torch.no_grad(), pytest.raises(RuntimeError):
        wl.forward(wl.make_batch())  # why a no-gradient forward could not tell
    before = {k: v.clone() for k, v in wl.model.state_dict().items()}
    assert output_kind(wl, fake=mode == "fake") == "loss"
    assert all(torch.equal(before[k], v) for k, v in wl.model.state_dict().items())  # the model as it was
    note = loss_note_html(wl, mode)
    assert "own <code>loss</code> output" in note and "sum" not in note
    ex = explore(wl, mode=mode, repeats=0, live=False)
    assert ex.loss_note.value == note


def test_a_plain_tensor_output_is_summed_and_a_given_loss_needs_no_note():
    wl = Workload(nn.Linear(4, 2), torch.randn(3, 4))
    assert "the sum of the model's output" in loss_note_html(wl, "real")
    assert loss_note_html(wl.replace(loss=lambda out: out.pow(2).mean()), "real") == ""
