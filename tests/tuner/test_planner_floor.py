"""The planner's estimate never goes below what no plan frees: parameters, gradients, optimizer state.

Region reductions are shares measured once and summed; on a small model their sum can exceed the
activations left to take (a screen showed "save_matmuls layers.0: est. peak -480.8 MiB")."""

from __future__ import annotations

from memsave_nb import zoo
from memsave_nb.plan import Plan
from memsave_nb.planner import GPUS, step_cost
from memsave_nb.planner.search import _Config, _estimate
from memsave_nb.target import Target, measure_peak

REGIONS = ["blocks.0", "blocks.1"]


def test_reductions_larger_than_the_activations_stop_at_the_resident_bytes():
    wl = zoo.gpt(
        zoo.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0), batch_size=2
    )
    m = measure_peak(wl, Plan())
    cfg = _Config("as given", Plan(), m, step_cost(wl, Plan(), REGIONS, GPUS["H100"]))
    # the oracle: weights, their gradients and AdamW's two moments, counted from the model itself
    params = sum(p.numel() * p.element_size() for p in wl.model.parameters())
    resident = 4 * params  # parameters + gradients + exp_avg + exp_avg_sq, all float32 here
    assert m.peak_bytes - resident > 0  # there are activations to take
    huge = 10 * m.peak_bytes  # each region "saves" ten times the whole peak
    options = {(r, "save_matmuls"): (float(huge), 0.0) for r in REGIONS}
    for k in (1, 2):
        c = _estimate(cfg, {r: "save_matmuls" for r in REGIONS}, options, {}, k, 2, Target(80), GPUS["H100"])
        assert c.est_peak_bytes >= resident, (k, c.est_peak_bytes, resident)
        assert c.est_peak_bytes <= resident + 64 * 1024  # the floor, not some other large number
        assert c.fits
    # with no region assigned the estimate is the measured peak, untouched by the floor
    assert _estimate(cfg, {}, options, {}, 1, 2, Target(80), GPUS["H100"]).est_peak_bytes == m.peak_bytes
