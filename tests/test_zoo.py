"""Demo workloads: seeded, the right parts, sized for the explorer, and the 7B shape built fake."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_nb import WorkloadError, zoo


@pytest.mark.parametrize("name", ["cnn", "gpt", "mlp"])
def test_seeded_and_reproducible(name):
    a, b = zoo.make(name, 2), zoo.make(name, 2)
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    c = zoo.make(name, 2, seed=1)
    assert not all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), c.model.state_dict().values()))


def _types(model: nn.Module) -> set[type]:
    return {type(m) for m in model.modules()}


def test_parts():
    assert {nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d, nn.Linear} <= _types(zoo.make("cnn", 1).model)
    gpt = zoo.make("gpt", 1).model
    assert {nn.Embedding, nn.LayerNorm, nn.GELU, nn.Linear, nn.Dropout} <= _types(gpt)
    assert len(gpt.blocks) == gpt.config.n_layer and isinstance(gpt.head, nn.Linear)
    assert {nn.Linear, nn.ReLU} <= _types(zoo.make("mlp", 1).model)


def test_gpt_takes_a_dict_batch_and_returns_a_loss():
    wl = zoo.make("gpt", 2)
    batch = wl.make_batch()
    assert set(batch) == {"idx", "targets"}
    out = wl.forward(batch)
    assert out.logits.shape == (2, wl.model.config.block_size, wl.model.config.vocab_size)
    assert wl.compute_loss(out).shape == ()


def test_default_batch_sizes():
    assert zoo.make("cnn").make_batch().shape[0] == zoo.DEFAULT_BATCH["cnn"]
    assert zoo.make("mlp").make_batch().shape[0] == zoo.DEFAULT_BATCH["mlp"]


def test_7b_is_fake_and_llama_shaped():
    from torch._subclasses.fake_tensor import FakeTensor

    wl = zoo.make("gpt-7b")
    params = list(wl.model.parameters())
    assert all(isinstance(p, FakeTensor) for p in params)
    assert {p.dtype for p in params} == {torch.bfloat16}
    cfg = wl.model.config
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.mlp_hidden, cfg.block_size) == (32, 4096, 32, 11008, 2048)
    assert torch.get_default_dtype() == torch.float32  # building it left the default alone


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(WorkloadError, match="choose from cnn, gpt, mlp, gpt-7b"):
        zoo.make("vgg")


def test_custom_gpt_config():
    wl = zoo.gpt(zoo.GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16, vocab_size=64), batch_size=1)
    assert len(wl.model.blocks) == 1 and wl.make_batch()["idx"].shape == (1, 16)
