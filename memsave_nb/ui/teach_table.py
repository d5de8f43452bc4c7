"""The teacher's view as text cells (CLI, HTML report): the bytes-per-parameter rule beside the
measured bytes, and the measured split at each phase's peak (``measure/rule_of_thumb.py``)."""

from __future__ import annotations

from .format import format_bytes, format_count, format_delta_bytes


def _per(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}".rstrip("0").rstrip(".") + " B"


def rule_table(view) -> tuple[list[str], list[list[str]]]:
    """Part, parameters counted, the rule (B/param, bytes), measured (bytes, B/param), difference."""
    headers = ["Part", "Params", "Rule B/param", "Rule", "Measured", "Measured B/param", "Measured - rule"]
    rows = [
        [
            p.part,
            format_count(p.params),
            _per(p.rule_per_param),
            "-" if p.rule_bytes is None else format_bytes(p.rule_bytes),
            format_bytes(p.measured_bytes),
            _per(p.measured_per_param),
            "-" if p.difference_bytes is None else format_delta_bytes(p.difference_bytes),
        ]
        for p in view.parts
    ]
    rule = view.rule_bytes
    measured = sum(p.measured_bytes for p in view.parts)
    rows.append(
        [
            "rule total",
            f"{format_count(view.trainable_params)} trainable",
            _rates(view),
            "-" if rule is None else format_bytes(rule),
            format_bytes(measured),
            "",
            "-" if rule is None else format_delta_bytes(measured - rule),
        ]
    )
    return headers, rows


def _rates(view) -> str:
    """``16 B`` on a full fine-tune; ``2 B + 12 B/trainable`` where some parameters are frozen."""
    if view.rule_per_param is not None:
        return _per(view.rule_per_param)
    if view.per_trainable_param is None:
        return "-"
    return f"{_per(view.weights_per_param)} + {_per(view.per_trainable_param)}/trainable"


def phase_table(view) -> tuple[list[str], list[list[str]]]:
    """Each phase's peak split: the rule's three parts, then what it leaves out."""
    headers = ["Phase peak", "Weights", "Gradients", "Optimizer state", "Activations + outputs", "Other", "Total"]
    rows = [
        [
            phase,
            format_bytes(s.parameters),
            format_bytes(s.gradients),
            format_bytes(s.optimizer_state),
            format_bytes(s.activations + s.outputs),
            format_bytes(s.inputs + s.temporaries),
            format_bytes(s.total),
        ]
        for phase, s in view.phases
    ]
    return headers, rows


def teach_lines(view) -> list[str]:
    """One-line sentences under the tables: the familiar figure and what the rule leaves out."""
    if view.per_trainable_param is None:
        head = f"Rule of thumb: no rule for optimizer {view.optimizer or 'of this workload'}"
    else:
        head = (
            f"Rule of thumb: {_per(view.weights_per_param)} per parameter (weights) + "
            f"{_per(view.per_trainable_param)} per trainable parameter (gradients, optimizer state)"
        )
        if view.rule_per_param is not None:
            head += f" = {_per(view.rule_per_param)} per parameter"
        head += (
            f": {format_bytes(view.rule_bytes or 0)} for {format_count(view.trainable_params)} trainable of "
            f"{format_count(view.total_params)}"
        )
    head += f"; measured peak {format_bytes(view.peak_bytes)}"
    lines = [
        head,
        f"The rule leaves out {format_bytes(view.left_out_bytes)} at the peak: activations kept for backward, "
        "outputs, inputs and temporaries",
    ]
    lines += [f"{p.part}: the measured bytes also hold {p.beyond_words}" for p in view.parts if p.beyond_words]
    return lines
