"""Hugging Face's ``Trainer`` run for real on CPU, held to ``from_trainer`` + ``measure``.

Each cell builds ``TrainingArguments`` (fp32, batch 2 x 16, vocabulary 96, two layers), runs
two optimizer steps and compares the allocator's record of the second (``steady.SteadyStep``)
with what ``from_trainer(args, model)`` and ``measure`` say the plan keeps. Label smoothing is
``loss='hf_smooth'``: the Trainer's ``LabelSmoother`` over the full logits.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from memsave_nb import Workload, measure
from memsave_nb.trainers import from_trainer

from .steady import ARCHS, SteadyStep, tiny

transformers = pytest.importorskip("transformers")

B, T, VOCAB, HIDDEN = 4, 64, 8192, 32


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _args(tmp_path, **fields):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        per_device_train_batch_size=B,
        optim="adamw_torch",
        **fields,
    )


def run_trainer(model: torch.nn.Module, args) -> int:
    batch = _batch()
    rows = [{k: v[i] for k, v in batch.items()} for i in range(B)] * 4
    probe = SteadyStep()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[probe])
        trainer.train()
    assert trainer.state.global_step == 2 and probe.peak_bytes is not None
    return probe.peak_bytes


def ours(args, model: torch.nn.Module) -> tuple[int, tuple[str, ...], str | None]:
    imported = from_trainer(args, model)
    with imported.plan.apply(Workload(model, batch=_batch(), loop="loss_only")) as w:
        return measure(w, repeats=0, flops=False).peak_bytes, imported.notes, imported.plan.loss


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}
CASES = {
    "plain": {},
    "checkpointing": {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": False}},
    "lora": {},
    "label_smoothing": {"label_smoothing_factor": 0.1},
    "accumulate_2": {"gradient_accumulation_steps": 2},
}


def _model(arch: str, case: str) -> torch.nn.Module:
    model = tiny(arch, VOCAB, hidden=HIDDEN)
    if case == "lora":
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    return model


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", list(CASES))
def test_hf_trainer_steady_step_is_measured(arch, case, tmp_path):
    args = _args(tmp_path, **CASES[case])
    real = run_trainer(_model(arch, case), args)
    mine, notes, loss = ours(args, _model(arch, case))
    print(f"{arch} {case}: measure {mine:,} B, allocator {real:,} B, diff {mine - real:+,}")
    assert mine == pytest.approx(real, rel=1e-3)
    batch = 2 * B * T * 8  # input_ids and labels: made inside our step, before the Trainer's
    assert abs(mine - batch - real) <= 64, f"measure() {mine:,} B, allocator {real:,} B"
    assert (loss == "hf_smooth") == (case == "label_smoothing")
