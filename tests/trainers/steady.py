"""The allocator's record of a Hugging Face trainer's steady step (shared by the Trainer and
SFTTrainer tests), and the two small architectures they run.

The oracle is the CPU allocator's event record (``tests/measure/allocator_oracle.py``) over the
trainer's second optimizer step, all its micro-steps (the optimizer's state alive from the first),
plus the bytes alive when that step begins: parameters, gradients, optimizer state.
"""

from __future__ import annotations

import gc

import pytest
import torch

from measure.allocator_oracle import allocation_events, storage_bytes  # tests/ is on sys.path

transformers = pytest.importorskip("transformers")

ARCHS = ("llama", "qwen2")


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors, each storage once."""
    seen = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for s in opt.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    }
    return sum(seen.values())


def tiny(arch: str, vocab: int, layers: int = 2, hidden: int = 32) -> torch.nn.Module:
    """A small causal LM of ``arch`` from a config (random weights, nothing downloaded)."""
    torch.manual_seed(0)
    common = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "use_cache": False,
    }
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=False))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


class SteadyStep(transformers.TrainerCallback):
    """The allocator's peak over the trainer's second optimizer step (all its micro-steps), plus
    what was alive when it began (parameters, gradients, optimizer state)."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
        if state.global_step == 1 and not hasattr(self, "prof"):
            alive = list(model.parameters()) + [p.grad for p in model.parameters()]
            alive += [t for s in optimizer.state.values() for t in s.values()]
            self.baseline = storage_bytes(alive)
            gc.collect()
            self.prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=True
            )
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 2:
            self.prof.__exit__(None, None, None)
            live = rise = 0
            for _t, delta in allocation_events(self.prof):
                live += delta
                rise = max(rise, live)
            self.peak_bytes = self.baseline + rise
