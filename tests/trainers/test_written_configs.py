"""What ``to_trainer`` writes is what the installed trainers run (issue 41): every optimizer the
plan names becomes an ``optim`` whose optimizer the real ``Trainer`` builds with the same state
bytes as our knob's (or a note says why not); the configs construct without a deprecation
warning; and ``loss='hf_smooth'`` computes what the Trainer's label smoother computes, with the
same allocations."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

from memsave_nb import Plan, Workload
from memsave_nb.loss import label_smoother
from memsave_nb.vocabulary import OPTIMIZERS
from memsave_nb.trainers import from_trainer, hf, to_trainer

from measure.allocator_oracle import allocation_events  # tests/ is on sys.path

from .steady import optimizer_state_bytes, tiny

transformers = pytest.importorskip("transformers")

VOCAB = 512  # the embedding and head (16,384 elements) get bitsandbytes' 8-bit blocks; the norms stay float32


def _args(cls=None, **fields):
    cls = cls or transformers.TrainingArguments
    return cls(**{"output_dir": tempfile.mkdtemp(), "use_cpu": True, "report_to": "none", **fields})


def _one_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return optimizer_state_bytes(opt)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_is_written_as_one_the_trainer_builds_with_our_state(name):
    plan = Plan(optimizer=name)
    exported = to_trainer(plan, "hf")
    back = from_trainer(exported.fields, trainer="hf").plan.optimizer
    if back != name:  # written as another name: a note says which and why it is the same memory
        assert sum(f"optimizer {name!r}" in n for n in exported.notes) == 1, exported.notes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' kernel loader on CPU
        trainer = transformers.Trainer(model=tiny("llama", VOCAB), args=_args(**exported.fields))
        theirs = _one_step(trainer.model, trainer.create_optimizer())
    model = tiny("llama", VOCAB)
    with plan.apply(Workload(model, batch={"input_ids": torch.zeros(1, 2, dtype=torch.long)})) as w:
        ours = _one_step(model, w.make_optimizer())
    # the Trainer's 8-bit bitsandbytes optimizers keep nn.Embedding weights' state in 32 bits: the plain
    # 8-bit knobs are that much lower and read back as their *_embed32 form, which sizes it
    gap = hf.embedding_gap(plan.optimizer, model) if plan.optimizer.endswith("8bit") else 0
    assert (gap > 0) == (back == f"{name}_embed32")
    assert ours + gap == theirs > 0 or name == "sgd" and ours == theirs == 0


def test_sgd_momentum_in_optim_args_reads_as_sgd_momentum_and_bad_args_are_one_line():
    from memsave_nb.trainers import TrainerConfigError

    assert (
        from_trainer({"optim": "sgd", "optim_args": "momentum = 0.9, nesterov=true"}).plan.optimizer == "sgd_momentum"
    )
    notes = from_trainer({"optim": "sgd", "optim_args": "momentum=0.9"}).notes
    assert not any(n.startswith("optim") for n in notes)
    assert from_trainer({"optim": "sgd", "optim_args": "momentum=0"}).plan.optimizer == "sgd"
    for bad in ("momentum", "momentum=fast", "momentum=-1", "momentum=nan", "x" * 600):
        with pytest.raises(TrainerConfigError) as err:
            from_trainer({"optim": "sgd", "optim_args": bad})
        assert "\n" not in str(err.value) and len(str(err.value)) <= 200


LAYERS = [f"model.layers.{i}" for i in range(2)]
PLANS = [
    Plan(batch_size=2, precision="fp32", optimizer="adamw", accumulation_steps=1),
    Plan(
        batch_size=2,
        precision="autocast_bf16",
        optimizer="sgd_momentum",
        accumulation_steps=2,
        regions={n: "full" for n in LAYERS},
    ),
    Plan(
        batch_size=2,
        precision="autocast_fp16",
        optimizer="adam",
        regions={n: "full_offload" for n in LAYERS},
        seq_len=16,
        loss="hf_smooth",
    ),
    Plan(
        batch_size=2,
        precision="fp32",
        optimizer="lion",
        regions={n: "offload" for n in LAYERS},
        seq_len=16,
        loss="trl_smooth_cpu",
    ),
]


@pytest.mark.parametrize("trainer", ["hf", "trl"])
@pytest.mark.parametrize("plan", PLANS, ids=range(len(PLANS)))
def test_exported_fields_construct_without_deprecation_warnings(trainer, plan):
    """``TrainingArguments(**fields)`` / ``SFTConfig(**fields)`` with every warning an error: the
    names written are transformers 5.25's current ones (``activation_checkpointing*``, not the
    deprecated ``gradient_checkpointing*``), and they read back as the same plan where expressible."""
    cls = transformers.TrainingArguments
    if trainer == "trl":
        cls = pytest.importorskip("trl").SFTConfig
    model = tiny("llama", VOCAB)
    exported = to_trainer(plan, trainer, model=model)
    assert not any(k.startswith("gradient_checkpointing") for k in exported.fields)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = _args(cls, **exported.fields)
    back = from_trainer(args, model).plan.regions
    if trainer == "hf" and any(p.kind.value == "offload" for p in plan.regions.values()):
        # the Trainer offloads only inside its checkpoints (save_on_cpu): plain offload is not written, and says so
        assert back == {} and any("offload regions: the Trainer cannot offload" in n for n in exported.notes)
    else:
        assert back == plan.regions


def test_hf_smooth_is_the_trainers_label_smoother_value_gradient_and_allocations():
    """Against transformers' own ``LabelSmoother`` and ``Trainer.compute_loss``: the same loss and
    gradients, and the allocator's record of the smoother alone is the same to the byte."""
    from transformers.trainer_pt_utils import LabelSmoother

    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, :5] = -100  # padding is masked out of both terms
    batch = {"input_ids": ids, "labels": labels}
    items = labels[:, 1:].ne(-100).sum()

    model = tiny("qwen2", VOCAB)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = transformers.Trainer(model=model, args=_args(label_smoothing_factor=0.1))
    theirs = trainer.compute_loss(model, dict(batch), num_items_in_batch=items)
    theirs.backward()
    mine_model = tiny("qwen2", VOCAB)
    with Plan(loss="hf_smooth").apply(Workload(mine_model, batch=batch)) as w:
        mine = w.compute_loss(w.forward(w.make_batch()))
        mine.backward()
        grads = [q.grad.clone() for q in mine_model.parameters()]  # the plan's exit restores the model
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-6)
    for (n, p), g in zip(model.named_parameters(), grads):
        torch.testing.assert_close(g, p.grad, msg=lambda m: f"{n}: {m}")

    logits = torch.randn(2, 16, VOCAB, requires_grad=True)

    def record(fn) -> list[int]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = fn()
            loss.backward()
        logits.grad = None
        return [d for _, d in allocation_events(prof)]

    hf = record(lambda: LabelSmoother(0.1)({"logits": logits}, labels, shift_labels=True, num_items_in_batch=items))
    ours = record(lambda: label_smoother(logits, labels, 0.1, num_items=items))
    assert ours == hf and max(_running(hf)) >= 2 * 2 * 15 * VOCAB * 4  # two log-probability tensors at once


