"""The per-rank issues' model (33, 40): an embedding, three ``TransformerEncoderLayer``s and a
vocabulary head, cross-entropy on int64 targets the loss closure holds; batch 4 x 64."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memsave_nb.workload import Workload

# At smaller shapes (V 200, D 32, T 16) FSDP2's gloo ranks show 9,600 B more in the allocator:
# buffers gloo makes inside its collectives, live at that peak (docs/parallel.md).
V, D, FF, LAYERS, B, T = 1000, 128, 256, 3, 4, 64
LAYER_NAMES = tuple(f"layers.{i}" for i in range(LAYERS))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(D, 4, FF, dropout=0.0, batch_first=True) for _ in range(LAYERS)
        )
        self.head = nn.Linear(D, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def encoder() -> Workload:
    torch.manual_seed(0)
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))

    def loss(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))

    loss.targets = y  # type: ignore[attr-defined]
    return Workload(Encoder(), x, loss=loss, name="encoder")


def shard_with_torch_defaults(model: nn.Module, mesh) -> None:
    """What a user writes from torch's docs: ``fully_shard`` per block, then the root, no options
    (``reshard_after_forward=None``: blocks reshard, the root keeps its parameters gathered)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
