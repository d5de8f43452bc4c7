"""TRL's ``activation_offloading`` with gradient checkpointing on (SFTConfig's default), held to
TRL's own ``OffloadActivations`` run on a tiny Llama on the CPU.

TRL's hooks wrap the whole forward; a checkpointed layer saves only its inputs through them (the
checkpoint's own hooks take everything inside), so what leaves a layer is its input hidden state.
memsave_nb sizes that as ``full_offload`` regions on the layers; the final norm's and the loss's
saved tensors, which TRL moves too, stay on the device in the plan: the test counts them apart.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple
from unittest import mock

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from memsave_nb import Plan, Workload, cli, measure
from memsave_nb.checkpointing import RegionKind
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.trainers import from_trainer, to_trainer

from .conftest import LAYERS, VOCAB, tiny_llama

trl = pytest.importorskip("trl")

B, T, D = 2, 16, 32  # tiny_llama's hidden size
LAYER_NAMES = [f"model.layers.{i}" for i in range(LAYERS)]


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


class _UnderTRL(nn.Module):
    """The model's forward inside TRL's context, as ``SFTTrainer.compute_loss`` runs it."""

    def __init__(self, model: nn.Module, ctx) -> None:
        super().__init__()
        self.model, self.ctx = model, ctx

    def forward(self, **batch):
        with self.ctx:
            return self.model(**batch)


class _CpuModule:
    """``torch.cpu`` plus the ``empty_cache`` TRL's ``__enter__`` calls once bitsandbytes is imported."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def empty_cache(self) -> None:
        pass


class _Save(NamedTuple):
    layer: int | None  # the decoder layer running when it was saved (None: outside the layers)
    moved: bool  # TRL copied it to the host
    nbytes: int
    param: bool  # a parameter or a view of one
    storage: int  # the device storage (a held weak ref keeps the address from being reused)


def _trl_step(every_n: int = 1) -> tuple[Any, list[_Save]]:
    """TRL's context (single stream, unpinned: the CPU has neither) on a Llama checkpointed as
    transformers does it, its pack hook wrapped to record each saved tensor it sees. The host copy
    is hidden from the memory tracker, as a host buffer on a GPU machine is not device memory."""
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    model = tiny_llama()
    model.activation_checkpointing_enable(every_n_layers=every_n)
    with mock.patch("torch.accelerator.current_accelerator", return_value=torch.device("cpu")):
        ctx = get_act_offloading_ctx_manager(model, use_pin_memory=False, use_streams=False)
    ctx.device_module = _CpuModule()
    layer: list[int | None] = [None]
    for i, block in enumerate(model.model.layers):
        block.register_forward_pre_hook(lambda *a, i=i: layer.__setitem__(0, i))
        block.register_forward_hook(lambda *a: layer.__setitem__(0, None))
    params = {id(p) for p in model.parameters()}
    saves: list[_Save] = []
    refs: list[StorageWeakRef] = []
    pack = ctx.pack_hook

    def counting_pack(t):
        with _disable_current_modes():
            tensor_id = pack(t)
        host, moved = ctx.tracker[tensor_id][:2]
        nbytes = host.numel() * host.element_size() if moved else t.numel() * t.element_size()
        param = id(t) in params or (t._base is not None and id(t._base) in params)
        refs.append(StorageWeakRef(t.untyped_storage()))
        saves.append(_Save(layer[0], moved, nbytes, param, refs[-1].cdata))
        return tensor_id

    ctx.pack_hook = counting_pack
    m = measure(Workload(model=_UnderTRL(model, ctx), batch=_batch(), optimizer="sgd"), mode="real", repeats=0)
    return m, saves


def _ours(kind: str, mode: str = "real"):
    wl = Workload(model=tiny_llama(), batch=_batch(), optimizer="sgd")
    before = ModelSnapshot.capture(wl.model)
    with Plan(regions={n: kind for n in LAYER_NAMES}).apply(wl) as w:
        m = measure(w, mode=mode, repeats=0)
    assert before.differences(wl.model) == []
    return m


