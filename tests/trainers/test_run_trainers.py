"""The trainers themselves, on CPU, with the configs we write: the arguments are accepted, two
optimizer steps run, and the step's peak is compared with the plan's, measured by PyTorch's
profiler memory timeline (an oracle outside our tracker; it sees the batch and frozen parameters).

What was measured (HF Trainer 5.25, tiny Llama, batch 2 x 16, vocab 64):

- The Trainer's step-2 peak equals, to the byte within 0.1%, the same plan run as a plain loop that
  drops the model output before backward (``Trainer.compute_loss`` returns only the loss). This
  checks that the written arguments make the Trainer run the plan.
- Our engine's loop keeps the output (the logits) alive through backward, so without
  checkpointing its peak is the Trainer's + the logits (``B*T*V*4`` bytes) + the loss.
- With checkpointed layers our tracker once reported less than the profiler saw for the same loop
  (5,040 bytes on full fine-tuning, 20,272 with LoRA): checkpoint's stashed CPU generator states,
  made below the dispatcher; counted now, the checkpointed steps agree within 64 bytes.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from memsave_nb import Plan, Workload, measure
from memsave_nb.trainers import from_trainer, to_trainer

from .conftest import VOCAB, tiny_llama

transformers = pytest.importorskip("transformers")

B, T = 2, 16
LAYERS = [f"model.layers.{i}" for i in range(4)]


def profiler_peak(events) -> int:
    """The peak of live tensor bytes in a profiler memory timeline: PREEXISTING and CREATE add,
    DESTROY subtracts, in order."""
    from torch.profiler._memory_profiler import Action

    live = peak = 0
    for _, action, _, size in events:
        if action in (Action.PREEXISTING, Action.CREATE):
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


def _profiler():
    acts = [torch.profiler.ProfilerActivity.CPU]
    return torch.profiler.profile(activities=acts, profile_memory=True, record_shapes=True, with_stack=True)


class StepPeak(transformers.TrainerCallback):
    """The profiler around the Trainer's second optimizer step (all its micro-steps)."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == 1:
            self.prof = _profiler()
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 2:
            self.prof.__exit__(None, None, None)
            self.peak_bytes = profiler_peak(self.prof._memory_profile().timeline)


def plain_loop_peak(plan: Plan, model: torch.nn.Module, keep_output: bool) -> int:
    """The plan applied to the workload, stepped by hand as the Trainer steps (k micro-steps of
    forward, loss / k, backward; then step and zero_grad), step 2 under the profiler."""
    with plan.apply(Workload(model, batch=_batch())) as w:
        opt = w.make_optimizer()

        def step() -> None:
            for _ in range(w.accumulation_steps):
                out = w.forward(w.make_batch())
                loss = w.compute_loss(out) / w.accumulation_steps
                if not keep_output:
                    del out
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        with _profiler() as prof:
            step()
        for p in model.parameters():
            p.grad = None
        return profiler_peak(prof._memory_profile().timeline)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _plan_peak(plan: Plan, model: torch.nn.Module, loop: str = "loss_only") -> int:
    with plan.apply(Workload(model, batch=_batch(), loop=loop)) as w:
        return measure(w, repeats=0, flops=False).peak_bytes


def _trainer_args(fields: dict, tmp_path, cls=None):
    cls = cls or transformers.TrainingArguments
    return cls(
        output_dir=str(tmp_path),
        max_steps=2,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **fields,
    )


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def _model(lora: bool) -> torch.nn.Module:
    model = tiny_llama()
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    return model


