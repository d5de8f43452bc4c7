"""Under torch.autocast a Linear saves autocast's bf16 copy of its weight for backward (the cast is
an op of its own, aten._to_copy): the MLP demo keeps more under bf16 autocast than in fp32. The
count is checked against the analytic size of those copies, and the measurement says so."""

import torch

from memsave_nb import measure, zoo


def test_autocast_weight_copies_are_counted_and_explained():
    workload = zoo.make("mlp")
    fp32 = measure(workload, repeats=0)
    bf16 = measure(workload.replace(autocast_dtype=torch.bfloat16), repeats=0)
    linears = [m for m in workload.model if isinstance(m, torch.nn.Linear)]
    batch = workload.make_batch()
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    # the first Linear's input needs no grad: it saves the bf16 copy of its input, not of its weight;
    # every later Linear needs its weight for the input's gradient: a bf16 copy of each weight
    weight_copies = sum(m.weight.numel() * 2 for m in linears[1:])
    input_copy = x.numel() * 2
    casts = next(o for o in bf16.ops if o.op == "aten._to_copy")
    assert casts.saved_bytes == weight_copies + input_copy
    assert bf16.saved_bytes > fp32.saved_bytes
    assert not any("autocast" in line for line in fp32.advice)
    hint = [line for line in bf16.advice if "autocast's low-precision copies" in line]
    assert len(hint) == 1 and f"{casts.saved_bytes / 2**20:.1f} MiB" in hint[0]
