"""Builders for the tests: a real 6-D paged KV cache, its per-layer views, and scattered block tables."""
from __future__ import annotations

import torch

from kernels import _triton_utils as tu

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not tu.INTERPRET else "cpu")
LAYER = 1  # of 2: the views are strided in dims 0-2, as the engine passes them


def kv_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
             gen: torch.Generator) -> torch.Tensor:
    """``[num_blocks, num_layers=2, 2, block_size, kv_heads, head_dim]`` filled with N(0, 1)."""
    shape = (num_blocks, 2, 2, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=DEVICE)


def layer_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cache[:, LAYER, 0], cache[:, LAYER, 1]


def block_tables(seq_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator,
                 spare_columns: int = 1) -> torch.Tensor:
    """Each sequence gets distinct, shuffled blocks; unused columns hold valid (unread) ids."""
    width = max((n + block_size - 1) // block_size for n in seq_lens) + spare_columns
    ids = torch.randperm(num_blocks, generator=gen)
    assert len(seq_lens) * width <= num_blocks, "test cache too small"
    return ids[: len(seq_lens) * width].view(len(seq_lens), width).to(torch.int32).to(DEVICE)


def lens_tensor(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# Tolerances of a kernel against its reference on the same inputs. Both accumulate in fp32; the kernel's
# online softmax / tiled sums reorder fp32 additions (~1e-6 relative at these sizes), and both round the
# result to the output dtype once, so fp16/bf16 may differ by about one output ulp (2^-10 / 2^-7 relative)
# plus, on GPU, the rounding of the probabilities to fp16/bf16 before the PV product. The bounds sit a small
# factor above that: a wrong mask, scale, block lookup or head mapping gives errors of order 1e-1 to 1.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all(), "kernel produced NaN/inf"
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOLERANCES[expected.dtype])
