"""``--json``: the answer as one JSON object on stdout, for scripts and CI (schema in docs/cli.md).

The same figures as the text (the same measurement, the same searches); bytes are integers,
nothing is formatted. ``SCHEMA`` names the shape: a change that drops or renames a key bumps it."""

from __future__ import annotations

import json
import sys
from typing import Any

REPORT_SCHEMA = "memsave_nb.report/1"
PLAN_SCHEMA = "memsave_nb.plan/1"


def dump(obj: dict) -> None:
    """One JSON object and a newline on stdout (nothing else is printed)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def verdict_of(target, measurement) -> dict:
    """The verdict the text prints: the allocator replay's where the step has one (reserved memory +
    CUDA context against the whole GPU, no 80% rule), else the headroom line's. ``line`` is stdout's."""
    from ..target import reserved_verdict
    from .target import verdict_line

    replayed = reserved_verdict(target, measurement)
    if replayed is not None:
        line = replayed.lines()[0]
        return {
            "fits": replayed.fits,
            "rule": "allocator replay",
            "total_bytes": replayed.total_bytes,
            "verdict": line.split(": ", 1)[1],
            "line": line,
        }
    line = verdict_line(target, measurement.peak_bytes)
    return {
        "fits": target.fits(measurement.peak_bytes),
        "rule": "headroom",
        "total_bytes": measurement.peak_bytes,
        "verdict": line.split(": ", 1)[1],
        "line": line,
    }


def target_json(target) -> dict:
    return {"gb": target.gb, "headroom": target.headroom, "usable_bytes": target.usable_bytes}


def search_json(r) -> dict:
    """A max-batch / max-sequence search (``target.SearchResult``)."""
    return {
        "value": r.value,
        "peak_bytes": r.peak_bytes,
        "probes": [[v, p] for v, p in r.probes],
        "limit": r.limit or None,
        "notes": list(r.notes),
    }


def measurement_json(m, *, top: int | None = None) -> dict:
    """A Measurement's answer: peak, phase, split, totals, and the layers that save the most."""
    layers = sorted((s for s in m.modules if s.name), key=lambda s: -s.saved_bytes_own)
    if top is not None:
        layers = layers[:top]
    return {
        "peak_bytes": m.peak_bytes,
        "peak_phase": m.peak_phase,
        "steady_state": m.steady_state,
        "first_step_peak_bytes": m.first_step_peak_bytes,
        "split": dict(m.peak_split.as_dict()),
        "saved_bytes": m.saved_bytes,
        "output_bytes": m.output_bytes,
        "flops": m.flops,
        "step_seconds": m.step_seconds,
        "mode": m.mode,
        "device": m.device,
        "cuda_peak_bytes": m.cuda_peak_bytes,
        "layers": [
            {"name": s.name, "type": s.type_name, "saved_bytes_own": s.saved_bytes_own, "saved_bytes": s.saved_bytes}
            for s in layers
        ],
        "host": host_json(m),
        "advice": list(m.advice),
        "notes": list(m.notes),
    }


def host_json(m) -> dict | None:
    """``Measurement.host`` (all zero when nothing is offloaded; null where it was not counted)."""
    host = getattr(m, "host", None)
    if host is None:
        return None
    return {
        "peak_bytes": host.peak_bytes,
        "to_host_bytes": host.to_host_bytes,
        "to_device_bytes": host.to_device_bytes,
        "tensors": host.tensors,
    }


def teach_json(view) -> dict | None:
    """The teacher's view (``measure/rule_of_thumb.py``): the rule's parts beside the measured bytes."""
    if view is None:
        return None
    return {
        "optimizer": view.optimizer,
        "total_params": view.total_params,
        "trainable_params": view.trainable_params,
        "rule_bytes": view.rule_bytes,
        "rule_bytes_per_param": view.rule_per_param,
        "weights_bytes_per_param": view.weights_per_param,
        "bytes_per_trainable_param": view.per_trainable_param,
        "parts": [
            {
                "part": p.part,
                "params": p.params,
                "rule_bytes": p.rule_bytes,
                "rule_bytes_per_param": p.rule_per_param,
                "measured_bytes": p.measured_bytes,
                "measured_bytes_per_param": p.measured_per_param,
                "difference_bytes": p.difference_bytes,
                "rule": p.rule_words,
                "measured_also_holds": p.beyond_words or None,
            }
            for p in view.parts
        ],
        "phases": [{"phase": phase, **split.as_dict()} for phase, split in view.phases],
        "peak_bytes": view.peak_bytes,
        "left_out_bytes": view.left_out_bytes,
    }


def report_json(args: Any, cw, plan, measurement, title: str, top: int | None, notes=(), teach=None) -> dict:
    """``report --json``: the setup, the measurement, the teacher's view (``teach``), and with
    ``--target-gb`` the verdict and searches."""
    from .setup_words import setup_words

    seq = getattr(getattr(cw.workload, "batch", None), "seq_len", None)
    out: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "title": title,
        "setup": {
            "model": cw.name,
            "lora": getattr(args, "lora", None),
            "quantize": getattr(args, "quantize", None),
            "seq_len": seq if cw.hub and isinstance(seq, int) else None,
            "batch": plan.batch_size or cw.batch,
            "plan": None if plan.is_empty else plan.describe(),
            "loop": cw.workload.loop,
            "words": setup_words(args, cw.workload, cw.hub).lstrip(", ") or None,
        },
        **measurement_json(measurement, top=top),
        "teach": teach_json(teach),
        "target": None,
        "max_batch": None,
        "max_seq": None,
    }
    out["notes"] = out["notes"] + list(notes)
    if args.target_gb is not None:
        from ..target import max_batch, max_seq_len
        from .target import _same_probe, cli_target

        target = cli_target(args)
        out["target"] = {**target_json(target), **verdict_of(target, measurement)}
        if args.max_batch:
            out["max_batch"] = search_json(
                max_batch(cw.workload, plan, target, measured=_same_probe(cw.workload, plan, measurement))
            )
        if args.max_seq:
            out["max_seq"] = search_json(max_seq_len(cw.workload, plan, target))
    return out


def candidate_json(c) -> dict:
    return {
        "label": c.label,
        "est_peak_bytes": c.est_peak_bytes,
        "est_seconds": c.est_seconds,
        "fits": c.fits,
        "measured_peak_bytes": c.measured_peak_bytes,
        "measured_seconds": c.measured_seconds,
    }


def plan_json(args: Any, result, hints=None, target=None) -> dict:
    """``plan --json`` (one device): the front, the chosen plan (as code and as a Plan file's JSON)."""
    chosen = result.chosen
    return {
        "schema": PLAN_SCHEMA,
        "model": args.model,
        "target": target_json(result.target),
        "summary": result.summary(),
        "candidates": len(result.candidates),
        "fitting": len(result.fitting),
        "front": [candidate_json(c) for c in result.front],
        "chosen": None
        if chosen is None
        else {
            **candidate_json(chosen),
            "plan": json.loads(chosen.plan.to_json()),
            "code": chosen.plan.to_code(loop=getattr(args, "loop", "loss_only")),
        },
        "knobs_alone": None
        if hints is None
        else [{"knob": h.knob, "change": h.change, "peak_bytes": h.peak_bytes, "fits": h.fits} for h in hints],
        "notes": list(result.notes),
    }
