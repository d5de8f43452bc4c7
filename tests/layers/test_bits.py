import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memsave_nb.layers._bits import pack_bits, packed_nbytes, unpack_bits


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4), seed=st.integers(0, 99))
def test_pack_roundtrip_and_size(shape: list[int], seed: int) -> None:
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.5
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(mask.numel()) == -(-mask.numel() // 8)
    assert torch.equal(unpack_bits(packed, mask.shape), mask)


def test_pack_ignores_memory_format() -> None:
    mask = torch.rand(2, 3, 4, 5) > 0.5
    packed = pack_bits(mask.to(memory_format=torch.channels_last))
    assert torch.equal(unpack_bits(packed, mask.shape), mask)