CASES = {
    "full_fp32": (Plan(batch_size=B, precision="fp32", optimizer="adamw", accumulation_steps=1), False),
    "checkpoint_all_accumulate_2": (
        Plan(
            batch_size=B,
            precision="fp32",
            optimizer="adamw_fused",
            accumulation_steps=2,
            regions={n: "full" for n in LAYERS},
        ),
        False,
    ),
    "checkpoint_every_2nd": (
        Plan(
            batch_size=B,
            precision="fp32",
            optimizer="sgd",
            accumulation_steps=1,
            regions={n: "full" for n in LAYERS[::2]},
        ),
        False,
    ),
    "lora": (Plan(batch_size=B, precision="fp32", optimizer="adamw", accumulation_steps=1), True),
    "lora_checkpoint_all": (
        Plan(
            batch_size=B,
            precision="fp32",
            optimizer="adamw",
            accumulation_steps=1,
            regions={"base_model.model." + n: "full" for n in LAYERS},
        ),
        True,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_hf_trainer_runs_our_arguments_and_matches_the_plans_peak(case, tmp_path):
    plan, lora = CASES[case]
    model = _model(lora)
    exported = to_trainer(plan, "hf", model=model)
    assert exported.notes == ()  # every choice here is a Trainer argument
    args = _trainer_args(exported.fields, tmp_path)  # TrainingArguments(**generated) constructs
    imported = from_trainer(args, model)  # and reads back as the same plan
    assert imported.plan == Plan(**{**plan.__dict__, "name": "hf"})

    batch = _batch()
    rows = [{k: v[i] for k, v in batch.items()} for i in range(B)] * 4
    probe = StepPeak()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[probe])
        trainer.train()
    assert trainer.state.global_step == 2 and probe.peak_bytes is not None

    # a fresh model for each measurement: the plain loop measured on the model the Trainer had just
    # trained read 20 KB off (seen once inside pytest, not explained yet)
    assert plain_loop_peak(imported.plan, _model(lora), keep_output=False) == pytest.approx(probe.peak_bytes, rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if not CASES[c][0].regions])
def test_our_peak_is_the_trainers_and_the_kept_output_loop_adds_the_logits(case):
    """The default loop (loss_only) is the Trainer's: the same peak; the loop that keeps the output
    through the step (keep_output_step) holds the logits on top."""
    plan, lora = CASES[case]
    model = _model(lora)
    logits = B * T * VOCAB * 4
    trainer_loop = plain_loop_peak(plan, model, keep_output=False)
    assert _plan_peak(plan, _model(lora)) == pytest.approx(trainer_loop, rel=1e-3)
    kept = _plan_peak(plan, _model(lora), loop="keep_output_step")
    assert kept == pytest.approx(trainer_loop + logits, rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["loss_only", "keep_output_backward"])
@pytest.mark.parametrize("case", ["checkpoint_all_accumulate_2", "lora_checkpoint_all"])
def test_our_peak_with_checkpointing_is_the_profilers(case, loop):
    """Checkpointed steps to within 64 bytes of the profiler's timeline for the same loop (the
    0-dim wrapped numbers C++ makes from Python scalars, e.g. LoRA's scaling, and the batch this
    loop makes inside its step). The 5-20 KB gap once seen here was checkpoint's stashed CPU
    generator states (5,056 B per region and per recomputation), counted since; the test compared
    the loss_only loop with a loop that keeps the logits (8,192 B) after the default loop changed."""
    plan, lora = CASES[case]
    ours = _plan_peak(plan, _model(lora), loop=loop)
    theirs = plain_loop_peak(plan, _model(lora), keep_output=loop != "loss_only")
    assert abs(ours - theirs) <= 64, f"measure() {ours:,} B, profiler {theirs:,} B"


@pytest.mark.slow
def test_trl_sft_trainer_runs_our_config(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
        pad_token="t0",
        eos_token="t2",
        unk_token="t1",
    )
    model = tiny_llama()
    plan = Plan(
        batch_size=B,
        seq_len=T,
        precision="fp32",
        optimizer="adamw",
        accumulation_steps=1,
        regions={n: "full" for n in LAYERS},
        loss="trl_cpu",
    )
    exported = to_trainer(plan, "trl", model=model)
    assert exported.notes == () and exported.fields.pop("use_cpu") is True  # loss='trl_cpu': TRL on the CPU
    args = _trainer_args(exported.fields, tmp_path, trl.SFTConfig)
    imported = from_trainer(args, model)
    assert imported.plan == Plan(**{**plan.__dict__, "name": "trl"})
    ours = _plan_peak(imported.plan, tiny_llama())

    ids = _batch()["input_ids"]
    ds = datasets.Dataset.from_dict({"input_ids": [row.tolist() for row in ids] * 4})
    probe = StepPeak()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[probe])
        trainer.train()
    assert trainer.state.global_step == 2
    # TRL's fused LM head as it runs on the CPU (a tokens x 32768 buffer whatever the vocabulary):
    # sized by loss='trl_cpu' (tests/trainers/test_trl_head.py holds it to the allocator)
    assert ours == pytest.approx(probe.peak_bytes, rel=1e-3)
    assert any("fused LM head" in n for n in imported.notes)
