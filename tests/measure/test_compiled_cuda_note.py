"""A compiled (profiler-counted) step sized for CUDA says its attention was not CUDA's: the engine
and the per-rank runner answer SDPA with CUDA's kernel choice on fake tensors only, and a compiled
step runs real CPU tensors."""

import torch
import torch.nn.functional as F
from torch import nn

from memsave_nb import Workload
from memsave_nb.measure.compiled import measure_compiled


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_a_compiled_step_sized_for_cuda_says_its_attention_is_the_cpus():
    torch.manual_seed(0)
    wl = Workload(Attention(), torch.randn(2, 8, 16), loss=lambda o: o, name="attn")
    plain = measure_compiled(wl, repeats=0, warmup=0)
    sized = measure_compiled(wl.replace(sized_for="cuda", gpu="h100"), repeats=0, warmup=0)
    assert not any("sized for CUDA" in n for n in plain.notes)
    (note,) = [n for n in sized.notes if "sized for CUDA" in n]
    assert note.startswith("sized for CUDA (h100), but this step ran real tensors on cpu") and len(note) < 300