def _running(deltas: list[int]) -> list[int]:
    out, live = [], 0
    for d in deltas:
        live += d
        out.append(live)
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_axolotl_writes_each_optimizer_as_itself_or_says_so(name):
    exported = to_trainer(Plan(optimizer=name), "axolotl")
    back = from_trainer(exported.text, trainer="axolotl").plan.optimizer
    assert back == name or sum(f"{name!r}" in n or "momentum" in n for n in exported.notes) == 1, exported
    assert back is not None and (back.startswith("sgd") == name.startswith("sgd"))


def test_hf_sequence_length_is_said_to_come_from_the_data():
    imported = from_trainer({"per_device_train_batch_size": 2}, trainer="hf")
    assert imported.plan.seq_len is None and sum("comes from your data" in n for n in imported.notes) == 1
    exported = to_trainer(Plan(batch_size=2, seq_len=32), "hf")
    assert (
        "max_length" not in exported.fields
        and sum("sequence length 32: set by your data" in n for n in exported.notes) == 1
    )


def test_hf_smooth_on_a_model_without_logits_is_one_line_and_the_model_is_left_as_it_was():
    from memsave_nb.errors import MemsaveError

    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, VOCAB, (2, 8))
    with pytest.raises(MemsaveError) as err:
        with Plan(loss="hf_smooth").apply(Workload(model, batch={"input": ids, "labels": ids})) as w:
            w.compute_loss(w.forward(w.make_batch()))
    assert "\n" not in str(err.value) and len(str(err.value)) <= 200
    assert "forward" not in model.__dict__ and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