def test_full_offload_is_trls_offloading_of_the_checkpointed_layers_to_the_byte():
    """TRL moves each layer's input (B x T x D float32, 4,096 B; 4 layers: 16,384 B) and, outside
    the layers, the final norm's input twice (pow and mul save it; single-stream mode copies each
    save) and its normalised output (3 x 4,096 B), and the loss's log-probabilities twice
    (log_softmax and nll_loss save them: 2 x B*T x vocab x 4 = 16,384 B). The token ids (256 B),
    the norm's rsqrt (128 B), the targets and the scalar are under TRL's 1,024 B; the LM head's
    saves pass TRL's no-op hooks. Device: each layer input is its own storage, freed once moved;
    outside, the three storages (4,096 + 4,096 + 8,192 B) are freed once each."""
    trl_m, saves = _trl_step()
    moved = [(x.layer is not None, x.nbytes, x.storage) for x in saves if x.moved]
    in_layers = sum(n for inside, n, _ in moved if inside)
    outside = [(n, s) for inside, n, s in moved if not inside]
    outside_host = sum(n for n, _ in outside)
    outside_device = sum(dict((s, n) for n, s in outside).values())
    assert in_layers == LAYERS * B * T * D * 4 == 16_384
    assert outside_host == 3 * B * T * D * 4 + 2 * B * T * VOCAB * 4 == 28_672
    assert outside_device == 2 * B * T * D * 4 + B * T * VOCAB * 4 == 16_384

    full, ours = _ours("full"), _ours("full_offload")
    assert ours.host.to_host_bytes == ours.host.peak_bytes == ours.host.to_device_bytes == in_layers
    assert ours.host.tensors == sum(1 for inside, _, _ in moved if inside) == LAYERS
    assert full.host.to_host_bytes == 0
    # device: ours frees what TRL frees in the layers; TRL frees the rest besides
    assert full.end_of_forward.total - ours.end_of_forward.total == in_layers
    assert full.end_of_forward.total - trl_m.end_of_forward.total == in_layers + outside_device
    assert ours.peak_bytes <= full.peak_bytes
    assert _ours("full_offload", "fake").host == ours.host  # fake tensors count the same bytes


def test_sftconfig_with_both_switches_reads_as_full_offload_and_writes_back():
    model = tiny_llama()
    got = from_trainer({"activation_offloading": True, "gradient_checkpointing": True, "max_length": T}, model)
    assert sorted(got.plan.regions) == LAYER_NAMES
    assert {p.kind for p in got.plan.regions.values()} == {RegionKind.FULL_OFFLOAD}
    assert any("full_offload" in n for n in got.notes)
    back = to_trainer(got.plan, "trl", model=model).fields
    assert back["activation_offloading"] is True and back["activation_checkpointing"] is True
    assert "offload" not in json.dumps(back.get("activation_checkpointing_kwargs", {}))
    # without checkpointing: every saved tensor of the layers goes, as before
    alone = from_trainer({"activation_offloading": True, "gradient_checkpointing": False}, model)
    assert {p.kind for p in alone.plan.regions.values()} == {RegionKind.OFFLOAD}
    # checkpointing alone: no host bytes
    plain = from_trainer({"gradient_checkpointing": True}, model)
    assert {p.kind for p in plain.plan.regions.values()} == {RegionKind.FULL}


def _grads(model: nn.Module) -> list[torch.Tensor]:
    model(**_batch()).loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_exported_code_checkpoints_then_offloads_each_layer_and_keeps_the_gradients():
    """The snippet runs on a fresh model: same gradients as the plain model, and its offload hook
    (the outer one) packs exactly one tensor per layer, the layer's B x T x D input."""
    plan = Plan(regions={n: "full_offload" for n in LAYER_NAMES})
    code = plan.to_code()
    for n in LAYER_NAMES:
        target = f"model.get_submodule({n!r})"
        assert code.index(f"checkpoint_region({target})") < code.index(f"offload_region({target})")
    expected, fresh = _grads(tiny_llama()), tiny_llama()
    exec(compile(code, "<plan>", "exec", dont_inherit=True), {"model": fresh})
    packed: list[tuple[int, ...]] = []
    real_hooks = torch.autograd.graph.saved_tensors_hooks

    def spying_hooks(pack, unpack):
        return real_hooks(lambda t: (packed.append(tuple(t.shape)), pack(t))[1], unpack)

    with mock.patch("torch.autograd.graph.saved_tensors_hooks", spying_hooks):
        got = _grads(fresh)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected))
    assert packed == [(B, T, D)] * LAYERS


