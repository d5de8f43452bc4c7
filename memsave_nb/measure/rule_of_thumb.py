"""The teacher's view: the bytes-per-parameter rule of thumb beside what the step measured.

The rule every fine-tuning guide quotes counts three things per parameter: the weights (2 or 4
bytes by dtype), the gradients of the trainable ones (the same), and the optimizer's state
(AdamW: two moments; SGD with momentum: one; 8-bit AdamW: 2 bytes; fp32 master weights: 4 more),
hence "16 bytes per parameter for mixed-precision AdamW". It leaves out what the step keeps for
backward (activations), its outputs and temporaries: showing the rule beside the measured split
names that difference. A LoRA step's gradients and state are its adapters' only.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .result import PHASES, Measurement, MemorySplit

__all__ = ["RulePart", "TeacherView", "state_bytes_per_param", "teacher_view"]

# state bytes per trainable parameter: ("moments", n) scales with the parameter's dtype (torch keeps
# the state in it); ("fixed", b) does not (the layout optimizers' own dtypes, vocabulary.OPTIMIZERS)
_STATE: dict[str, tuple[str, float]] = {
    "adamw": ("moments", 2),
    "adamw_foreach": ("moments", 2),
    "adamw_fused": ("moments", 2),
    "adam": ("moments", 2),
    "sgd_momentum": ("moments", 1),
    "sgd": ("fixed", 0),
    "none": ("fixed", 0),
    "adafactor": ("fixed", 0),  # factored: a row and a column per matrix, about 0 per parameter
    "lion": ("fixed", 4),
    "adamw_8bit": ("fixed", 2),
    "lion_8bit": ("fixed", 1),
    "adamw_8bit_embed32": ("fixed", 2),
    "lion_8bit_embed32": ("fixed", 1),
}
MASTER_BYTES = 4  # an fp32 copy of each trainable parameter
# what the measured state holds beyond the rule, by optimizer
_STATE_EXTRA: dict[str, str] = {
    "adamw": "a 4-byte step counter per parameter tensor",
    "adam": "a 4-byte step counter per parameter tensor",
    "adamw_foreach": "a 4-byte step counter per parameter tensor",
    "adamw_fused": "a 4-byte step counter per parameter tensor",
    "adamw_8bit": "a float32 absmax per 256 elements; tensors under 4,096 elements keep float32 state",
    "lion_8bit": "a float32 absmax per 256 elements; tensors under 4,096 elements keep float32 state",
    "adamw_8bit_embed32": "float32 moments for nn.Embedding weights (8 bytes each); absmax per 256 elements",
    "lion_8bit_embed32": "a float32 moment for nn.Embedding weights (4 bytes each); absmax per 256 elements",
    "adafactor": "the factored moments (a row and a column per matrix)",
}


def state_bytes_per_param(optimizer: str | None, param_bytes: int, master: bool = False) -> float | None:
    """The rule's optimizer-state bytes per trainable parameter (None: an optimizer it has no rule for).
    With fp32 master weights the state is kept for the masters (fp32) and the masters are added."""
    if optimizer is None or optimizer not in _STATE:
        return None
    kind, n = _STATE[optimizer]
    if master:
        return (n * 4 if kind == "moments" else n) + MASTER_BYTES
    return n * param_bytes if kind == "moments" else n


@dataclass(frozen=True)
class RulePart:
    """One part of the rule: how many parameters it counts, its bytes per parameter, and the measured
    bytes (the most the step held of that category). ``rule_bytes`` None: no rule for it."""

    part: str
    params: int
    rule_bytes: int | None
    measured_bytes: int
    rule_words: str
    beyond_words: str = ""  # what the measured bytes hold that the rule does not count

    @property
    def difference_bytes(self) -> int | None:
        """Measured minus the rule (None: no rule)."""
        return None if self.rule_bytes is None else self.measured_bytes - self.rule_bytes

    @property
    def rule_per_param(self) -> float | None:
        return None if self.rule_bytes is None or not self.params else self.rule_bytes / self.params

    @property
    def measured_per_param(self) -> float | None:
        return self.measured_bytes / self.params if self.params else None


@dataclass(frozen=True)
class TeacherView:
    """The rule's parts, the measured split at each phase's own peak, and what the rule leaves out
    at the step's peak (``left_out_bytes``: activations, outputs, inputs, temporaries)."""

    parts: tuple[RulePart, ...]
    phases: tuple[tuple[str, MemorySplit], ...]
    total_params: int
    trainable_params: int
    optimizer: str | None
    peak_bytes: int
    left_out_bytes: int

    @property
    def rule_bytes(self) -> int | None:
        parts = [p.rule_bytes for p in self.parts]
        return None if any(b is None for b in parts) else sum(b for b in parts if b is not None)

    @property
    def weights_per_param(self) -> float | None:
        """The rule's bytes per parameter for the weights (every parameter, frozen ones too)."""
        return self.parts[0].rule_per_param

    @property
    def per_trainable_param(self) -> float | None:
        """The rule's gradient and optimizer-state bytes per trainable parameter (None: no rule)."""
        grads, state = self.parts[1].rule_bytes, self.parts[2].rule_bytes
        if grads is None or state is None or not self.trainable_params:
            return None
        return (grads + state) / self.trainable_params

    @property
    def rule_per_param(self) -> float | None:
        """The familiar figure, for a full fine-tune only (every parameter trainable): 16 for
        mixed-precision AdamW, 16 for fp32 AdamW too (4 + 4 + 8). None otherwise."""
        b = self.rule_bytes
        if b is None or not self.total_params or self.trainable_params != self.total_params:
            return None
        return b / self.total_params


