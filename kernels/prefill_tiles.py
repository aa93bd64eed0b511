"""The prefill attention kernel's tile configs (kernels/prefill_attention.py): the launch shapes the autotuner
chooses among on CUDA, per dtype and head size, with the reasons measured for them, and the single config of the
fp32 path and of the interpreter."""
from __future__ import annotations

import dataclasses

import torch
import triton

from kernels import _triton_utils as tu


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One launch shape of the kernel: query rows and K/V tokens per tile, warps, software-pipeline stages."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def triton(self) -> triton.Config:
        return triton.Config({"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}, num_warps=self.num_warps,
                             num_stages=self.num_stages)


# sm_90, fp16/bf16 (compiled for an H100 by tests/kernels/sm90_compile.py's stand-in driver: registers, shared
# memory, no spills in the first config): FlashAttention-2's 128 query rows on two warpgroups (one CTA per SM at
# ~180 registers) or 64 rows on one (two CTAs per SM), K/V tiles of 64 or 128 tokens. The block-table read takes
# a pipeline stage of its own, so num_stages 3 double-buffers K/V and 5 triple-buffers them. 128 x 128 tiles
# sit at the 255-register limit (a few spills with a window or a cap): the autotuner weighs that. The first
# config of each list is the one used untuned; head_dim > 128 halves a tile dim to keep the fp32 accumulator.
CONFIGS_16BIT = (TileConfig(128, 64, 8, 3), TileConfig(128, 64, 8, 5), TileConfig(128, 128, 8, 3),
                 TileConfig(128, 128, 8, 4), TileConfig(64, 64, 4, 3), TileConfig(64, 128, 4, 3))
CONFIGS_16BIT_WIDE = (TileConfig(64, 64, 8, 3), TileConfig(128, 32, 8, 3))
CONFIGS_FP32 = (TileConfig(64, 32, 4, 2),)  # fp32 is the correctness path (3xTF32 dots), not a fast one
CONFIGS_INTERPRET = (TileConfig(32, 16, 4, 1),)  # large tiles are cheap there, tiny test shapes need several


def configs_for(dtype: torch.dtype, head_dim: int) -> tuple[TileConfig, ...]:
    if tu.INTERPRET:
        return CONFIGS_INTERPRET
    if dtype == torch.float32:
        return CONFIGS_FP32
    return CONFIGS_16BIT if head_dim <= 128 else CONFIGS_16BIT_WIDE