def test_report_from_an_sftconfig_prints_the_host_line(capsys, tiny, tmp_path):
    """TINY_LLAMA (2 layers, hidden 64, float32), SFTConfig's batch 8, max_length 64: the host
    holds each layer's input, 2 x 8 x 64 x 64 x 4 = 262,144 B, in --json and on the host line."""
    from tests.conftest import TINY_LLAMA

    fields = tmp_path / "sft.yaml"
    fields.write_text("activation_offloading: true\ngradient_checkpointing: true\nmax_length: 64\nbf16: false\n")
    assert cli.main(["report", "--model", tiny, "--from-config", str(fields), "--json"]) == 0
    host = json.loads(capsys.readouterr().out)["host"]
    layers, hidden = TINY_LLAMA["num_hidden_layers"], TINY_LLAMA["hidden_size"]
    assert host["to_host_bytes"] == host["peak_bytes"] == layers * 8 * 64 * hidden * 4 == 262_144
    assert host["tensors"] == layers
    assert cli.main(["report", "--model", tiny, "--from-config", str(fields)]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = [x for x in lines if x.startswith("Host memory: ")]
    assert len(line) == 1 and "to the host in forward" in line[0] and "256.0 KiB" in line[0]
    fields.write_text("gradient_checkpointing: true\nmax_length: 64\nbf16: false\n")
    assert cli.main(["report", "--model", tiny, "--from-config", str(fields)]) == 0
    assert "Host memory" not in capsys.readouterr().out


def test_every_second_layer_checkpointed_the_others_are_offload_regions_to_the_byte():
    """``every_n_layers=2``: layers 0 and 2 keep only their inputs (full_offload), layers 1 and 3
    have every saved tensor moved by TRL (offload regions). Ours moves, besides what TRL moves in
    the layers, the small tensors TRL keeps under its 1,024 B in layers 1 and 3 (per layer: the
    two norms' rsqrt and its input, 4 x 128 B; the rotary cos/sin views, 1 x 1 x T x head_dim,
    that the four products with q and k save, 4 x 512 B; the attention's 512 B log-sum-exp): an offload region has no threshold. Device: ours frees at most those."""
    trl_m, saves = _trl_step(every_n=2)
    fields = {"activation_offloading": True, "gradient_checkpointing": True, "max_length": T}
    got = from_trainer({**fields, "gradient_checkpointing_kwargs": {"every_n_layers": 2}}, tiny_llama())
    kinds = {n: p.kind for n, p in got.plan.regions.items()}
    assert kinds == {
        n: RegionKind.FULL_OFFLOAD if i % 2 == 0 else RegionKind.OFFLOAD for i, n in enumerate(LAYER_NAMES)
    }
    in_layers = sum(x.nbytes for x in saves if x.moved and x.layer is not None)
    small = [x for x in saves if x.layer in (1, 3) and not x.moved and not x.param]
    assert all(x.nbytes < 1024 for x in small) and sum(x.nbytes for x in small) == 2 * (4 * 128 + 5 * 512)
    outside = {x.storage: x.nbytes for x in saves if x.moved and x.layer is None}

    wl = Workload(model=tiny_llama(), batch=_batch(), optimizer="sgd")
    with Plan(regions=got.plan.regions).apply(wl) as w:
        ours = measure(w, mode="real", repeats=0)
    with Plan(regions={n: "full" for n in LAYER_NAMES[::2]}).apply(wl) as w:
        full = measure(w, mode="real", repeats=0)
    assert ours.host.to_host_bytes == in_layers + sum(x.nbytes for x in small) == 202_752
    trl_layers_freed = full.end_of_forward.total - trl_m.end_of_forward.total - sum(outside.values())
    ours_freed = full.end_of_forward.total - ours.end_of_forward.total
    assert 0 <= ours_freed - trl_layers_freed <= sum({x.storage: x.nbytes for x in small}.values())
    back = to_trainer(got.plan, "trl", model=tiny_llama()).fields
    assert back["activation_offloading"] is True
    assert back["activation_checkpointing_kwargs"]["every_n_layers"] == 2


def test_full_offload_is_written_for_every_trainer_never_dropped(tmp_path):
    """TRL: a real ``SFTConfig`` built from the written fields (every warning an error) reads back
    as the same regions. HF: ``activation_checkpointing_kwargs.offload`` (transformers wraps each
    checkpoint in ``save_on_cpu``); axolotl: ``gradient_checkpointing: offload``; accelerate has no
    field and says so."""
    import warnings

    model = tiny_llama()
    plan = Plan(regions={n: "full_offload" for n in LAYER_NAMES}, seq_len=T, precision="fp32")
    fields = to_trainer(plan, "trl", model=model).fields
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **fields)
    assert args.activation_offloading and args.activation_checkpointing
    assert from_trainer(args, model).plan.regions == plan.regions
    hf = to_trainer(plan, "hf", model=model).fields
    assert hf["activation_checkpointing"] is True and hf["activation_checkpointing_kwargs"]["offload"] is True
    assert to_trainer(plan, "axolotl", model=model).fields["gradient_checkpointing"] == "offload"
    assert any("full_offload regions" in n for n in to_trainer(plan, "accelerate", model=model).notes)