def _phase_peaks(m: Measurement) -> tuple[tuple[str, MemorySplit], ...]:
    """The split at the highest point of each phase the step ran, in step order."""
    t = m.timeline
    cats = t.by_category
    names = list(cats)
    best: dict[str, tuple[int, int]] = {}
    for i, phase in enumerate(t.phase):
        total = sum(cats[c][i] for c in names)
        if phase not in best or total > best[phase][0]:
            best[phase] = (total, i)
    order = [p for p in PHASES if p in best]
    return tuple((p, MemorySplit(**{c: cats[c][best[p][1]] for c in names})) for p in order)


def _most(m: Measurement, category: str) -> int:
    series = m.timeline.by_category.get(category, ())
    return max(series) if series else getattr(m.peak_split, category)


def teacher_view(m: Measurement, model: nn.Module, optimizer: str | None, *, master: bool = False) -> TeacherView:
    """The rule of thumb for ``model`` (as the step ran it: dtypes after the plan's cast, adapters
    in place) and ``optimizer`` (a vocabulary name; None where the workload's own is not one)."""
    seen: set[int] = set()
    total = trainable = weight_bytes = grad_bytes = 0
    trainable_sizes: list[int] = []
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        weight_bytes += p.numel() * p.element_size()
        if p.requires_grad:
            trainable += p.numel()
            grad_bytes += p.numel() * p.element_size()
            trainable_sizes.append(p.element_size())
    param_bytes = max(set(trainable_sizes), key=trainable_sizes.count) if trainable_sizes else 4
    per = state_bytes_per_param(optimizer, param_bytes, master)
    state_words = (
        f"{optimizer}: {per:g} B per trainable parameter" + (" (incl. 4 B fp32 master weights)" if master else "")
        if per is not None
        else "no rule for this optimizer"
    )
    parts = (
        RulePart(
            "weights",
            total,
            weight_bytes,
            _most(m, "parameters"),
            "2 B (bf16/fp16) or 4 B (fp32) each",
            "the model's buffers (batch-norm statistics, rotary frequencies)"
            if any(True for _ in model.buffers())
            else "",
        ),
        RulePart("gradients", trainable, grad_bytes, _most(m, "gradients"), "trainable parameters, their dtype"),
        RulePart(
            "optimizer state",
            trainable,
            None if per is None else round(per * trainable),
            _most(m, "optimizer_state"),
            state_words,
            _STATE_EXTRA.get(optimizer or "", ""),
        ),
    )
    s = m.peak_split
    return TeacherView(
        parts=parts,
        phases=_phase_peaks(m),
        total_params=total,
        trainable_params=trainable,
        optimizer=optimizer,
        peak_bytes=m.peak_bytes,
        left_out_bytes=s.activations + s.outputs + s.inputs + s.temporaries,
    )
